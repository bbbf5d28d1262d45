"""Step observers of one scheduler that publish what requests hold (engine-core process).

:class:`HeldKVObserver` runs after every ``Scheduler.schedule`` under every policy (``none`` included, so
figures compare policies in one place), right after the step's allocations: the moment a request holds the
most, before the next step's compression frees blocks. It publishes, through the scheduler's
:class:`~cords_vllm.integration.handoff.published.Publisher` (memory only on the hot path):

* the ``request_kv_blocks_peak`` high-water mark (vLLM's ``vllm:kv_cache_usage_perc`` is the pool's usage
  when the API server last heard from the engine; a client polling it can miss a request's peak);
* the KV each resumable request (a live stream) holds, by its external id, for the stream API's listings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cords_vllm.integration.engine_core.requests import external_request_id
from cords_vllm.integration.engine_core.scheduler import SchedulerCompressor
from cords_vllm.integration.engine_core.tracker import non_null_blocks
from cords_vllm.integration.handoff.published import HeldKV, Publisher
from cords_vllm.integration.kv_groups import attention_manager

#: ``callback(scheduler, scheduler_output)`` after every ``Scheduler.schedule``.
StepObserver = Callable[[Any, Any], None]

PEAK = "request_kv_blocks_peak"


class HeldKVObserver:
    """Publishes the peak blocks one request held and what each live stream holds, after every step.

    ``compressor``: the scheduler's :class:`~cords_vllm.integration.engine_core.scheduler.SchedulerCompressor`
    (``None`` without a policy), whose trackers say how many entries of a row are null (evicted). Costs O(1)
    per scheduled request and per live stream and step.
    """

    def __init__(self, compressor: SchedulerCompressor | None, publisher: Publisher) -> None:
        self.compressor = compressor
        self.publisher = publisher
        #: Blocks held by the request that held the most so far.
        self.peak = 0

    def _tracker(self, req_id: str):
        return self.compressor.trackers.get(req_id) if self.compressor is not None else None

    def _state(self, req_id: str):
        tracker = self._tracker(req_id)
        return tracker.state if tracker is not None else None

    def __call__(self, scheduler: Any, output: Any) -> None:
        comp = self.compressor
        manager = comp.manager if comp is not None else attention_manager(scheduler.kv_cache_manager)
        rows = manager.req_to_blocks
        peak = self.peak
        for req_id in output.num_scheduled_tokens:
            row = rows.get(req_id)
            if row:
                whole = comp.whole_blocks(req_id) if comp is not None else 0
                peak = max(peak, non_null_blocks(row, self._state(req_id)) + whole)
        if peak > self.peak:
            self.peak = peak
            self.publisher.raise_to(**{PEAK: peak})
        streams: dict[str, HeldKV] = {}
        for req_id, request in scheduler.requests.items():
            if not getattr(request, "resumable", False):
                continue
            tracker = self._tracker(req_id)
            state = tracker.state if tracker is not None else None
            # a re-based stream's request lost the tokens it evicted: count them back for its length
            streamed = request.num_computed_tokens + (tracker.removed_tokens if tracker is not None else 0)
            streams[external_request_id(req_id)] = HeldKV(
                blocks=non_null_blocks(rows.get(req_id, []), state),
                tokens=streamed - (state.evicted_tokens if state is not None else 0), stream_tokens=streamed)
        self.publisher.hold(streams)
