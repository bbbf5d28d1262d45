"""Scheduler side: decide compressions before the step allocates, free the blocks, admit by footprint.

At the start of ``Scheduler.schedule`` (before any of the step's ``allocate_slots``), every running request
still in its prompt is offered to the pure planner (:func:`~cords_vllm.compress.plan.plan_compression`). A
plan rewrites the request's row in the KV cache manager (``row[:j] = kept blocks + nulls``) and returns the
other blocks of the region to the block pool at once, so the allocation of this very step can use them: the
prototype decided after allocation, and a request was preempted three times that compression would have
saved. The plans ride on the ``SchedulerOutput`` to the workers (:mod:`cords_vllm.integration.handoff.plans`), which
copy the kept tokens before the forward. Deciding at the start of ``schedule`` is also right under async
scheduling: the workers apply plans in step order, after the in-flight step has written its tokens.

Admission: vLLM reserves a new request's whole prompt (``scheduler_reserve_full_isl``). For a request with
candidates, the reservation is capped at its compressed footprint
(:func:`~cords_vllm.compress.plan.compressed_footprint_blocks`), so prompts whose full length would not
fit are admitted when their compressed form does.

Prefix caching (as configured; vLLM's default is on): a request the policy may compress has its blocks rewritten in
place, so it neither reads the cache (vLLM's per-request ``skip_reading_prefix_cache``, set before vLLM looks it up)
nor fills it (``delay_cache_blocks`` in its allocations); text and videos within ``budget + slack`` use it as under
``none`` (:meth:`SchedulerCompressor.may_compress`).

Layer-selective compression (``compressed_layers``): the plans compress the compressed layers' KV cache group only;
the groups kept whole grow with the request as under ``none``, so admission also keeps free what the admitted
requests' whole rows still take to their prompt's end, and live streams are refused (their whole rows would grow
without bound).

Streaming sessions: when a session's next turn arrives, the evicted part of its region leaves the request
(:mod:`cords_vllm.integration.engine_core.rebase`) and a :class:`~cords_vllm.compress.plan.RebasePlan` tells
the workers; the scheduler counts the session's rotary positions as its turns arrive and ends it, with a
published reason, when its next turn would pass the model's rotary range (its limit instead of its length), or
if it must be preempted once re-based (it could no longer be recomputed from its own tokens).
"""

from __future__ import annotations

import logging
from typing import Any

