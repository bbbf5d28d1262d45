"""A bounded soak of the stream API: streams opened, fed and closed at random, clients vanishing mid-request.

``workers`` client threads each loop until ``minutes`` have passed: open a stream, push a random number of
clips (at most ``max_pushes``), ask now and then, and end it in one of four ways: close it, vanish mid-push
(a raw connection sends half a push's body and is dropped), vanish mid-answer (a streamed answer is dropped
after its first event) or simply walk away (the stream expires). At the end every stream has been closed or
has expired, and the run checks that the server answered no 5xx, that every KV block is back in the pool,
and how the resident memory of the server's processes moved after warm-up.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cords_vllm.client import StreamAPIError, StreamClient, frame_data_url
from cords_vllm.lab.bench.http import scrape


@dataclass
class SoakResult:
    """Counts and checks of one soak."""

    minutes: float
    workers: int
    streams: int = 0
    pushes: int = 0
    questions: int = 0
    endings: Counter = field(default_factory=Counter)
    client_errors: Counter = field(default_factory=Counter)
    server_errors: int = 0
    blocks_in_use_at_end: int | None = None
    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    #: ``(seconds, {process name: MB})``: the same readings per process of the server.
    rss_by_process: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def rss_drift_mb(self) -> float:
        """Mean RSS of the last quarter minus that of the second quarter (after warm-up)."""
        values = [m for _, m in self.rss_mb]
        if len(values) < 8:
            return 0.0
        q = len(values) // 4
        return float(np.mean(values[-q:]) - np.mean(values[q:2 * q]))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["endings"], out["client_errors"] = dict(self.endings), dict(self.client_errors)
        out["rss_drift_mb"] = self.rss_drift_mb()
        return out


def process_tree_rss_mb(root_pid: int) -> dict[str, float]:
    """Resident memory (MB) of ``root_pid`` and each of its descendants, by process name, from ``/proc``."""
    children: dict[int, list[int]] = {}
    rss: dict[int, tuple[str, float]] = {}
    for pid, ppid, name, kb in _proc_statuses():
        children.setdefault(ppid, []).append(pid)
        rss[pid] = (name, kb / 1024)
    out: dict[str, float] = {}
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        if pid in rss:
            name, mb = rss[pid]
            out[f"{name} ({pid})"] = mb
        todo += children.get(pid, [])
    return out


def _proc_statuses() -> list[tuple[int, int, str, float]]:
    from pathlib import Path

    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        kb = float(fields.get("VmRSS", "0 kB").split()[0]) if "VmRSS" in fields else 0.0
        out.append((int(entry.name), int(fields.get("PPid", "0").strip()), fields.get("Name", "?").strip(), kb))
    return out


def _vanish(host: str, port: int, path: str, body: bytes, api_key: str | None, *, read_first: bool) -> None:
    """Send a request and drop the connection: half-way through the body, or after the first bytes back."""
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=60) as sock:
        if read_first:
            sock.sendall(head + body)
            sock.recv(256)
        else:
            sock.sendall(head + body[: len(body) // 2])


def run_soak(base_url: str, *, minutes: float, workers: int, frames: Callable[[random.Random], np.ndarray],
             server_pid: int, total_blocks: int, api_key: str | None = None, max_pushes: int = 12, seed: int = 0,
             idle_timeout_s: float = 10.0, on_event: Callable[[str], None] | None = None) -> SoakResult:
    """Run the soak against ``base_url`` (``frames(rng)`` makes one push's frames); see the module doc."""
    result = SoakResult(minutes=minutes, workers=workers)
    lock = threading.Lock()
    end = time.monotonic() + 60 * minutes
    host, port = base_url.split("//", 1)[1].split(":")
    t0 = time.monotonic()

    def count(attr: str, key: str | None = None) -> None:
        with lock:
            if key is None:
                setattr(result, attr, getattr(result, attr) + 1)
            else:
                getattr(result, attr)[key] += 1
        if on_event and attr == "streams":
            on_event(attr)

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        client = StreamClient(base_url, api_key=api_key, timeout=120)
        while time.monotonic() < end:
            try:
                stream = client.open(metadata={"soak": str(index)})
            except StreamAPIError as exc:
                count("client_errors", f"open {exc.status}")
                if exc.status >= 500:
                    count("server_errors")
                time.sleep(0.5)
                continue
            count("streams")
            ending = rng.choice(["close", "close", "vanish-push", "vanish-answer", "walk-away"])
            try:
                for _ in range(rng.randint(1, max_pushes)):
                    stream.append(frames(rng))
                    count("pushes")
                    if rng.random() < 0.25:
                        stream.ask("What color was the square?", max_tokens=rng.randint(1, 4))
                        count("questions")
                    if time.monotonic() > end:
                        break
                _end_stream(stream, ending, frames(rng) if ending == "vanish-push" else None, host, port, api_key)
                count("endings", ending)
            except StreamAPIError as exc:
                count("client_errors", f"{exc.status}: {exc.message[:60]}")
                if exc.status >= 500:
                    count("server_errors")
            except OSError as exc:
                count("client_errors", f"connection: {type(exc).__name__}")

    stop = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(result, server_pid, t0, stop), daemon=True)
    sampler.start()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # streams left behind (vanished, walked away) expire; then every block must be back
    client = StreamClient(base_url, api_key=api_key, timeout=60)
    deadline = time.monotonic() + idle_timeout_s + 30
    while time.monotonic() < deadline and client.list():
        time.sleep(1.0)
    time.sleep(2.0)
    result.blocks_in_use_at_end = round(total_blocks * scrape(base_url).get("vllm:kv_cache_usage_perc", 1.0))
    stop.set()
    sampler.join()
    return result


def _end_stream(stream: Any, ending: str, push: np.ndarray | None, host: str, port: str,
                api_key: str | None) -> None:
    """End ``stream`` the way ``ending`` says: ``close`` it, ``vanish-push`` (half of a push of ``push``'s frames
    sent, then the connection dropped), ``vanish-answer`` (a streamed answer dropped after its first bytes), or
    ``walk-away`` (nothing: the stream expires)."""
    path = f"/v1/streams/{stream.id}"
    if ending == "close":
        stream.close()
    elif ending == "vanish-push":
        body = json.dumps({"frames": [frame_data_url(f) for f in push]}).encode()
        _vanish(host, port, path + "/frames", body, api_key, read_first=False)
    elif ending == "vanish-answer":
        body = json.dumps({"question": "What color was the square?", "max_tokens": 64,
                           "stream": True}).encode()
        _vanish(host, port, path + "/ask", body, api_key, read_first=True)


def _sample_rss(result: SoakResult, server_pid: int, t0: float, stop: threading.Event) -> None:
    """Until ``stop``: every 2 s, add the server's resident memory (in all and per process) to ``result``."""
    while not stop.is_set():
        now, by_process = time.monotonic() - t0, process_tree_rss_mb(server_pid)
        result.rss_mb.append((now, sum(by_process.values())))
        result.rss_by_process.append((now, by_process))
        stop.wait(2.0)
