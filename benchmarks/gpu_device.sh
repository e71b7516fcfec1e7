#!/bin/sh
# The device copy's GPU checks in one command (under 8 minutes on one GPU): the CUDA cases of the
# tests, then the GPU benchmark (refresh, sample 256 against the host path, prioritized, keeping
# up with 2 writers at 1M rows/s). Results: results/device-gpu.json; copy the figures and the card
# into benchmarks/README.md.
set -e
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 180 python -m pytest -p no:benchmark -p no:xdist -q tests/test_device.py tests/test_loader.py -k cuda
timeout 240 python -m benchmarks.device_copy --device cuda --seconds 4 --ingest 1e6 --out benchmarks/results/device-gpu.json
