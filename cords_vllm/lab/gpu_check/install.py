"""The GPU check's install (GPU mode): the project into its own virtualenv, which the check then continues under."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cords_vllm.lab.gpu_check.processes import REPO, first_error, python_env
from cords_vllm.lab.gpu_check.rows import Fail, Row, timed


def install_row(venv: Path) -> Row:
    """Create ``venv`` (once) and install the project with ``.[cuda,dev,ray]`` into it (the pattern of
    ``scripts/setup-env.sh``, without the CPU wheels' fixes, which a CUDA install does not need)."""

    def install() -> str:
        python = venv / "bin" / "python"
        if not python.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        version = subprocess.run([str(python), "-c", "import sys; print(sys.version_info >= (3, 11))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        if version != "True":
            raise Fail(f"{venv} has a Python older than 3.11")
        log = venv / "pip-install.log"
        with log.open("w") as f:
            proc = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-e",
                                   ".[cuda,dev,ray]"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0:
            tail = [line for line in log.read_text().splitlines() if line.strip()][-3:]
            raise Fail(f"pip install failed (full log: {log}): {' | '.join(tail)}")
        probe = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                               env=python_env(), capture_output=True, text=True, check=False)
        if probe.returncode != 0:
            raise Fail(f"installed, but vLLM does not import: {first_error(probe.stderr)}")
        (venv / ".cords-vllm-cuda-installed").touch()
        vllm_version, torch_version = probe.stdout.split()
        return f"{venv}: vLLM {vllm_version}, torch {torch_version}"

    return timed("install .[cuda,dev,ray]", install)
