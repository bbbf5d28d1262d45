"""Scheduler side: decide compressions before the step allocates, free the blocks, admit by footprint.

At the start of ``Scheduler.schedule`` (before any of the step's ``allocate_slots``), every running request
still in its prompt is offered to the pure planner (:func:`~cords_vllm.engine.planner.plan_compression`). A
plan rewrites the request's row in the KV cache manager (``row[:j] = kept blocks + nulls``) and returns the
other blocks of the region to the block pool at once, so the allocation of this very step can use them: the
prototype decided after allocation, and a request was preempted three times that compression would have
saved. The plans ride on the ``SchedulerOutput`` to the workers, which copy the kept tokens before the
forward. Deciding at the start of ``schedule`` is also right under async scheduling: the workers apply plans
in step order, after the in-flight step has written its tokens.

Admission: vLLM reserves a new request's whole prompt (``scheduler_reserve_full_isl``). For a request with
video, the reservation is capped at its compressed footprint
(:func:`~cords_vllm.engine.planner.compressed_footprint_blocks`), so prompts whose full length would not
fit are admitted when their compressed form does.
"""

from __future__ import annotations

import logging
from typing import Any

from cords_vllm.config import KVPolicyConfig
from cords_vllm.engine.planner import (
    BudgetSettings,
    CompressionPlan,
    RequestCompressionState,
    VideoSpans,
    apply_plan,
    compressed_footprint_blocks,
    plan_compression,
)
from cords_vllm.engine.worker import PLANS_ATTR
from cords_vllm.observability import CounterSink

logger = logging.getLogger(__name__)


def video_spans(request: Any) -> VideoSpans:
    """Logical video token ranges of a vLLM ``Request`` (from its multimodal placeholders)."""
    spans: list[tuple[int, int]] = []
    for feature in getattr(request, "mm_features", None) or ():
        if feature.modality != "video":
            continue
        pos = feature.mm_position
        if pos.is_embed is None:
            spans.append((pos.offset, pos.offset + pos.length))
            continue
        run_start = None
        flags = pos.is_embed.tolist()
        for i, embed in enumerate([*flags, False]):
            if embed and run_start is None:
                run_start = i
            elif not embed and run_start is not None:
                spans.append((pos.offset + run_start, pos.offset + i))
                run_start = None
    return VideoSpans(tuple(sorted(spans)))


class SchedulerCompressor:
    """Per-scheduler compression state and decisions."""

    def __init__(self, config: KVPolicyConfig, scheduler: Any) -> None:
        self.config = config
        kvm = scheduler.kv_cache_manager
        managers = kvm.coordinator.single_type_managers
        if len(managers) != 1:
            raise NotImplementedError(
                f"--kv-policy {config.policy}: {len(managers)} KV cache groups (hybrid or sliding-window "
                "attention) are not supported; cords-vllm compresses one full-attention KV cache group")
        self.manager = managers[0]
        self.pool = kvm.block_pool
        if self.pool.enable_caching:
            raise RuntimeError("--kv-policy needs prefix caching off (the plugin turns it off at start-up)")
        self.block_size = self.manager.block_size
        self.settings = BudgetSettings(config.budget, config.recent, config.slack)
        sc = scheduler.scheduler_config
        limits = (getattr(sc, "long_prefill_token_threshold", 0), getattr(sc, "max_num_scheduled_tokens", None),
                  sc.max_num_batched_tokens)
        self.chunk = min(int(x) for x in limits if x)  # the most tokens one step adds to a request
        self.states: dict[str, RequestCompressionState] = {}
        self.spans: dict[str, VideoSpans] = {}
        self.pending: list[CompressionPlan] = []
        self.footprints: dict[str, int] = {}
        self.sink = CounterSink("scheduler")

    def spans_of(self, request: Any) -> VideoSpans:
        spans = self.spans.get(request.request_id)
        if spans is None:
            spans = self.spans[request.request_id] = video_spans(request)
        return spans

    # ------------------------------------------------------------------------------------------------
    def before_schedule(self, scheduler: Any) -> None:
        """Compress running prompts over budget; frees their evicted blocks now."""
        for req_id in [r for r in self.states if r not in scheduler.requests]:
            state = self.states.pop(req_id)
            logger.debug("cords-vllm: request %s done: %d compressions, %d video tokens evicted", req_id,
                         state.compressions, state.evicted_tokens)
        for cache in (self.spans, self.footprints):
            for req_id in [r for r in cache if r not in scheduler.requests]:
                cache.pop(req_id)
        for request in scheduler.running:
            req_id = request.request_id
            state = self.states.get(req_id)
            if state is not None and request.num_computed_tokens == 0:
                del self.states[req_id]  # preempted: recomputes from scratch
                state = None
            video = self.spans_of(request)
            if video.total == 0:
                continue
            row = self.manager.req_to_blocks.get(req_id)
            if not row:
                continue
            state = state or RequestCompressionState()
            plan = plan_compression(req_id, [b.block_id for b in row], request.num_computed_tokens,
                                    request.num_prompt_tokens, video, state, self.settings, self.block_size)
            if plan is None:
                continue
            held = [b for b in row[: plan.region_blocks] if not b.is_null]
            kept, freed = held[: len(plan.kept_blocks)], held[len(plan.kept_blocks):]
            row[: plan.region_blocks] = kept + [self.pool.null_block] * (plan.region_blocks - len(kept))
            self.pool.free_blocks(reversed(freed))
            new_state = apply_plan(state, plan)
            self.states[req_id] = new_state
            self.pending.append(plan)
            self.sink.add(compressions=1, evicted_tokens=new_state.evicted_tokens - state.evicted_tokens,
                          kept_tokens=plan.num_keep_video)
            logger.debug("cords-vllm: plan %s at token %d: region %d blocks, %d blocks freed, %d video kept",
                         req_id, request.num_computed_tokens, plan.region_blocks, len(freed),
                         plan.num_keep_video)

    def after_schedule(self, scheduler_output: Any) -> None:
        """Attach this step's plans (minus requests the step preempted) to its output."""
        plans, self.pending = self.pending, []
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        plans = [p for p in plans if p.req_id not in preempted]
        for req_id in preempted:
            self.states.pop(req_id, None)
        setattr(scheduler_output, PLANS_ATTR, plans)

    def admission_cap(self, request: Any) -> int | None:
        """Blocks to reserve for a new request with video: its compressed footprint (``None``: no cap)."""
        footprint = self.footprints.get(request.request_id)
        if footprint is None:
            video = self.spans_of(request)
            if video.total == 0:
                return None
            footprint = self.footprints[request.request_id] = compressed_footprint_blocks(
                request.num_tokens, video.total, self.settings, self.chunk, self.block_size)
        return footprint

    def growth_reserve(self, request: Any) -> int:
        """Blocks the other admitted video requests may still take before they reach their footprint.

        vLLM admits a request when its own reservation fits in the free blocks, ignoring how much the
        running requests will still grow; compressed requests grow to a known footprint, so a new request is
        admitted only if it fits next to that growth, which avoids predictable preemptions.
        """
        if request.request_id in self.manager.req_to_blocks:
            return 0  # already admitted: this is a chunk allocation
        reserve = 0
        for req_id, row in self.manager.req_to_blocks.items():
            footprint = self.footprints.get(req_id)
            if footprint is not None:
                reserve += max(0, footprint - sum(not b.is_null for b in row))
        return reserve
