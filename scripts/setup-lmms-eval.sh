#!/usr/bin/env bash
# Create (once) a separate virtualenv with lmms-eval 0.7.3, the evaluation client that
# benchmarks/lmms_eval.py drives against a `vllm serve --kv-policy cords` server. It is kept apart from
# the project's .venv so that lmms-eval's own pins can never disturb vLLM's.
#
# torch is installed first, pinned (torch==2.13.0, the project's), and held by a constraints file while
# lmms-eval resolves its dependencies: pip then reuses it instead of pulling a multi-GB CUDA build. Where
# a CPU wheel of torch 2.13.0 is not on the configured index or find-links, pass pip options for one
# through LMMS_EVAL_PIP_ARGS (e.g. an --extra-index-url of CPU wheels).
#
# Idempotent: a stamp file in the venv names the installed version; re-running with it present does
# nothing. Environment: PYTHON (interpreter that creates the venv, >= 3.10), LMMS_EVAL_VENV (default
# .lmms-eval-venv in the repository root), LMMS_EVAL_PIP_ARGS (extra pip options).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${LMMS_EVAL_VENV:-.lmms-eval-venv}
LMMS_EVAL_VERSION=0.7.3
TORCH_VERSION=2.13.0
STAMP="$VENV/.lmms-eval-$LMMS_EVAL_VERSION-installed"
# shellcheck disable=SC2206
EXTRA=(${LMMS_EVAL_PIP_ARGS:-})

if [ -f "$STAMP" ]; then
  echo "==> lmms-eval $LMMS_EVAL_VERSION ready: $VENV"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
log="$VENV/pip-install.log"
: >"$log"
pip_install() {
  if ! "$PY" -m pip install --disable-pip-version-check "${EXTRA[@]}" "$@" >>"$log" 2>&1; then
    grep -v "^WARNING: Location .* is ignored" "$log" | tail -40 >&2
    echo "pip install failed (full log: $log)" >&2
    exit 1
  fi
}

constraints="$VENV/lmms-eval-constraints.txt"
echo "torch==$TORCH_VERSION" >"$constraints"
echo "==> installing torch $TORCH_VERSION into $VENV"
pip_install "torch==$TORCH_VERSION"
echo "==> installing lmms-eval $LMMS_EVAL_VERSION (first run: several minutes)"
# [video-legacy] adds decord: lmms-eval's OpenAI model decodes videos on the client with qwen-vl-utils, whose
# only other readers are torchcodec (not in the base install) and torchvision.io.read_video (gone in 0.28).
pip_install -c "$constraints" "lmms-eval[video-legacy]==$LMMS_EVAL_VERSION"

# The torchvision wheel on the index is a CUDA build that a CPU torch cannot load (the same problem the
# project's venv has): put this checkout on the venv's path and install the project's import-time fixes,
# which act only where they are needed (see cords_vllm/cpu_fixes.py; nothing else of the project is used).
echo "==> applying the CPU wheel fixes where needed"
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd >"$site/cords_vllm_checkout.pth"
CORDS_VLLM_NO_CPU_FIXES=1 "$PY" -m cords_vllm.cpu_fixes install

"$PY" -c "import decord, lmms_eval.__main__, lmms_eval.models.chat.openai" \
  || { echo "lmms-eval does not import in $VENV (log: $log)" >&2; exit 1; }
touch "$STAMP"
echo "==> lmms-eval $LMMS_EVAL_VERSION ready: $VENV"
