"""Start and stop vLLM's own router (``vllm-router``, the ``router`` extra) in front of servers on 127.0.0.1.

Used by the scale-out tests: the router runs in its own session (process group) and is stopped by PID, like
:class:`~cords_vllm.lab.serving.process.VLLMServer`. Its Prometheus exporter gets a free port too, so several
routers can run at once.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from cords_vllm.lab.serving.process import LoopbackProcess, free_port


def router_executable() -> str | None:
    """The ``vllm-router`` console script of this interpreter's environment, else the one on PATH, else None."""
    local = Path(sys.executable).with_name("vllm-router")
    if local.is_file():
        return str(local)
    return shutil.which("vllm-router")


class VLLMRouter(LoopbackProcess):
    """``vllm-router --worker-urls URL... --policy POLICY`` on a free port of 127.0.0.1; a context manager.

    ``api_key`` is the key the router sends to the workers (vLLM's ``--api-key``); the router itself checks none.
    """

    name = "vllm-router"
    log_prefix = "vllm-router-"

    def __init__(self, worker_urls: Sequence[str], policy: str = "sticky_least_loaded", *,
                 api_key: str | None = None, args: Sequence[str] = (), env: dict[str, str] | None = None,
                 startup_timeout: float = 60.0) -> None:
        super().__init__(env={**os.environ, **(env or {})}, startup_timeout=startup_timeout, poll_s=0.2)
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.api_key = api_key
        self.args = list(args)

    def command(self) -> list[str]:
        exe = router_executable()
        if exe is None:
            raise FileNotFoundError("no `vllm-router` executable: from a checkout of cords-vllm, "
                                    "pip install '.[router]'")
        cmd = [exe, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *self.worker_urls,
               "--policy", self.policy, "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--log-level", "info"]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + self.args

    def start(self) -> VLLMRouter:
        super().start()
        return self

    def stop(self, timeout: float = 20.0) -> int | None:
        return super().stop(timeout)

    def log_text(self) -> str:
        """The whole log, ANSI colours removed (the router logs each session it places)."""
        import re

        self._log.flush()
        return re.sub(r"\x1b\[[0-9;]*m", "", Path(self._log.name).read_text(errors="replace"))