from cords_vllm.compress.plan import (
    CompressionPlan,
    RebasePlan,
    apply_plan,
    next_compression_point,
    plan_compression,
)
from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError
from cords_vllm.integration.engine_core.rebase import remove_range
from cords_vllm.integration.engine_core.requests import positions_after
from cords_vllm.integration.engine_core.tracker import RequestCompression, RequestTracker, non_null_blocks
from cords_vllm.integration.engine_facts import model_facts_of
from cords_vllm.integration.handoff.plans import attach_plans
from cords_vllm.integration.handoff.published import Publisher
from cords_vllm.integration.kv_groups import attention_manager, check_layer_groups, whole_group_indices
from cords_vllm.utils import cdiv

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
        check_layer_groups(scheduler.kv_cache_config.kv_cache_groups, config)
        self.manager = attention_manager(kvm, config)
        managers = kvm.coordinator.single_type_managers
        #: Layer-selective compression: the managers of the full-attention groups kept whole (empty otherwise).
        self.whole_managers = [managers[i] for i in whole_group_indices([m.kv_cache_spec for m in managers])]
        self.requests = scheduler.requests
        self.pool = kvm.block_pool
        #: Prefix caching on (vLLM's default): the requests the policy may compress bypass it.
        self.caching = bool(self.pool.enable_caching)
        self.block_size = self.manager.block_size
        self.facts = model_facts_of(scheduler.vllm_config)
        self.text_limit = config.text_limit(scheduler.vllm_config.model_config.max_model_len)
        self.trackers: dict[str, RequestTracker] = {}
        self.pending: list[CompressionPlan | RebasePlan] = []
        self.publisher = publisher
        #: Requests whose compression failed this step, and why: the scheduler's hooks end each alone.
        self.failed: dict[str, str] = {}

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
        for request in list(scheduler.running):
            if request.request_id in self.failed:  # ended at this step
                continue
            try:
                self._maybe_compress(request)
            except Exception as exc:  # planning failed before anything changed: this request alone ends
                logger.exception("cords-vllm: compressing request %s failed", request.request_id)
                self.failed[request.request_id] = f"the KV policy could not compress it ({type(exc).__name__}: {exc})"

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
        if self.caching and not self.may_compress(request):  # guard: may_compress says it never happens
            raise RuntimeError("the policy would rewrite blocks the prefix cache may share (a request it was "
                               "expected never to compress)")
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

    def may_compress(self, request: Any) -> bool:
        """Whether the policy may compress ``request``: a live stream, or a prompt with more than ``budget + slack``
        video tokens (where a fresh request's first compression point lies,
        :func:`~cords_vllm.compress.plan.next_compression_point`). Such a request has its blocks rewritten in place,
        so it neither reads nor fills the prefix cache, and its growth is reserved at admission; the others are left
        to vLLM as under ``none``. Decided once per request."""
        tracker = self.tracker(request)
        if tracker.may_compress is None:
            settings = tracker.settings(request, self.config)
            video = tracker.candidates(request, self.facts, self.config).total
            tracker.may_compress = bool(getattr(request, "resumable", False)) or (
                video > settings.budget + settings.slack)
        return tracker.may_compress

    def before_admission(self, request: Any) -> None:
        """A waiting request, before vLLM looks it up in the prefix cache: one the policy may compress does not."""
        if self.caching and self.may_compress(request):
            request.skip_reading_prefix_cache = True

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
        if self.whole_managers and getattr(request, "resumable", False):
            return ("it is a live stream, and this server keeps its upper layers whole (kv_policy_config key "
                    "'compressed_layers'), where a stream's KV would grow without bound; serve streams with every "
                    "layer compressed")
        return self._position_reason(request, tracker)

    # ------------------------------------------------------------------------------------------------
    # Streaming sessions: re-based at each turn, limited by their rotary range.
    def _next_position(self, request: Any, tracker: RequestTracker) -> int:
        """The first rotary position after the request's prompt (counted once, then kept up as turns arrive)."""
        if tracker.next_position is None:
            if tracker.rebased:
                raise RuntimeError(f"request {request.request_id} was re-based before its positions were counted")
            tracker.next_position = positions_after(request.num_prompt_tokens, request.mm_features, self.facts)
        return tracker.next_position

    def _position_reason(self, request: Any, tracker: RequestTracker) -> str | None:
        """Why a session's next turn cannot run within the model's rotary range (``None`` if it can)."""
        limit = self.facts.max_positions
        if not getattr(request, "resumable", False) or not self.facts.rebases_streams or limit is None:
            return None
        try:
            end = self._next_position(request, tracker) + max(request.max_tokens, 1) - 1
        except ValueError as exc:
            return str(exc)
        if end <= limit:
            return None
        return (f"its next turn would take its rotary positions to {end}, past the model's range of {limit} "
                "(max_position_embeddings): a stream's limit is its positions, which advance with every clip (by its "
                "extent with M-RoPE, by its tokens with 1-D positions) and every text token, evicted or not")

    def before_session_update(self, scheduler: Any, session: Any) -> None:
        """A session's next turn arrived (before vLLM appends it): remove its evicted range from the request."""
        if not self.facts.rebases_streams:
            return
        tracker = self.tracker(session)
        if tracker.next_position is None:
            self._next_position(session, tracker)
        prompt = session.num_prompt_tokens
        held, removed = 0, 0
        if tracker.state.region_blocks > tracker.state.held_blocks:
            held, removed = tracker.rebase(self.block_size)
            drop = not scheduler.encoder_cache_manager.get_cached_input_ids(session)
            remove_range(session, self.manager.req_to_blocks[session.request_id], held, removed, self.block_size,
                         self.pool.null_block, drop)
        tracker.turn_start = (held, removed, prompt - removed)

    def after_session_update(self, session: Any) -> None:
        """vLLM appended the turn: count its positions and tell the workers how the request changed."""
        tracker = self.trackers.get(session.request_id)
        if tracker is None or tracker.turn_start is None:
            return
        held, removed, start = tracker.turn_start
        tracker.turn_start = None
        turn = [f for f in session.mm_features if f.mm_position.offset >= start]
        position = positions_after(session.num_prompt_tokens - start, turn, self.facts, start, tracker.next_position)
        tracker.next_position = position
        self.pending.append(RebasePlan(session.request_id, held, removed, position))
        if removed:
            logger.debug("cords-vllm: session %s re-based: %d tokens removed, %d held, next position %d",
                         session.request_id, removed, held, position)

    def preemption_reason(self, request: Any) -> str | None:
        """Why a request must end rather than be preempted: once re-based, it cannot be recomputed."""
        tracker = self.trackers.get(request.request_id)
        if tracker is None or not tracker.rebased:
            return None
        return ("the KV pool ran out and the stream would have been preempted; a stream whose evicted tokens "
                "left it cannot be recomputed from its own tokens (raise the pool or lower the number of streams)")

    def after_schedule(self, scheduler_output: Any) -> None:
        """Attach this step's plans (minus requests the step preempted) to its output."""
        plans, self.pending = self.pending, []
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in preempted:
            if (tracker := self.trackers.get(req_id)) is not None:
                tracker.reset()
        attach_plans(scheduler_output, [p for p in plans if isinstance(p, RebasePlan) or p.req_id not in preempted])

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

        Only requests the policy may compress count (:meth:`may_compress`): one whose video never passes
        ``budget + slack`` (e.g. after vLLM's video pruning) grows as under ``none``, so it is left to vLLM's own
        rule, admit and preempt if needed, and the policy costs nothing where it never compresses. A live
        stream always counts: once re-based it cannot be preempted, so its turn's growth stays reserved.
        """
        if request.request_id in self.manager.req_to_blocks:
            return 0  # already admitted: this is a chunk allocation
        reserve = 0
        for req_id, row in self.manager.req_to_blocks.items():
            tracker = self.trackers.get(req_id)
            admitted = self.requests.get(req_id)
            if tracker is None or admitted is None or (footprint := tracker.known_footprint) is None \
                    or not self.may_compress(admitted):  # the last: left to vLLM's rule
                continue
            reserve += max(0, footprint - non_null_blocks(row, tracker.state))
            if self.whole_managers:  # the whole layers' rows grow to the whole prompt
                prompt = cdiv(admitted.num_prompt_tokens, self.block_size)
                reserve += sum(max(0, prompt - len(m.req_to_blocks.get(req_id, ()))) for m in self.whole_managers)
        return reserve

    def whole_blocks(self, req_id: str) -> int:
        """Blocks a request holds in the groups kept whole (layer-selective compression; 0 otherwise)."""
        return sum(len(m.req_to_blocks.get(req_id, ())) for m in self.whole_managers)

    def describe(self, request: Any, row: list) -> RequestCompression:
        """What ``request`` holds now (``row``: its row of blocks)."""
        tracker = self.trackers.get(request.request_id) or RequestTracker(request.request_id)
        return tracker.describe(request, row, self.facts, self.config, self.block_size)
