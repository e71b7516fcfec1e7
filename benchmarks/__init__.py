"""shmbuffer's benchmark harness: ``python -m benchmarks`` (see README.md).

A regular package on purpose: torchrl installs a top-level ``benchmarks`` namespace package into
site-packages, and a regular package wins the import over namespace portions.
"""
