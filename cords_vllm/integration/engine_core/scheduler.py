"""Scheduler side: decide compressions before the step allocates, free the blocks, admit by footprint.

At the start of ``Scheduler.schedule`` (before any of the step's ``allocate_slots``), every running request
still in its prompt is offered to the pure planner (:func:`~cords_vllm.compress.plan.plan_compression`). A
plan rewrites the request's row in the KV cache manager (``row[:j] = kept blocks + nulls``) and returns the
other blocks of the region to the block pool at once, so the allocation of this very step can use them: the
prototype decided after allocation, and a request was preempted three times that compression would have
saved. The plans ride on the ``SchedulerOutput`` to the workers (:mod:`cords_vllm.integration.plans`), which
copy the kept tokens before the forward. Deciding at the start of ``schedule`` is also right under async
scheduling: the workers apply plans in step order, after the in-flight step has written its tokens.

Admission: vLLM reserves a new request's whole prompt (``scheduler_reserve_full_isl``). For a request with
candidates, the reservation is capped at its compressed footprint
(:func:`~cords_vllm.compress.plan.compressed_footprint_blocks`), so prompts whose full length would not
fit are admitted when their compressed form does.
"""

from __future__ import annotations

import logging
from typing import Any

from cords_vllm.compress.plan import CompressionPlan, apply_plan, next_compression_point, plan_compression
from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError
from cords_vllm.integration.engine_core.tracker import RequestCompression, RequestTracker, non_null_blocks
from cords_vllm.integration.engine_facts import model_facts_of, single_kv_cache_group
from cords_vllm.integration.plans import attach_plans
from cords_vllm.integration.published import Publisher

logger = logging.getLogger(__name__)


class _BlockIds:
    """The block ids of a row of ``KVCacheBlock`` objects, read lazily (the planner reads a few slices only)."""

    def __init__(self, row: list) -> None:
        self.row = row

    def __len__(self) -> int:
        return len(self.row)

    def __getitem__(self, index: slice) -> list[int]:
        return [b.block_id for b in self.row[index]]


