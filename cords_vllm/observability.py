"""Prometheus metrics of the KV policy on the server's ``/metrics``.

The counters are produced where compression happens (scheduler and workers, in the engine-core process or
in worker processes), but ``/metrics`` is served by the API-server process(es), and vLLM 0.32 carries only
its own fields of ``SchedulerStats`` across that boundary. So each producer keeps its running totals in
memory (:meth:`CounterSink.add` runs inside the scheduler and worker steps and must stay cheap: it does no
file I/O), and a short-lived daemon timer publishes them at most :data:`PUBLISH_INTERVAL_S` seconds after a
change, plus once at exit; a scrape sees the totals of at most that long ago. Where they are published
follows where vLLM reads ``/metrics``:

* One API server (the default): ``/metrics`` serves ``prometheus_client``'s global registry. Each producer
  writes its totals as a small JSON file (atomically replaced) in a directory the first process creates and
  its child processes inherit through ``CORDS_VLLM_METRICS_DIR``; :class:`PolicyCollector`, registered in
  the API server's global registry, sums the files at every scrape.
* Several API servers (``--api-server-count N``): vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts
  any engine or API-server process, and every API server answers ``/metrics`` from a fresh registry whose
  only collector is ``prometheus_client``'s ``MultiProcessCollector`` over that directory (the global
  registry is not served). So each producer also adds its increments to ordinary ``prometheus_client``
  counters, which in such a process live in that directory's per-process files; every API server sums the
  same files and reports the same totals.

Exported counters (:data:`METRICS`, summed over producers): ``cords_vllm_compressions_total``,
``cords_vllm_evicted_tokens_total``, ``cords_vllm_kept_tokens_total`` (video tokens kept by compressions) and
``cords_vllm_selection_seconds_total``. Exported high-water marks (:data:`PEAKS`, gauges, the largest value any
producer has reached): ``cords_vllm_request_kv_blocks_peak``, the most paged KV blocks one request has held at
once, under any policy (``none`` too): the figure that shows whether KV per stream stays bounded, which a
poller of ``vllm:kv_cache_usage_perc`` can miss between two scrapes.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

DIR_ENV = "CORDS_VLLM_METRICS_DIR"
#: Set by vLLM when several processes serve ``/metrics`` (``--api-server-count > 1``).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Longest delay between a counter change and its publication (seconds).
PUBLISH_INTERVAL_S = 0.5

METRICS: dict[str, str] = {
    "compressions": "KV cache compressions carried out by the KV policy",
    "evicted_tokens": "Video tokens evicted from paged KV caches by the KV policy",
    "kept_tokens": "Video tokens kept by KV policy compressions",
    "selection_seconds": "Seconds spent selecting which tokens to keep",
}
#: High-water marks: only ever raised (:meth:`CounterSink.raise_to`); ``/metrics`` shows the largest over producers.
PEAKS: dict[str, str] = {
    "request_kv_blocks_peak": "Most paged KV blocks one request has held at once since start (after a step's "
                              "allocations, before its frees), under any KV policy",
}

T = TypeVar("T")

_collector_registered = False
_live_sinks: weakref.WeakSet[CounterSink] = weakref.WeakSet()
_mp_counters: dict[str, Any] | None = None
_mp_lock = threading.Lock()
_sink_numbers = itertools.count()


def metrics_dir(create: bool = True) -> Path | None:
    """The shared metrics directory (created, and exported to child processes, on first use)."""
    path = os.environ.get(DIR_ENV)
    if path is None and create:
        path = tempfile.mkdtemp(prefix="cords-vllm-metrics-")
        os.environ[DIR_ENV] = path
        creator = os.getpid()
        atexit.register(lambda: os.getpid() == creator and shutil.rmtree(path, ignore_errors=True))
    return Path(path) if path else None


class CounterSink:
    """One producer's running totals and high-water marks (e.g. a scheduler, a worker rank), published off the
    hot path.

    :meth:`add` and :meth:`raise_to` only update memory and, on the first change after a publication, start a
    daemon :class:`threading.Timer` that calls :meth:`flush` ``interval`` seconds later; changes in between are
    published together. :meth:`flush` publishes now (tests, exit). Each sink has its own file, so several
    engines in one process (an offline benchmark comparing policies) do not overwrite each other's figures.
    """

    def __init__(self, producer: str, interval: float = PUBLISH_INTERVAL_S) -> None:
        directory = metrics_dir()
        name = f"{producer}-{os.getpid()}-{next(_sink_numbers)}.json"
        self.path = directory / name if directory else None
        self.interval = interval
        self.totals = dict.fromkeys([*METRICS, *PEAKS], 0.0)
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        self._timer: threading.Timer | None = None
        self._published = dict(self.totals)
        _live_sinks.add(self)
        _multiprocess_counters()  # with several API servers, /metrics shows the counters (at 0) from now on

    def add(self, **increments: float) -> None:
        """Add to the totals (in memory only); they are published within ``interval`` seconds."""
        unknown = set(increments) - set(METRICS)
        if unknown:
            raise KeyError(f"unknown KV policy metrics {sorted(unknown)}")
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

    def _schedule_flush(self) -> None:
        """Start the publication timer unless one is pending (caller holds ``_lock``)."""
        if self._timer is None:
            self._timer = threading.Timer(self.interval, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        """Publish the current totals now (skipped when unchanged since the last publication)."""
        with self._publishing:  # one publication at a time, so a later one never lands before an earlier one
            with self._lock:
                timer, self._timer = self._timer, None
                totals = dict(self.totals)
            if timer is not None and timer is not threading.current_thread():
                timer.cancel()
            published, self._published = self._published, totals
            if totals == published:
                return
            counters = _multiprocess_counters()
            if counters is not None:
                for name, total in totals.items():
                    if total > published[name]:
                        if name in PEAKS:
                            counters[name].set(total)
                        else:
                            counters[name].inc(total - published[name])
            if self.path is not None and self.path.parent.is_dir():
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(totals))
                os.replace(tmp, self.path)


@atexit.register
def _flush_at_exit() -> None:
    for sink in list(_live_sinks):
        sink.flush()


def read_totals(directory: Path | None = None) -> dict[str, float]:
    """Every producer's published figures: counters (:data:`METRICS`) summed, high-water marks (:data:`PEAKS`)
    the largest."""
    directory = directory or metrics_dir(create=False)
    totals = dict.fromkeys([*METRICS, *PEAKS], 0.0)
    if directory is None or not directory.is_dir():
        return totals
    for file in directory.glob("*.json"):
        try:
            values = json.loads(file.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now: the next scrape reads it
        for name in METRICS:
            totals[name] += float(values.get(name, 0.0))
        for name in PEAKS:
            totals[name] = max(totals[name], float(values.get(name, 0.0)))
    return totals


class PolicyCollector:
    """``prometheus_client`` collector exporting :func:`read_totals`: counters and high-water-mark gauges."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        totals = read_totals()
        for name, help_text in METRICS.items():
            yield CounterMetricFamily(f"cords_vllm_{name}", help_text, value=totals[name])
        for name, help_text in PEAKS.items():
            yield GaugeMetricFamily(f"cords_vllm_{name}", help_text, value=totals[name])


