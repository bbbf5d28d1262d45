"""Start and stop vLLM's own router (``vllm-router``, the ``router`` extra) in front of servers on 127.0.0.1.

Used by the scale-out tests: the router runs in its own session (process group) and is stopped by PID, like
:class:`~cords_vllm.lab.serving.process.VLLMServer`. Its Prometheus exporter gets a free port too, so several
routers can run at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from cords_vllm.lab.serving.process import free_port


def router_executable() -> str | None:
    """The ``vllm-router`` console script of this interpreter's environment, else the one on PATH, else None."""
    local = Path(sys.executable).with_name("vllm-router")
    if local.is_file():
        return str(local)
    return shutil.which("vllm-router")


class VLLMRouter:
    """``vllm-router --worker-urls URL... --policy POLICY`` on a free port of 127.0.0.1; a context manager.

    ``api_key`` is the key the router sends to the workers (vLLM's ``--api-key``); the router itself checks none.
    """

    def __init__(self, worker_urls: Sequence[str], policy: str = "sticky_least_loaded", *,
                 api_key: str | None = None, args: Sequence[str] = (), env: dict[str, str] | None = None,
                 startup_timeout: float = 60.0) -> None:
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.api_key = api_key
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log", delete=False)  # noqa: SIM115

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        exe = router_executable()
        if exe is None:
            raise FileNotFoundError("no `vllm-router` executable: pip install 'cords-vllm[router]'")
        cmd = [exe, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *self.worker_urls,
               "--policy", self.policy, "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--log-level", "info"]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + self.args

    def start(self) -> VLLMRouter:
        self.proc = subprocess.Popen(self.command(), env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"vllm-router did not become healthy in {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the router by PID (SIGKILL its group if it lingers)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def __enter__(self) -> VLLMRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        """The whole log, ANSI colours removed (the router logs each session it places)."""
        import re

        self._log.flush()
        return re.sub(r"\x1b\[[0-9;]*m", "", Path(self._log.name).read_text(errors="replace"))
