"""The one channel from the engine to the API servers: counters, high-water marks and the KV each stream holds.

What the API server shows (``/metrics``, the stream API's listings) is produced where compression happens: the
scheduler (engine-core process) and the workers. vLLM 0.32 carries only its own fields of ``SchedulerStats``
across that boundary, so every producer owns one :class:`Publisher`:

* :meth:`Publisher.add`, :meth:`Publisher.raise_to` and :meth:`Publisher.hold` run inside scheduler and worker
  steps and only update memory (no file I/O on the hot path). The first change after a publication starts a
  short-lived daemon timer that publishes at most :data:`PUBLISH_INTERVAL_S` seconds later (plus once at exit),
  as one small JSON file per publisher, atomically replaced, in a directory the first process creates and its
  children inherit through ``CORDS_VLLM_METRICS_DIR``.
* :func:`read_published` is the one reader (API-server side): counters summed over publishers, high-water marks
  the largest, and the KV each stream holds **keyed by the request's external id** (the id the API server gave
  the request), so a listing looks each stream up directly.
* The engine also publishes why it ended a request with an error (:meth:`Publisher.end`), so the stream API
  names the reason in its ``410``.
* With several API servers (``--api-server-count N``) vLLM serves ``/metrics`` from ``PROMETHEUS_MULTIPROC_DIR``
  only, so a publisher also adds its increments to ordinary ``prometheus_client`` counters there (high-water
  marks as ``max``-mode gauges); every API server reports the same totals.

Counters (:data:`COUNTERS`, exported as ``cords_vllm_<name>_total``): compressions, evicted and kept candidate
tokens, selection seconds. High-water marks (:data:`PEAKS`): ``cords_vllm_request_kv_blocks_peak``, the most
paged KV blocks one request has held at once, under any policy (``none`` too).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

DIR_ENV = "CORDS_VLLM_METRICS_DIR"
#: Set by vLLM when several processes serve ``/metrics`` (``--api-server-count > 1``).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Longest delay between a change and its publication (seconds).
PUBLISH_INTERVAL_S = 0.5

COUNTERS: dict[str, str] = {
    "compressions": "KV cache compressions carried out by the KV policy",
    "evicted_tokens": "Candidate (video and image) tokens evicted from paged KV caches by the KV policy",
    "kept_tokens": "Candidate tokens kept by KV policy compressions",
    "selection_seconds": "Seconds spent selecting which tokens to keep",
    "nonfinite_compressions": "KV policy compressions whose anchor keys or values held NaN or inf (selection read "
                              "them as 0; the entries were kept or evicted as chosen, never rewritten)",
}
#: High-water marks: only ever raised (:meth:`Publisher.raise_to`); readers take the largest over publishers.
PEAKS: dict[str, str] = {
    "request_kv_blocks_peak": "Most paged KV blocks one request has held at once since start (after a step's "
                              "allocations, before its frees), under any KV policy",
}

#: Reasons of ended requests a publisher keeps (the oldest go first).
ENDED_KEPT = 256

T = TypeVar("T")

_live_publishers: weakref.WeakSet[Publisher] = weakref.WeakSet()
_mp_metrics: dict[str, Any] | None = None
_mp_lock = threading.Lock()
_publisher_numbers = itertools.count()


@dataclass(frozen=True)
class HeldKV:
    """The KV one request holds now ("held": physically in the KV pool, evicted tokens excluded).

    Attributes
    ----------
    blocks:
        Paged KV blocks held (the null entries of evicted blocks excluded).
    tokens:
        Tokens whose KV is held (``stream_tokens`` less the evicted ones).
    stream_tokens:
        Tokens the request has computed so far (its logical length).
    """

    blocks: int
    tokens: int
    stream_tokens: int


@dataclass(frozen=True)
class Published:
    """Everything the engine's publishers have published, as one reader sees it.

    ``counters``: summed over publishers; ``peaks``: the largest; ``streams``: the KV each resumable request
    (live stream) holds, by its external request id; ``ended``: why the engine ended a request with an error,
    by external id (the most recent :data:`ENDED_KEPT` per publisher).
    """

    counters: dict[str, float]
    peaks: dict[str, float]
    streams: dict[str, HeldKV] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        """Counters and high-water marks in one mapping (what ``/metrics`` exports)."""
        return {**self.counters, **self.peaks}


def metrics_dir(create: bool = True) -> Path | None:
    """The shared publication directory (created, and exported to child processes, on first use)."""
    path = os.environ.get(DIR_ENV)
    if path is None and create:
        path = tempfile.mkdtemp(prefix="cords-vllm-metrics-")
        os.environ[DIR_ENV] = path
        creator = os.getpid()
        atexit.register(lambda: os.getpid() == creator and shutil.rmtree(path, ignore_errors=True))
    return Path(path) if path else None


class Publisher:
    """One producer's figures (a scheduler, a worker rank), published off the hot path.

    :meth:`add`, :meth:`raise_to` and :meth:`hold` only update memory and, on the first change after a
    publication, start a daemon :class:`threading.Timer` that calls :meth:`flush` ``interval`` seconds later;
    changes in between are published together. :meth:`flush` publishes now (tests, exit). Each publisher has
    its own file, so several engines in one process (an offline benchmark comparing policies) do not
    overwrite each other's figures.
    """

    def __init__(self, producer: str, interval: float = PUBLISH_INTERVAL_S) -> None:
        directory = metrics_dir()
        name = f"{producer}-{os.getpid()}-{next(_publisher_numbers)}.json"
        self.path = directory / name if directory else None
        self.interval = interval
        self.totals = dict.fromkeys([*COUNTERS, *PEAKS], 0.0)
        self.streams: dict[str, HeldKV] = {}
        self.ended: dict[str, str] = {}
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        self._timer: threading.Timer | None = None
        self._published: tuple[dict[str, float], dict[str, HeldKV], dict[str, str]] = (dict(self.totals), {}, {})
        _live_publishers.add(self)
        _multiprocess_metrics()  # with several API servers, /metrics shows the counters (at 0) from now on

    def add(self, **increments: float) -> None:
        """Add to counters of :data:`COUNTERS` (in memory only); published within ``interval`` seconds."""
        unknown = set(increments) - set(COUNTERS)
        if unknown:
            raise KeyError(f"unknown KV policy counters {sorted(unknown)}")
        with self._lock:
            for name, value in increments.items():
                self.totals[name] += value
            self._schedule_flush()

    def raise_to(self, **values: float) -> None:
        """Raise high-water marks of :data:`PEAKS` to ``values`` where higher (in memory only, like :meth:`add`)."""
        unknown = set(values) - set(PEAKS)
        if unknown:
            raise KeyError(f"unknown KV policy high-water marks {sorted(unknown)}")
        with self._lock:
            changed = False
            for name, value in values.items():
                if value > self.totals[name]:
                    self.totals[name], changed = value, True
            if changed:
                self._schedule_flush()

    def hold(self, streams: Mapping[str, HeldKV]) -> None:
        """Replace what this producer's streams hold, by external request id (in memory only, like :meth:`add`)."""
        with self._lock:
            if streams == self.streams:
                return
            self.streams = dict(streams)
            self._schedule_flush()

    def end(self, external_id: str, reason: str) -> None:
        """Record why the engine ended a request with an error (in memory only, like :meth:`add`)."""
        with self._lock:
            self.ended[external_id] = reason
            while len(self.ended) > ENDED_KEPT:
                del self.ended[next(iter(self.ended))]
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        """Start the publication timer unless one is pending (caller holds ``_lock``)."""
        if self._timer is None:
            self._timer = threading.Timer(self.interval, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        """Publish the current figures now (skipped when unchanged since the last publication)."""
        with self._publishing:  # one publication at a time, so a later one never lands before an earlier one
            with self._lock:
                timer, self._timer = self._timer, None
                current = (dict(self.totals), self.streams, dict(self.ended))
            if timer is not None and timer is not threading.current_thread():
                timer.cancel()
            previous, self._published = self._published, current
            if current == previous:
                return
            totals, streams, ended = current
            published = previous[0]
            metrics = _multiprocess_metrics()
            if metrics is not None:
                for name, total in totals.items():
                    if total > published[name]:
                        if name in PEAKS:
                            metrics[name].set(total)
                        else:
                            metrics[name].inc(total - published[name])
            if self.path is not None and self.path.parent.is_dir():
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"totals": totals, "streams": {k: asdict(v) for k, v in streams.items()},
                                           "ended": ended}))
                os.replace(tmp, self.path)


