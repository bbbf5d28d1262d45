"""The most paged KV blocks one request has held at once: the high-water mark behind "bounded KV per stream".

vLLM's ``vllm:kv_cache_usage_perc`` is the pool's usage when the API server last heard from the engine; a
client polling it can miss a request's peak altogether (a short request, an API server busy decoding images).
:class:`PeakHeldBlocks` is a step observer of one scheduler that sees every step right after its allocations
(the moment a request holds the most, before the next step's compression frees blocks) and raises the
``cords_vllm_request_kv_blocks_peak`` gauge (:mod:`cords_vllm.observability`) when a request exceeds it.
It runs under every policy, ``none`` included, so the figure compares policies in one place.
"""

from __future__ import annotations

from typing import Any

from cords_vllm.observability import CounterSink

METRIC = "request_kv_blocks_peak"


class PeakHeldBlocks:
    """Step observer: the most blocks any one request of ``scheduler`` has held after a step's allocations.

    ``compressor``: the scheduler's :class:`~cords_vllm.engine.scheduler.SchedulerCompressor` (``None``
    without a policy), whose states say how many entries of a row are null (evicted). Costs O(1) per
    scheduled request and step; publishes off the hot path through a :class:`CounterSink`.
    """

    def __init__(self, compressor: Any = None, sink: CounterSink | None = None) -> None:
        self.compressor = compressor
        self.sink = sink if sink is not None else CounterSink("scheduler-kv-peak")
        #: Blocks held by the request that held the most so far.
        self.peak = 0

    def __call__(self, scheduler: Any, output: Any) -> None:
        from cords_vllm.engine.scheduler import non_null_blocks

        rows = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        states = self.compressor.states if self.compressor is not None else {}
        peak = self.peak
        for req_id in output.num_scheduled_tokens:
            row = rows.get(req_id)
            if row:
                peak = max(peak, non_null_blocks(row, states.get(req_id)))
        if peak > self.peak:
            self.peak = peak
            self.sink.raise_to(**{METRIC: peak})
