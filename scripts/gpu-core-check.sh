#!/usr/bin/env bash
# The compress step's GPU check where only torch and Triton are installed (no vLLM, no network, nothing to install).
#
#   bash scripts/gpu-core-check.sh [--out DIR] [--sweep-warps]      # default DIR: gpu-core-check-out/
#
# 1. pytest on the pure core (tests/compress, tests/selection, tests/metrics): with a GPU the CUDA-gated tests run,
#    and the Triton kernels run compiled on CUDA tensors against the PyTorch path; tests that need vLLM skip, saying so.
# 2. benchmarks/compress_step.py: one compression at a 7B model's shape per granularity and anchor set, the Triton
#    kernels against the PyTorch path and the copy floor (wall and GPU ms, launches, host syncs, same kept ids), and
#    the targets, PASS or MISS.
#    With --sweep-warps it then also times the fused step at 4, 8, 16 and 32 warps of its row kernels
#    (plan, finish) and of its greedy kernel, frame, block and token at one anchor (a few minutes more: each setting
#    compiles), today's rule in bold, in the same table: the data to tune them.
# (The benchmark runs first, then the tests: numbers first where a GPU is lent for minutes.)
# 3. benchmarks/step_together.py: a step of 1, 2, 4 and 8 compressions at a 7B model's shape, together (one greedy
#    run for the step on the fused path) against one after another, per implementation, at token granularity (where
#    the greedy run is the cost) and at the default unit.
# One summary at the end; exit 1 when a test failed or a kernel kept other tokens than the PyTorch path.
# On an H100 (16 host cores): the benchmark about 4.5 minutes with --sweep-warps (a minute of it the first row's
# kernel compiles), the tests about 1 minute, step 3 about 1 minute.
# scripts/gpu-check.sh (the whole engine on a GPU) runs the same tests and benchmark among its steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=gpu-core-check-out
SWEEP=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --sweep-warps) SWEEP=(--sweep-warps); shift ;;
    -h|--help) sed -n 2,21p "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
WORKERS=()
if "$PY" -c "import xdist" 2>/dev/null; then WORKERS=(-n 8); fi

start=$(date +%s)
"$PY" -c "import torch, triton; print('device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA', '| torch', torch.__version__, '| Triton', triton.__version__)" | tee "$OUT/device.txt"
# The benchmark first: on a GPU lent for minutes its numbers matter most, and it writes its tables after every row.
"$PY" benchmarks/compress_step.py --out "$OUT" "${SWEEP[@]}" > "$OUT/compress_step.log" 2>&1
bench=$?
"$PY" -m pytest -q -rs -p no:cacheprovider "${WORKERS[@]}" tests/compress tests/selection tests/metrics \
  > "$OUT/pytest.log" 2>&1
tests=$?
together=0
for unit in token auto; do
  "$PY" benchmarks/step_together.py --granularity "$unit" --out "$OUT/step_together_$unit" \
    > "$OUT/step_together_$unit.log" 2>&1 || together=1
done

echo
echo "## cords-vllm GPU core check ($(( $(date +%s) - start )) s)"
echo "tests (exit $tests): $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -1)"
echo "benchmark (exit $bench):"
if [ -f "$OUT/compress_step.md" ]; then cat "$OUT/compress_step.md"; else tail -20 "$OUT/compress_step.log"; fi
echo "a step's compressions together (exit $together):"
for unit in token auto; do tail -8 "$OUT/step_together_$unit.log"; done
echo "logs: $OUT/"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$together" -eq 0 ]
