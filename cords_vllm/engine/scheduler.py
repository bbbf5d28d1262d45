"""Scheduler side: decide compressions before the step allocates, free the blocks, admit by footprint.

At the start of ``Scheduler.schedule`` (before any of the step's ``allocate_slots``), every running request
still in its prompt is offered to the pure planner (:func:`~cords_vllm.compress.plan.plan_compression`). A
plan rewrites the request's row in the KV cache manager (``row[:j] = kept blocks + nulls``) and returns the
other blocks of the region to the block pool at once, so the allocation of this very step can use them: the
prototype decided after allocation, and a request was preempted three times that compression would have
saved. The plans ride on the ``SchedulerOutput`` to the workers, which copy the kept tokens before the
forward. Deciding at the start of ``schedule`` is also right under async scheduling: the workers apply plans
in step order, after the in-flight step has written its tokens.

Admission: vLLM reserves a new request's whole prompt (``scheduler_reserve_full_isl``). For a request with
video, the reservation is capped at its compressed footprint
(:func:`~cords_vllm.compress.plan.compressed_footprint_blocks`), so prompts whose full length would not
fit are admitted when their compressed form does.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from cords_vllm.compress.plan import (
    BudgetSettings,
    CompressionPlan,
    RequestCompressionState,
    VideoSpans,
    apply_plan,
    compressed_footprint_blocks,
    held_video_tokens,
    next_compression_point,
    plan_compression,
)
from cords_vllm.config import MODALITIES, REQUEST_OVERRIDES_KEY, KVPolicyConfig, KVPolicyConfigError
from cords_vllm.engine.checks import single_kv_cache_group
from cords_vllm.engine.protocol import attach_plans
from cords_vllm.observability import CounterSink

logger = logging.getLogger(__name__)


def marker_token_ids(model_config: Any) -> frozenset[int]:
    """The model's vision start / end marker tokens (Qwen2-VL family), which frame every video in a prompt."""
    hf = model_config.hf_config
    ids = (getattr(hf, "vision_start_token_id", None), getattr(hf, "vision_end_token_id", None))
    return frozenset(i for i in ids if isinstance(i, int))


def candidate_spans(request: Any, markers: frozenset[int] = frozenset(),
                    modalities: Collection[str] = MODALITIES) -> VideoSpans:
    """Logical ranges of a vLLM ``Request``'s candidate tokens: those of its multimodal inputs whose modality
    is in ``modalities`` (from their placeholders), in prompt order.

    Images and videos alike: each image is one frame (its own M-RoPE temporal label), so the images of a
    request, e.g. video frames a client sent as ``image_url`` parts, are one stream of frames in time order,
    interleaved with its videos' frames. Text between and around them is protected.

    A marker token (``markers``: e.g. ``<|vision_start|>`` / ``<|vision_end|>``) right before or after an
    input belongs to it: it is evicted with the input's tokens, so a live stream's per-clip markers (and the
    pair around every image) do not pile up as text that can never be evicted.
    """
    spans: list[tuple[int, int]] = []
    for feature in getattr(request, "mm_features", None) or ():
        if feature.modality not in modalities:
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
    if markers and spans:
        tokens = request.prompt_token_ids or ()
        spans = [(start - (start > 0 and tokens[start - 1] in markers),
                  end + (end < len(tokens) and tokens[end] in markers)) for start, end in spans]
    return VideoSpans(tuple(sorted(spans)))


@dataclass(frozen=True)
class RequestCompression:
    """One request as the scheduler sees it (see :mod:`cords_vllm.introspect`).

    ``region_blocks``: logical blocks compacted so far; ``held_blocks``: blocks of its row that are not
    null (its real KV footprint now); ``held_video_tokens``: video tokens physically held;
    ``video_tokens``: video tokens of its prompt; ``compressions``, ``evicted_tokens``: so far.
    """

    region_blocks: int
    held_blocks: int
    held_video_tokens: int
    video_tokens: int
    compressions: int
    evicted_tokens: int


def non_null_blocks(row: list, state: RequestCompressionState | None) -> int:
    """Blocks of a request's ``row`` that are not null, without scanning it: ``j - k`` entries of its region are
    null, none elsewhere."""
    return len(row) - (state.region_blocks - state.held_blocks if state else 0)


class _BlockIds:
    """The block ids of a row of ``KVCacheBlock`` objects, read lazily (the planner reads a few slices only)."""

    def __init__(self, row: list) -> None:
        self.row = row

    def __len__(self) -> int:
        return len(self.row)

    def __getitem__(self, index: slice) -> list[int]:
        return [b.block_id for b in self.row[index]]


