"""The KV each streaming session holds, published from the scheduler for the stream API's listings.

A live stream (``/v1/streams``, :mod:`cords_vllm.streams`) is one resumable vLLM request; the blocks it holds
are known only to the scheduler, in the engine-core process, while the stream API runs in the API-server
process. Like the policy counters (:mod:`cords_vllm.observability`), the scheduler keeps the figures in memory
(:meth:`HeldKVPublisher.__call__` is a step observer: no file I/O on the hot path) and a daemon timer writes
them, at most :data:`~cords_vllm.observability.PUBLISH_INTERVAL_S` seconds after a change, as one small JSON
file per scheduler in the shared metrics directory; :func:`read_held_kv` merges those files.

Only resumable requests (streaming sessions) are published, under every policy (``none`` included), so a
listing compares policies in one place.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cords_vllm.observability import PUBLISH_INTERVAL_S, metrics_dir

SUBDIR = "held-kv"


@dataclass(frozen=True)
class HeldKV:
    """What one session holds now.

    Attributes
    ----------
    blocks:
        Paged KV blocks held (null entries of evicted blocks excluded).
    tokens:
        Tokens whose KV is held (``stream_tokens`` less the evicted ones).
    stream_tokens:
        Tokens the session has computed so far (its logical length).
    """

    blocks: int
    tokens: int
    stream_tokens: int


def _snapshot(scheduler: Any, compressor: Any) -> dict[str, HeldKV]:
    from cords_vllm.engine.scheduler import non_null_blocks

    rows = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    out: dict[str, HeldKV] = {}
    for req_id, request in scheduler.requests.items():
        if not getattr(request, "resumable", False):
            continue
        state = compressor.states.get(req_id) if compressor is not None else None
        computed = request.num_computed_tokens
        out[req_id] = HeldKV(blocks=non_null_blocks(rows.get(req_id, []), state),
                             tokens=computed - (state.evicted_tokens if state is not None else 0),
                             stream_tokens=computed)
    return out


class HeldKVPublisher:
    """Step observer of one scheduler: publishes its sessions' :class:`HeldKV` off the hot path.

    ``compressor``: the scheduler's :class:`~cords_vllm.engine.scheduler.SchedulerCompressor` (``None`` without
    a policy), whose states say what each request evicted.
    """

    def __init__(self, compressor: Any = None, interval: float = PUBLISH_INTERVAL_S) -> None:
        self.compressor = compressor
        directory = metrics_dir()
        self.path = directory / SUBDIR / f"scheduler-{os.getpid()}.json" if directory else None
        self.interval = interval
        self._current: dict[str, HeldKV] = {}
        self._published: dict[str, HeldKV] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def __call__(self, scheduler: Any, _output: Any) -> None:
        current = _snapshot(scheduler, self.compressor)
        with self._lock:
            if current == self._current:
                return
            self._current = current
            if self._timer is None:
                self._timer = threading.Timer(self.interval, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Write the current figures now (skipped when unchanged)."""
        with self._lock:
            self._timer = None
            current = self._current
            if current == self._published or self.path is None:
                return
            self._published = current
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: asdict(v) for k, v in current.items()}))
        os.replace(tmp, self.path)


def read_held_kv(directory: Path | None = None) -> dict[str, HeldKV]:
    """Every scheduler's published sessions, by the engine's internal request id."""
    directory = directory or metrics_dir(create=False)
    out: dict[str, HeldKV] = {}
    if directory is None or not (directory / SUBDIR).is_dir():
        return out
    for file in (directory / SUBDIR).glob("*.json"):
        try:
            values = json.loads(file.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now: the next read sees it
        out.update({k: HeldKV(**v) for k, v in values.items()})
    return out
