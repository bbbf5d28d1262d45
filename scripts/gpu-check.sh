#!/usr/bin/env bash
# One check a GPU user runs (docs/how-it-works.md#checking-on-a-gpu): python -m cords_vllm.lab.gpu_check.
#
#   bash scripts/gpu-check.sh                  # GPU machine: install .[cuda,dev,ray] into .venv-cuda, then every step
#   bash scripts/gpu-check.sh --skip-install   # the same, reusing .venv-cuda (or $PYTHON's environment) as it is
#   bash scripts/gpu-check.sh --cpu            # the same steps on vLLM's CPU build in .venv (no install, no CUDA tests)
#   bash scripts/gpu-check.sh --no-install     # GPU host with no network or package index: install nothing, use what
#                                              # $PYTHON (python3) imports; this checkout goes first on PYTHONPATH
#
# Steps: the tiny Qwen2-VL (bf16); per attention backend (FLASH_ATTN and TRITON_ATTN on CUDA) plain vLLM with no
# plugin loaded (the control), `--kv-policy none` and `--kv-policy cords`, and cords with --kv-cache-dtype fp8 and
# on Ray, each sent concurrent video chats and one live stream (/v1/streams); none = plain vLLM and cords = none on
# videos under the budget (tokens, log-probs); /metrics compressions; every KV block back; the fp32 HF exactness
# check; pytest on the CUDA-gated tests. Prints one summary table (step, PASS / FAIL /
# SKIP with the reason, seconds), writes it and every log to --out (default gpu-check-out/), and exits 1 when
# any step failed. Other flags: --venv PATH, --jobs N, --help.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

for arg in "$@"; do
  if [ "$arg" = "--cpu" ]; then
    VENV=${VENV:-.venv}
    # the project's CPU environment, created on first use (make setup)
    [ -f "$VENV/.cords-vllm-installed" ] || make -s setup VENV="$VENV"
    exec "$VENV/bin/python" -m cords_vllm.lab.gpu_check "$@"
  fi
done
for arg in "$@"; do
  if [ "$arg" = "--no-install" ]; then
    # the servers' processes import the plugin from this checkout, whatever else is on the path
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    exec "${PYTHON:-python3}" -m cords_vllm.lab.gpu_check "$@"
  fi
done
# GPU mode: any Python >= 3.11 starts it; the check installs into --venv and continues under that Python.
exec "${PYTHON:-python3}" -m cords_vllm.lab.gpu_check "$@"