class SchedulerCompressor:
    """Per-scheduler compression state and decisions."""

    def __init__(self, config: KVPolicyConfig, scheduler: Any) -> None:
        self.config = config
        kvm = scheduler.kv_cache_manager
        self.manager = single_kv_cache_group(kvm.coordinator.single_type_managers, config)
        self.pool = kvm.block_pool
        if self.pool.enable_caching:
            raise RuntimeError("--kv-policy needs prefix caching off (the plugin turns it off at start-up)")
        self.block_size = self.manager.block_size
        self.settings = BudgetSettings(config.budget, config.recent, config.slack)
        self.markers = marker_token_ids(scheduler.vllm_config.model_config)
        self.max_model_len = scheduler.vllm_config.model_config.max_model_len
        self.text_limit = config.text_limit(self.max_model_len)
        self.states: dict[str, RequestCompressionState] = {}
        self.spans: dict[str, tuple[int, VideoSpans]] = {}
        self.pending: list[CompressionPlan] = []
        self.footprints: dict[str, tuple[int, int]] = {}
        self.ending: set[str] = set()
        self.request_settings: dict[str, tuple[Any, BudgetSettings | KVPolicyConfigError]] = {}
        self.sink = CounterSink("scheduler")

    def spans_of(self, request: Any) -> VideoSpans:
        """The request's video spans (cached; a streaming session's grow with every turn that adds video)."""
        n_items = len(getattr(request, "mm_features", None) or ())
        cached = self.spans.get(request.request_id)
        if cached is None or cached[0] != n_items:
            spans = candidate_spans(request, self.markers, self.config.modalities)
            cached = self.spans[request.request_id] = (n_items, spans)
        return cached[1]

    def held_blocks(self, req_id: str, row: list) -> int:
        """Blocks of ``row`` that are not null (see :func:`non_null_blocks`)."""
        return non_null_blocks(row, self.states.get(req_id))

    # ------------------------------------------------------------------------------------------------
    def before_schedule(self, scheduler: Any) -> None:
        """Compress running prompts over budget; frees their evicted blocks now."""
        for req_id in [r for r in self.states if r not in scheduler.requests]:
            state = self.states.pop(req_id)
            logger.debug("cords-vllm: request %s done: %d compressions, %d video tokens evicted", req_id,
                         state.compressions, state.evicted_tokens)
        self.ending &= set(scheduler.requests)
        for cache in (self.spans, self.footprints, self.request_settings):
            for req_id in [r for r in cache if r not in scheduler.requests]:
                cache.pop(req_id)
        self._end_invalid_requests(scheduler)
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
            plan = plan_compression(req_id, _BlockIds(row), request.num_computed_tokens,
                                    request.num_prompt_tokens, video, state, self.settings_of(request),
                                    self.block_size)
            if plan is None:
                continue
            freed = plan.held_entries(row)[plan.num_keep // plan.block_size:]
            plan.compact_row(row, self.pool.null_block)
            self.pool.free_blocks(reversed(freed))
            new_state = apply_plan(state, plan)
            self.states[req_id] = new_state
            self.pending.append(plan)
            self.sink.add(compressions=1, evicted_tokens=new_state.evicted_tokens - state.evicted_tokens,
                          kept_tokens=plan.num_keep_video)
            logger.debug("cords-vllm: plan %s at token %d: region %d blocks, %d blocks freed, %d video kept",
                         req_id, request.num_computed_tokens, plan.region_blocks, len(freed),
                         plan.num_keep_video)

    def settings_of(self, request: Any) -> BudgetSettings:
        """The request's budget settings: the server's, narrowed by the request's own overrides if it has any
        (``SamplingParams.extra_args["kv_policy"]``, see :meth:`~cords_vllm.config.KVPolicyConfig.narrowed`).

        A request with invalid overrides is ended with an error before it is scheduled
        (:meth:`_end_invalid_requests`); until then it is planned with the server's settings.
        """
        settings = self._narrowed(request)
        return self.settings if isinstance(settings, KVPolicyConfigError) else settings

    def _narrowed(self, request: Any) -> BudgetSettings | KVPolicyConfigError:
        """The request's settings with its overrides applied, or why they are invalid (cached per request while
        its overrides stay the same)."""
        params = getattr(request, "sampling_params", None)
        overrides = (params.extra_args or {}).get(REQUEST_OVERRIDES_KEY) if params is not None else None
        if not overrides:
            return self.settings
        cached = self.request_settings.get(request.request_id)
        if cached is None or cached[0] != overrides:
            try:
                narrowed = self.config.narrowed(overrides)
                result: BudgetSettings | KVPolicyConfigError = BudgetSettings(narrowed.budget, narrowed.recent,
                                                                               narrowed.slack)
            except KVPolicyConfigError as exc:
                result = exc
            cached = self.request_settings[request.request_id] = (overrides, result)
        return cached[1]

    def _end_invalid_requests(self, scheduler: Any) -> None:
        """End waiting requests (new ones, and sessions whose next turn arrived) that the policy cannot serve:
        more protected (non-candidate) tokens than ``max_text_tokens`` (the start-up rule only promised the pool
        their bounded footprint), or invalid per-request overrides.

        They go through vLLM's own error channel (the ids the scheduler ends with ``FINISHED_ERROR``, and
        reports to the client, when it processes the step's output).
        """
        limit = self.text_limit
        for request in [*scheduler.waiting, *getattr(scheduler, "kv_holding_waiting", ())]:
            if request.request_id in self.ending:
                continue
            reason = None
            text = request.num_tokens - self.spans_of(request).total
            if text > limit:
                reason = (f"holds {text} protected (text) tokens, more than kv_policy_config key 'max_text_tokens' "
                          f"({limit})")
            if reason is None and isinstance(invalid := self._narrowed(request), KVPolicyConfigError):
                reason = str(invalid)
            if reason is not None:
                self.ending.add(request.request_id)
                logger.warning("cords-vllm: request %s %s: it is ended with an error", request.request_id, reason)
                scheduler.encoder_cache_mismatch_reqs.add(request.request_id)

    def after_schedule(self, scheduler_output: Any) -> None:
        """Attach this step's plans (minus requests the step preempted) to its output."""
        plans, self.pending = self.pending, []
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        plans = [p for p in plans if p.req_id not in preempted]
        for req_id in preempted:
            self.states.pop(req_id, None)
        attach_plans(scheduler_output, plans)

    def chunk_limit(self, request: Any, num_computed: int) -> int | None:
        """The most tokens ``request`` may compute from ``num_computed`` on: up to its next compression point.

        Points depend only on the request's token layout, its compression state and the policy's settings
        (:func:`~cords_vllm.compress.plan.next_compression_point`), so a request is compressed at the same
        logical positions, and keeps the same tokens, alone or in any batch and under any chunk settings.
        ``None``: no point ahead.
        """
        video = self.spans_of(request)
        if video.total == 0 or num_computed >= request.num_prompt_tokens:
            return None
        state = self.states.get(request.request_id) or RequestCompressionState()
        point = next_compression_point(state, video, num_computed, request.num_prompt_tokens,
                                       self.settings_of(request), self.block_size)
        return None if point is None else point - num_computed

    def admission_cap(self, request: Any) -> int | None:
        """Blocks to reserve for a request with video: its compressed footprint (``None``: no cap).

        Cached per request and token count (a streaming session's footprint grows with its text).
        """
        cached = self.footprints.get(request.request_id)
        if cached is None or cached[0] != request.num_tokens:
            video = self.spans_of(request)
            if video.total == 0:
                return None
            cached = self.footprints[request.request_id] = (request.num_tokens, compressed_footprint_blocks(
                request.num_tokens, video.total, self.settings_of(request), self.block_size))
        return cached[1]

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
                reserve += max(0, footprint[1] - self.held_blocks(req_id, row))
        return reserve


def describe_requests(scheduler: Any, compressor: SchedulerCompressor | None) -> dict[str, RequestCompression]:
    """Every request ``scheduler`` holds blocks for, with its compression state (any policy, ``none`` too)."""
    manager = compressor.manager if compressor else scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    markers = compressor.markers if compressor else marker_token_ids(scheduler.vllm_config.model_config)
    out = {}
    for req_id, row in manager.req_to_blocks.items():
        request = scheduler.requests.get(req_id)
        if request is None:
            continue
        video = compressor.spans_of(request) if compressor else candidate_spans(request, markers)
        state = (compressor.states.get(req_id) if compressor else None) or RequestCompressionState()
        out[req_id] = RequestCompression(
            region_blocks=state.region_blocks, held_blocks=non_null_blocks(row, state),
            held_video_tokens=held_video_tokens(state, video, request.num_computed_tokens, manager.block_size),
            video_tokens=video.total, compressions=state.compressions, evicted_tokens=state.evicted_tokens)
    return out
