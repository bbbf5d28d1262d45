#!/usr/bin/env bash
# Run the checks that need a CUDA GPU (skipped on CPU-only machines) in an environment with the CUDA build:
#   pip install -e '.[cuda,dev]' && bash scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -rs tests/engine/test_cuda.py tests/compress "$@"
