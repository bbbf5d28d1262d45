"""Prometheus metrics of the KV policy on the server's ``/metrics``.

The counters are produced where compression happens (scheduler and workers, in the engine-core process or
in worker processes), but ``/metrics`` is served by the API-server process, and vLLM 0.32 carries only its
own fields of ``SchedulerStats`` across that boundary. So each producer publishes its running totals as a
small JSON file (atomically replaced, only when they change) in a directory the first process creates and its
child processes inherit through ``CORDS_VLLM_METRICS_DIR``; a Prometheus collector registered in the API
server sums the files at every scrape. With several API servers (``--api-server-count > 1``) vLLM uses a
multiprocess registry that does not include this collector.

Exported counters: ``cords_vllm_compressions_total``, ``cords_vllm_evicted_tokens_total``,
``cords_vllm_kept_tokens_total`` (video tokens kept by compressions) and ``cords_vllm_selection_seconds_total``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

DIR_ENV = "CORDS_VLLM_METRICS_DIR"

METRICS: dict[str, str] = {
    "compressions": "KV cache compressions carried out by the KV policy",
    "evicted_tokens": "Video tokens evicted from paged KV caches by the KV policy",
    "kept_tokens": "Video tokens kept by KV policy compressions",
    "selection_seconds": "Seconds spent selecting which tokens to keep",
}

_collector_registered = False


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
    """Publishes one producer's running totals (e.g. a scheduler, a worker rank)."""

    def __init__(self, producer: str) -> None:
        directory = metrics_dir()
        self.path = directory / f"{producer}-{os.getpid()}.json" if directory else None
        self.totals = dict.fromkeys(METRICS, 0.0)

    def add(self, **increments: float) -> None:
        unknown = set(increments) - set(METRICS)
        if unknown:
            raise KeyError(f"unknown KV policy metrics {sorted(unknown)}")
        for name, value in increments.items():
            self.totals[name] += value
        if self.path is not None and self.path.parent.is_dir():
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.totals))
            os.replace(tmp, self.path)


def read_totals(directory: Path | None = None) -> dict[str, float]:
    """Sum of every producer's published totals."""
    directory = directory or metrics_dir(create=False)
    totals = dict.fromkeys(METRICS, 0.0)
    if directory is None or not directory.is_dir():
        return totals
    for file in directory.glob("*.json"):
        try:
            values = json.loads(file.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now: the next scrape reads it
        for name in METRICS:
            totals[name] += float(values.get(name, 0.0))
    return totals


class PolicyCollector:
    """``prometheus_client`` collector exporting :func:`read_totals` as counters."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        totals = read_totals()
        for name, help_text in METRICS.items():
            yield CounterMetricFamily(f"cords_vllm_{name}", help_text, value=totals[name])


def register_collector() -> None:
    """Create the metrics directory and register the collector in this process (idempotent)."""
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
