"""The child processes of the GPU check: the checkout they run in, their environment, the error a log names."""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The checkout this module runs from (``scripts/``, ``tests/``, ``pyproject.toml``).
REPO = Path(__file__).resolve().parents[3]

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def python_env() -> dict[str, str]:
    """Environment of a child Python: offline, its own engine settings and metrics directory."""
    env = {**os.environ, **OFFLINE_ENV}
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "CORDS_VLLM_METRICS_DIR"):
        env.pop(name, None)
    return env


def first_error(log: str) -> str:
    """The first ``SomeError: message`` line of a server log (what ended it), else its last line."""
    for line in log.splitlines():
        if "ulimit" in line:
            continue
        match = re.search(r"\b([A-Z]\w*(?:Error|Exception|Exit)): (.+)$", line)
        if match:
            return f"{match.group(1)}: {match.group(2)}"[:300]
    lines = [line for line in log.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(empty log)"
