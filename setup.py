"""Builds shmbuffer's optional C extension (``shmbuffer/native/_native.c``); the metadata is in
pyproject.toml. Without a working compiler the build of the extension is skipped (``optional``)
and the package runs on its pure-Python path (``shmbuffer.native``)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmbuffer.native._native",
            sources=["shmbuffer/native/_native.c"],
            extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
