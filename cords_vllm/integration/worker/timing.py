"""How long compressions take on the device that runs them, without ever waiting for it.

On a CPU the compress step runs synchronously, so the host's clock around it is its cost. On a GPU the step only
*launches* work: ``time.perf_counter`` around it measures launch time, not what the batch waits for. There each
compression is bracketed by two CUDA events recorded on the current stream; their elapsed time is read once the
end event has completed (``Event.query()``, which never blocks), at the next step or publication. Nothing here
synchronises the device.

A timing failure costs the metric, never a request: the first error from an event (created, recorded, queried
or read) is logged once, the pending measurements are dropped and the timer stops measuring; the compressions
go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timing:
    """One measured compression: the request it compressed and its device seconds."""

    req_id: str
    seconds: float


class CompressionTimer:
    """Times compressions: wall clock on CPU, CUDA events on CUDA (read when complete, never waited for).

    ``event_factory``: makes an event with ``record()``, ``query()`` and ``elapsed_time(end) -> ms``
    (``torch.cuda.Event(enable_timing=True)`` on CUDA); ``None``: the host clock.
    """

    def __init__(self, event_factory: Callable[[], Any] | None = None) -> None:
        self.event_factory = event_factory
        self._pending: deque[tuple[tuple[str, ...], Any, Any]] = deque()
        self._done: list[Timing] = []
        #: Why the timer stopped measuring (the first error an event raised), or ``None``.
        self.failure: str | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> CompressionTimer:
        """CUDA events on a CUDA device, the host clock elsewhere."""
        if device.type == "cuda":
            return cls(lambda: torch.cuda.Event(enable_timing=True))
        return cls()

    @property
    def on_device(self) -> bool:
        """Whether compressions are timed by device events (else the host clock)."""
        return self.event_factory is not None

    def start(self) -> Any:
        """Mark a compression's start (an event recorded on the current stream, or the host clock); ``None`` once
        the timer has failed."""
        if self.event_factory is None:
            return time.perf_counter()
        if self.failure is not None:
            return None
        try:
            event = self.event_factory()
            event.record()
        except Exception as exc:
            self._fail("creating or recording its start event", exc)
            return None
        return event

    def stop(self, req_id: str | Sequence[str], start: Any) -> None:
        """Mark the end of the compression of ``req_id`` begun at ``start``; several requests (compressed together,
        in one call) share its time evenly."""
        req_ids = (req_id,) if isinstance(req_id, str) else tuple(req_id)
        if self.event_factory is None:
            share = (time.perf_counter() - start) / max(1, len(req_ids))
            self._done.extend(Timing(r, share) for r in req_ids)
            return
        if start is None or self.failure is not None:
            return
        try:
            end = self.event_factory()
            end.record()
        except Exception as exc:
            self._fail("recording its end event", exc)
            return
        self._pending.append((req_ids, start, end))

    def completed(self) -> list[Timing]:
        """Compressions measured since the last call, oldest first: on a device, those whose end event has
        completed (events complete in stream order, so the first incomplete one ends the scan)."""
        try:
            while self._pending and self._pending[0][2].query():
                req_ids, start, end = self._pending[0]
                share = start.elapsed_time(end) / 1e3 / max(1, len(req_ids))
                self._pending.popleft()
                self._done.extend(Timing(r, share) for r in req_ids)
        except Exception as exc:
            self._fail("reading a finished compression's events", exc)
        done, self._done = self._done, []
        return done

    def _fail(self, what: str, exc: Exception) -> None:
        self.failure = f"{what}: {type(exc).__name__}: {exc}"
        self._pending.clear()
        logger.warning("cords-vllm: compression timing is off for this worker (%s); selection_seconds stops "
                       "counting, compressions go on", self.failure)

    @property
    def pending(self) -> int:
        """Compressions whose device time is not known yet."""
        return sum(len(req_ids) for req_ids, _, _ in self._pending)
