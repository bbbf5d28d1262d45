"""Start, query and stop a real ``vllm serve`` process on 127.0.0.1 (tests, demo, benchmarks).

The server runs in its own session (process group), so stopping it by PID with SIGTERM also ends the
engine core and worker processes vLLM spawned; :meth:`VLLMServer.stop` checks that none survive.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_executable() -> str:
    """The ``vllm`` console script of the running interpreter's environment (else the one on PATH)."""
    local = Path(sys.executable).with_name("vllm")
    if local.is_file():
        return str(local)
    found = shutil.which("vllm")
    if found is None:
        raise FileNotFoundError("no `vllm` executable found next to this Python or on PATH")
    return found


def cpu_bind_all() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` value binding the worker to every core this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cores)


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a CPU ``vllm serve``: offline hub, no usage stats, threads on all allowed cores."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs its engine core in its own process
    env.pop("CORDS_VLLM_METRICS_DIR", None)  # a server's processes share their own, fresh metrics directory
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    })
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind_all())
    env.update(extra or {})
    return env


class LoopbackProcess:
    """A command serving HTTP on a free port of 127.0.0.1, in its own session (process group); a context manager.

    :meth:`start` waits until ``GET /health`` answers 200 (the process's log tail in the error when it exits or
    times out first); :meth:`stop` sends SIGTERM by PID and SIGKILLs the group if it lingers. The log (stdout and
    stderr) outlives both, so a failure can show its tail. Subclasses give :meth:`command` and ``name``.
    """

    name = "process"
    log_prefix = "loopback-"

    def __init__(self, *, port: int | None = None, env: dict[str, str] | None = None,
                 startup_timeout: float = 300.0, poll_s: float = 0.5) -> None:
        self.port = port or free_port()
        self.env = env if env is not None else dict(os.environ)
        self.startup_timeout = startup_timeout
        self.poll_s = poll_s
        self.proc: subprocess.Popen | None = None
        # closed in __del__ by the GC
        self._log = tempfile.NamedTemporaryFile(prefix=self.log_prefix, suffix=".log", delete=False)  # noqa: SIM115

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return self._log.name

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> LoopbackProcess:
        self.proc = subprocess.Popen(self.command(), env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during start-up:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(OSError):
                if self.get("/health", timeout=2.0)[0] == 200:
                    return self
            time.sleep(self.poll_s)
        self.stop()
        raise TimeoutError(f"{self.name} did not become healthy in {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the process by PID and wait (SIGKILL its group after ``timeout``)."""
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

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


class VLLMServer(LoopbackProcess):
    """A ``vllm serve MODEL ARGS...`` subprocess bound to 127.0.0.1 on a free port.

    Use as a context manager; the log (stdout and stderr) goes to a temporary file, whose tail is shown
    when the server fails to start.
    """

    name = "vllm serve"
    log_prefix = "vllm-serve-"

    def __init__(self, model: str | os.PathLike, args: Sequence[str] = (), *, port: int | None = None,
                 env: dict[str, str] | None = None, startup_timeout: float = 300.0) -> None:
        super().__init__(port=port, env=server_env(env), startup_timeout=startup_timeout)
        self.model = str(model)
        self.args = list(args)

    def command(self) -> list[str]:
        return [vllm_executable(), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                *self.args]

    def start(self) -> VLLMServer:
        super().start()
        return self

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the server by PID, wait, and make sure no process of its group is left."""
        if self.proc is None:
            return None
        pgid = self.proc.pid
        status = super().stop(timeout)
        # Children that outlive the server would keep memory and cores: end the whole group.
        deadline = time.monotonic() + 15
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            raise RuntimeError(f"vllm serve (pid {pgid}) left child processes behind; killed them")
        return status

    def post_json(self, path: str, body: dict[str, Any], timeout: float = 600.0) -> tuple[int, dict]:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def model_id(self) -> str:
        status, text = self.get("/v1/models")
        if status != 200:
            raise RuntimeError(f"/v1/models answered {status}: {text}")
        return json.loads(text)["data"][0]["id"]


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a live (non-zombie) member."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group whose only members are zombies still "exists"; check /proc for live members.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
