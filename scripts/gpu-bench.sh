#!/usr/bin/env bash
# Serving at a 7B model's shapes on one GPU, in one command: benchmarks/gpu_bench.py (its docstring says what it
# measures). No weights are read (weightless model directories, vllm serve --load-format dummy).
#
#   bash scripts/gpu-bench.sh            # GPU host: vLLM 0.32's CUDA build importable by $PYTHON (python3): this
#                                        # checkout installed with its cuda extra, or the offline kit (set KIT_DIR
#                                        # to its directory: its env.sh is sourced); this checkout goes first on
#                                        # PYTHONPATH. About 8 minutes.
#   bash scripts/gpu-bench.sh --cpu      # the same steps on vLLM's CPU build in .venv at a scaled-down shape
#   bash scripts/gpu-bench.sh --quick    # CPU: the one-minute subset
#
# Other arguments go to benchmarks/gpu_bench.py (--levels, --budget, --hold, --time-limit, --out, ...). Writes
# gpu_bench.json and gpu_bench.md (GPU: benchmarks/results/gpu_bench/) and prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

args=()
cpu=""
for arg in "$@"; do
  case "$arg" in
    --cpu) cpu=1; args+=(--plan cpu) ;;
    --quick) cpu=1; args+=(--quick) ;;
    *) args+=("$arg") ;;
  esac
done
if [ -n "$cpu" ]; then
  VENV=${VENV:-.venv}
  [ -f "$VENV/.cords-vllm-installed" ] || make -s setup VENV="$VENV"  # the project's CPU environment
  exec "$VENV/bin/python" benchmarks/gpu_bench.py "${args[@]}"
fi
if [ -n "${KIT_DIR:-}" ]; then  # the offline kit's environment, where its install.sh wrote it
  [ -f "$KIT_DIR/env.sh" ] || { echo "gpu-bench: KIT_DIR=$KIT_DIR holds no env.sh (run the kit's install.sh)" >&2; exit 2; }
  # shellcheck disable=SC1091
  . "$KIT_DIR/env.sh"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}  # the offline kit brings no flashinfer
exec "${PYTHON:-python3}" benchmarks/gpu_bench.py --plan gpu "${args[@]}"