def await_published(scrape: Callable[[], T], ready: Callable[[T], bool],
                    timeout: float = 20 * PUBLISH_INTERVAL_S) -> T:
    """Call ``scrape`` (e.g. read ``/metrics``) until ``ready`` accepts its result, and return that result.

    For clients that need counters to include changes made just now: a change reaches ``/metrics`` up to
    :data:`PUBLISH_INTERVAL_S` later. Raises ``TimeoutError`` (with the last result) after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not ready(result := scrape()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not published within {timeout:.1f}s; last scrape: {result!r}"[:2000])
        time.sleep(PUBLISH_INTERVAL_S / 5)
    return result


def register_collector() -> None:
    """Create the metrics directory and register :class:`PolicyCollector` in this process (idempotent)."""
    global _collector_registered
    if _collector_registered:
        return
    metrics_dir()
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    REGISTRY.register(PolicyCollector())
    _collector_registered = True


def _multiprocess_counters() -> dict[str, Any] | None:
    """This process's ``prometheus_client`` metrics in ``PROMETHEUS_MULTIPROC_DIR``, or ``None`` when unset.

    ``prometheus_client`` keeps one file per process and metric type there, shared by every metric of the
    process, so these are ordinary ``Counter`` and ``Gauge`` objects (not registered anywhere: vLLM's
    multiprocess collector reads the files). High-water marks are gauges in ``max`` mode: the collector shows
    the largest value any process (live or not) has set.
    """
    global _mp_counters
    if not os.environ.get(MULTIPROC_ENV):
        return None
    with _mp_lock:
        if _mp_counters is None:
            from prometheus_client import Counter, Gauge

            _mp_counters = {name: Counter(f"cords_vllm_{name}", help_text, registry=None)
                            for name, help_text in METRICS.items()}
            _mp_counters.update({name: Gauge(f"cords_vllm_{name}", help_text, registry=None, multiprocess_mode="max")
                                 for name, help_text in PEAKS.items()})
        return _mp_counters