class SchedulerCompressor:
    """The KV policy inside one scheduler: one :class:`RequestTracker` per request it has seen."""

    def __init__(self, config: KVPolicyConfig, scheduler: Any, publisher: Publisher) -> None:
        self.config = config
        kvm = scheduler.kv_cache_manager
        self.manager = single_kv_cache_group(kvm.coordinator.single_type_managers, config)
        self.pool = kvm.block_pool
        if self.pool.enable_caching:
            raise RuntimeError("--kv-policy needs prefix caching off (the plugin turns it off at start-up)")
        self.block_size = self.manager.block_size
        self.facts = model_facts_of(scheduler.vllm_config)
        self.text_limit = config.text_limit(scheduler.vllm_config.model_config.max_model_len)
        self.trackers: dict[str, RequestTracker] = {}
        self.pending: list[CompressionPlan] = []
        self.publisher = publisher

    def tracker(self, request: Any) -> RequestTracker:
        tracker = self.trackers.get(request.request_id)
        if tracker is None:
            tracker = self.trackers[request.request_id] = RequestTracker(request.request_id)
        return tracker

    # ------------------------------------------------------------------------------------------------
    def before_schedule(self, scheduler: Any) -> None:
        """Forget requests that left, compress running prompts over budget (their evicted blocks are freed now)."""
        for req_id in [r for r in self.trackers if r not in scheduler.requests]:
            state = self.trackers.pop(req_id).state
            logger.debug("cords-vllm: request %s done: %d compressions, %d candidate tokens evicted", req_id,
                         state.compressions, state.evicted_tokens)
        for request in scheduler.running:
            self._maybe_compress(request)

    def _maybe_compress(self, request: Any) -> None:
        tracker = self.tracker(request)
        if request.num_computed_tokens == 0:
            tracker.reset()  # preempted: recomputes from scratch
        candidates = tracker.candidates(request, self.facts, self.config)
        row = self.manager.req_to_blocks.get(request.request_id)
        if candidates.total == 0 or not row:
            return
        state = tracker.state
        plan = plan_compression(request.request_id, _BlockIds(row), request.num_computed_tokens,
                                request.num_prompt_tokens, candidates, state,
                                tracker.settings(request, self.config), self.block_size)
        if plan is None:
            return
        freed = plan.held_entries(row)[plan.num_keep // plan.block_size:]
        plan.compact_row(row, self.pool.null_block)
        self.pool.free_blocks(reversed(freed))
        tracker.state = apply_plan(state, plan)
        self.pending.append(plan)
        self.publisher.add(compressions=1, evicted_tokens=tracker.state.evicted_tokens - state.evicted_tokens,
                           kept_tokens=plan.num_keep_candidates)
        logger.debug("cords-vllm: plan %s at token %d: region %d blocks, %d blocks freed, %d candidates kept",
                     request.request_id, request.num_computed_tokens, plan.region_blocks, len(freed),
                     plan.num_keep_candidates)

    def invalid_reason(self, request: Any) -> str | None:
        """Why the policy cannot serve a waiting request (new, or a session whose next turn arrived): more
        protected (non-candidate) tokens than ``max_text_tokens`` (the start-up rule only promised the pool its
        bounded footprint), or invalid per-request overrides; ``None`` if it can."""
        tracker = self.tracker(request)
        text = request.num_tokens - tracker.candidates(request, self.facts, self.config).total
        if text > self.text_limit:
            return (f"it holds {text} protected (text) tokens, more than kv_policy_config key 'max_text_tokens' "
                    f"({self.text_limit})")
        if isinstance(invalid := tracker.narrowed(request, self.config), KVPolicyConfigError):
            return str(invalid)
        return None

    def after_schedule(self, scheduler_output: Any) -> None:
        """Attach this step's plans (minus requests the step preempted) to its output."""
        plans, self.pending = self.pending, []
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in preempted:
            if (tracker := self.trackers.get(req_id)) is not None:
                tracker.reset()
        attach_plans(scheduler_output, [p for p in plans if p.req_id not in preempted])

    def chunk_limit(self, request: Any, num_computed: int) -> int | None:
        """The most tokens ``request`` may compute from ``num_computed`` on: up to its next compression point.

        Points depend only on the request's token layout, its compression state and the policy's settings
        (:func:`~cords_vllm.compress.plan.next_compression_point`), so a request is compressed at the same
        logical positions, and keeps the same tokens, alone or in any batch and under any chunk settings.
        ``None``: no point ahead.
        """
        tracker = self.tracker(request)
        candidates = tracker.candidates(request, self.facts, self.config)
        if candidates.total == 0 or num_computed >= request.num_prompt_tokens:
            return None
        point = next_compression_point(tracker.state, candidates, num_computed, request.num_prompt_tokens,
                                       tracker.settings(request, self.config), self.block_size)
        return None if point is None else point - num_computed

    def admission_cap(self, request: Any) -> int | None:
        """Blocks to reserve for a request with candidates: its compressed footprint (``None``: no cap)."""
        tracker = self.tracker(request)
        candidates = tracker.candidates(request, self.facts, self.config)
        if candidates.total == 0:
            return None
        return tracker.footprint(request, candidates, tracker.settings(request, self.config), self.block_size)

    def growth_reserve(self, request: Any) -> int:
        """Blocks the other admitted requests with candidates may still take before they reach their footprint.

        vLLM admits a request when its own reservation fits in the free blocks, ignoring how much the
        running requests will still grow; compressed requests grow to a known footprint, so a new request is
        admitted only if it fits next to that growth, which avoids predictable preemptions.
        """
        if request.request_id in self.manager.req_to_blocks:
            return 0  # already admitted: this is a chunk allocation
        reserve = 0
        for req_id, row in self.manager.req_to_blocks.items():
            tracker = self.trackers.get(req_id)
            if tracker is not None and (footprint := tracker.known_footprint) is not None:
                reserve += max(0, footprint - non_null_blocks(row, tracker.state))
        return reserve

    def describe(self, request: Any, row: list) -> RequestCompression:
        """What ``request`` holds now (``row``: its row of blocks)."""
        tracker = self.trackers.get(request.request_id) or RequestTracker(request.request_id)
        return tracker.describe(request, row, self.facts, self.config, self.block_size)
