"""The KV policy's figures on the API server's ``/metrics`` (one API server: the global registry).

:class:`PolicyCollector` exports what :func:`~cords_vllm.integration.handoff.published.read_published` reads at every
scrape: the counters and the high-water-mark gauges. With several API servers vLLM serves ``/metrics`` from
``PROMETHEUS_MULTIPROC_DIR`` instead, which the publishers write to themselves
(:mod:`cords_vllm.integration.handoff.published`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cords_vllm.integration.handoff.published import COUNTERS, PEAKS, metrics_dir, read_published

_registered = False


class PolicyCollector:
    """``prometheus_client`` collector of the published counters (``*_total``) and high-water marks (gauges)."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        published = read_published()
        for name, help_text in COUNTERS.items():
            yield CounterMetricFamily(f"cords_vllm_{name}", help_text, value=published.counters[name])
        for name, help_text in PEAKS.items():
            yield GaugeMetricFamily(f"cords_vllm_{name}", help_text, value=published.peaks[name])


def register_collector() -> None:
    """Create the publication directory and register :class:`PolicyCollector` in this process (idempotent)."""
    global _registered
    if _registered:
        return
    metrics_dir()
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    REGISTRY.register(PolicyCollector())
    _registered = True