@atexit.register
def _flush_at_exit() -> None:
    for publisher in list(_live_publishers):
        publisher.flush()


def read_published(directory: Path | None = None) -> Published:
    """Every publisher's figures: counters summed, high-water marks the largest, streams by external id."""
    directory = directory or metrics_dir(create=False)
    counters = dict.fromkeys(COUNTERS, 0.0)
    peaks = dict.fromkeys(PEAKS, 0.0)
    streams: dict[str, HeldKV] = {}
    ended: dict[str, str] = {}
    if directory is None or not directory.is_dir():
        return Published(counters, peaks, streams, ended)
    for file in directory.glob("*.json"):
        try:
            values = json.loads(file.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now: the next read sees it
        totals = values.get("totals", {})
        for name in COUNTERS:
            counters[name] += float(totals.get(name, 0.0))
        for name in PEAKS:
            peaks[name] = max(peaks[name], float(totals.get(name, 0.0)))
        streams.update({k: HeldKV(**v) for k, v in values.get("streams", {}).items()})
        ended.update(values.get("ended", {}))
    return Published(counters, peaks, streams, ended)


def read_totals(directory: Path | None = None) -> dict[str, float]:
    """Counters (summed) and high-water marks (the largest) of :func:`read_published`, in one mapping."""
    return read_published(directory).totals()


def await_published(scrape: Callable[[], T], ready: Callable[[T], bool],
                    timeout: float = 20 * PUBLISH_INTERVAL_S) -> T:
    """Call ``scrape`` (e.g. read ``/metrics``) until ``ready`` accepts its result, and return that result.

    For clients that need figures to include changes made just now: a change is published up to
    :data:`PUBLISH_INTERVAL_S` later. Raises ``TimeoutError`` (with the last result) after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not ready(result := scrape()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not published within {timeout:.1f}s; last scrape: {result!r}"[:2000])
        time.sleep(PUBLISH_INTERVAL_S / 5)
    return result


def _multiprocess_metrics() -> dict[str, Any] | None:
    """This process's ``prometheus_client`` metrics in ``PROMETHEUS_MULTIPROC_DIR``, or ``None`` when unset.

    ``prometheus_client`` keeps one file per process and metric type there, shared by every metric of the
    process, so these are ordinary ``Counter`` and ``Gauge`` objects (not registered anywhere: vLLM's
    multiprocess collector reads the files). High-water marks are gauges in ``max`` mode: the collector shows
    the largest value any process (live or not) has set.
    """
    global _mp_metrics
    if not os.environ.get(MULTIPROC_ENV):
        return None
    with _mp_lock:
        if _mp_metrics is None:
            from prometheus_client import Counter, Gauge

            _mp_metrics = {name: Counter(f"cords_vllm_{name}", help_text, registry=None)
                           for name, help_text in COUNTERS.items()}
            _mp_metrics.update({name: Gauge(f"cords_vllm_{name}", help_text, registry=None, multiprocess_mode="max")
                                for name, help_text in PEAKS.items()})
        return _mp_metrics
