"""Worker side: carry out the scheduler's compression plans on the paged KV cache, before the forward.

For each plan of the step (run right after ``GPUModelRunner._update_states``, so new block ids are appended
and the persistent batch is condensed):

1. Rewrite the worker's two copies of the request's row (``CachedRequestState.block_ids``, which survives
   the request leaving the persistent batch, and the persistent ``InputBatch`` block table the kernels read):
   ``row[:j] = kept blocks + nulls`` (:meth:`~cords_vllm.compress.plan.CompressionPlan.compact_row`, which
   touches only the entries that change). Host data only.
2. Build the request's :class:`~cords_vllm.compress.step.RegionBatch` (one non-blocking upload of the plan's
   block ids and spans).

Then the pure :func:`~cords_vllm.compress.step.compress_regions` carries out every plan of the step on the cache's
device, in one call: each request's compression is :func:`~cords_vllm.compress.step.compress_region`'s, and their
greedy orders are computed together (on a CPU a greedy run costs its per-step kernel overhead, so a step's
compressions cost about what one does). A compression that fails ends its request alone.

The freed blocks may be handed out again in this very step; that is safe because the copy runs before this
step's forward, which is the first thing that writes them, and because the scheduler takes them out of the blocks
vLLM zeroes at the start of ``_update_states`` on a hybrid model
(:func:`~cords_vllm.integration.handoff.plans.attach_plans`).

Each compressed request has one :class:`~cords_vllm.integration.worker.tracker.WorkerRequest`, dropped when it
finishes, is preempted (it recomputes from scratch) or resumes after a preemption.

Streaming sessions' turns (positions, re-basing) are :mod:`cords_vllm.integration.worker.turns`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cords_vllm.compress.attention_view import RowHoles
from cords_vllm.compress.frames import frame_sizes, label_runs, layout_labels
from cords_vllm.compress.kv_access import KVAccessor, slots_of
from cords_vllm.compress.kv_codec import KVCodec, check_kv_cache_dtype
from cords_vllm.compress.plan import NULL_BLOCK_ID, CompressionPlan
from cords_vllm.compress.step import (
    HeldTokens,
    RegionBatch,
    RegionCompression,
    SelectionSetup,
    compress_regions,
    describe_path,
    video_mask,
)
from cords_vllm.compress.transfer import upload
from cords_vllm.compress.unit_choice import AUTO, compression_unit
from cords_vllm.config import KVPolicyConfig
from cords_vllm.integration.engine_facts import decoder_layer_index, model_facts_of
from cords_vllm.integration.handoff import failures
from cords_vllm.integration.handoff.plans import plans_of
from cords_vllm.integration.handoff.published import PUBLISH_INTERVAL_S, Publisher
from cords_vllm.integration.kv_groups import attention_group_index, check_layer_groups
from cords_vllm.integration.worker.cpu_layout import accessor_for_layer, codec_for_layer, kv_cache_dtype_of
from cords_vllm.integration.worker.pipeline_parallel import stage_anchors
from cords_vllm.integration.worker.query_capture import QueryCapture
from cords_vllm.integration.worker.tensor_parallel import tp_head_gatherer
from cords_vllm.integration.worker.timing import CompressionTimer
from cords_vllm.integration.worker.tracker import WorkerPlanError, WorkerRequest
from cords_vllm.integration.worker.turns import SessionTurns
from cords_vllm.integration.worker.warmup import warm_up_kernels
from cords_vllm.model_facts import FRAMES_FROM_LAYOUT
from cords_vllm.selection import get_selector
from cords_vllm.threads import intra_op_threads

logger = logging.getLogger(__name__)

#: Set to ``1`` to keep a record of every compression (kept logical ids per layer) for tests and debugging.
TRACE_ENV = "CORDS_VLLM_TRACE"
#: Intra-op threads compression (read, selection, copy) runs with (default 1): see :mod:`cords_vllm.threads`.
SELECTION_THREADS_ENV = "CORDS_VLLM_SELECTION_THREADS"


@dataclass(frozen=True)
class CompressionEvent:
    """A compression as carried out by a worker (recorded when ``CORDS_VLLM_TRACE=1``).

    ``kept_logical[l]`` is ``long [H, n]`` (host): the ids (indices in the stream, as if nothing had been
    removed from it) layer ``l`` holds right after the compression, up to ``at_token`` (the id of the first
    token of the chunk computed next). ``selection_seconds``: host seconds around the step (on a GPU, launch
    time; the device time is what ``/metrics`` reports).
    """

    req_id: str
    at_token: int
    region_blocks: int
    kept_logical: tuple[torch.Tensor, ...]
    selection_seconds: float


@dataclass(frozen=True)
class WorkerSnapshot:
    """Read-only view of a worker's compression state (see :mod:`cords_vllm.integration.inprocess`)."""

    compressions: int
    selection_seconds: float
    held: dict[str, tuple[int, int]]  # req_id -> (kept blocks, region blocks)
    events: tuple[CompressionEvent, ...]


@dataclass(frozen=True)
class _Started:
    """A plan whose rows are rewritten and whose compression is built, to be carried out with the step's others."""

    plan: CompressionPlan
    tracker: WorkerRequest
    compression: RegionCompression


@dataclass
class _Totals:
    compressions: int = 0
    selection_seconds: float = 0.0
    events: list[CompressionEvent] = field(default_factory=list)


class WorkerCompressor:
    """Applies compression plans inside one model runner."""

    def __init__(self, config: KVPolicyConfig, runner: Any) -> None:
        self.config = config
        groups = runner.kv_cache_config.kv_cache_groups
        check_layer_groups(groups, config)
        #: The KV cache group compressed (a hybrid model's state groups are left alone).
        self.group_index = attention_group_index([g.kv_cache_spec for g in groups], config)
        names = sorted(groups[self.group_index].layer_names, key=decoder_layer_index)
        self.layer_names = names
        #: Each layer's anchor, as a position in ``names``; mapped by the layer's index in the model, so a pipeline
        #: stage's layers follow anchors on the stage (:mod:`cords_vllm.integration.worker.pipeline_parallel`).
        anchor_of = stage_anchors(config, runner.vllm_config, [decoder_layer_index(n) for n in names])
        self.facts = model_facts_of(runner.vllm_config)
        if config.granularity == "frame" and not self.facts.finds_frames:
            raise ValueError(
                f"--kv-policy {config.policy}: granularity 'frame' needs the model's frames, read from M-RoPE "
                "temporal positions (Qwen-VL families) or the video placeholder's layout (LLaVA-NeXT-Video); this "
                "model has neither. Use granularity 'token' or 'block'.")
        forward_context = runner.compilation_config.static_forward_context
        modules = [forward_context[n] for n in names]
        self.caches = [self._cache(m) for m in modules]
        self.device = self.caches[0].device
        for module in modules:
            check_kv_cache_dtype(kv_cache_dtype_of(module), config.policy)
        model_dtype = runner.vllm_config.model_config.dtype
        self.accessors: list[KVAccessor] = [accessor_for_layer(c, m, model_dtype)
                                            for c, m in zip(self.caches, modules, strict=True)]
        self.codecs: list[KVCodec] = [codec_for_layer(m) for m in modules]
        self.block_size = self.accessors[0].block_size
        self.setup = SelectionSetup(
            selector=get_selector(config.policy, **dict(config.params)), granularity=config.granularity,
            per_head=config.per_head, anchor_of=anchor_of,
            gather_heads=None if config.per_head else tp_head_gatherer(runner, self.accessors[0].num_kv_heads),
            kernels=config.kernels)
        logger.info("cords-vllm: compress step on %s: %s", self.device,
                    describe_path(self.caches, self.accessors, self.codecs, self.setup))
        self.requests: dict[str, WorkerRequest] = {}
        #: Streaming sessions' turns: the scheduler's re-base plans until each turn arrives, and its positions.
        self.sessions = SessionTurns(self.requests, self.block_size)
        #: The queries an attention-scored policy observes (``None`` for the others).
        self.capture = self._query_capture(runner, modules) if self.setup.selector.needs_observation else None
        self.totals = _Totals()
        #: Device time of each compression: CUDA events on a GPU (read once complete), the host clock on CPU.
        self.timer = CompressionTimer.for_device(self.device)
        #: Requests whose compression failed here, handed to the scheduler to end (no plan of theirs is applied).
        self.failed: set[str] = set()
        self.trace = os.environ.get(TRACE_ENV) == "1"
        self.publisher = Publisher("worker")
        self.selection_threads = int(os.environ.get(SELECTION_THREADS_ENV, "1"))
        #: Compressions that met non-finite keys or values (on the device: read only when published).
        self.nonfinite = torch.zeros((), dtype=torch.long, device=self.device)
        self._nonfinite_published = 0
        self._nonfinite_read_at = 0.0
        self._unread_compressions = 0
        self._probe_layouts()
        #: What the start-up kernel warm-up compiled (``None``: it did not run; see :meth:`warm_up_kernels`).
        self.warmup: Any = None

    def _query_capture(self, runner: Any, modules: list[Any]) -> QueryCapture:
        if self.setup.gather_heads is not None:
            raise ValueError(f"--kv-policy {self.config.policy} selects jointly over every rank's KV heads under "
                             "tensor parallelism, which needs every rank's observation queries; set per_head true in "
                             "--kv-policy-config, or serve on one rank")
        rotaries = None
        if self.setup.selector.observation_source == "prompt_at_newest":
            model = runner.get_model()
            parents = [model.get_submodule(self.layer_names[a].rsplit(".", 1)[0]) for a in self.setup.anchors]
            rotaries = [getattr(p, "rotary_emb", None) for p in parents]
            if any(r is None or not hasattr(r, "cos_sin_cache") for r in rotaries):
                raise ValueError(f"--kv-policy {self.config.policy} moves its catalyst rows after the newest token "
                                 "with the model's rotary embedding, which this model's attention layers do not "
                                 "expose as rotary_emb")
        return QueryCapture(self.setup.selector, [modules[a] for a in self.setup.anchors],
                            runner.vllm_config.scheduler_config.max_num_seqs, self.config.modalities, self.facts,
                            runner.vllm_config.model_config.dtype, self.device, self.sessions.removed_tokens, rotaries)

    def _next_position(self, runner: Any, req_id: str) -> int:
        """The rotary position right after the request's newest computed token (M-RoPE: the largest so far)."""
        state = runner.requests[req_id]
        mrope = getattr(state, "mrope_positions", None)
        if mrope is not None:
            return int(mrope[:, : state.num_computed_tokens].max()) + 1
        return state.num_computed_tokens + self.sessions.removed_tokens(req_id)

    @staticmethod
    def _cache(module: Any) -> torch.Tensor:
        cache = module.kv_cache
        return cache[0] if isinstance(cache, list | tuple) else cache

    def _probe_layouts(self) -> None:
        """Write/read-back check of every layer's layout at start-up (fails loudly, never silently)."""
        slots = slots_of(torch.tensor([1], device=self.device), self.block_size)[:1]  # block 0 is the null block
        for name, cache, accessor in zip(self.layer_names, self.caches, self.accessors, strict=True):
            if cache.numel() == 0:
                continue
            saved = accessor.read(cache, slots)
            probe = torch.arange(accessor.num_kv_heads * accessor.head_size, dtype=torch.float32,
                                 device=self.device).view(1, accessor.num_kv_heads, accessor.head_size)
            probe = probe.to(cache.dtype)
            accessor.write(cache, slots, probe, -probe)
            got_k, got_v = accessor.read(cache, slots)
            accessor.write(cache, slots, *saved)
            if not (torch.equal(got_k, probe) and torch.equal(got_v, -probe)):
                raise RuntimeError(f"KV layout of layer {name} ({accessor}) failed its read-back probe")

    def warm_up_kernels(self, runner: Any) -> None:
        """At start-up: the compress step's kernels compiled for this server's widths
        (:func:`~cords_vllm.integration.worker.warmup.warm_up_kernels`)."""
        warm_up_kernels(self, runner)

    # ------------------------------------------------------------------------------------------------
    def on_step(self, runner: Any, scheduler_output: Any) -> None:
        """Drop requests that left, take this step's 1-D session turns, then carry out this step's plans."""
        if not self.facts.explicit_positions:
            for new in scheduler_output.scheduled_new_reqs or ():
                if self.sessions.waiting(new.req_id) and new.req_id in runner.requests:
                    self.sessions.rebase(runner.requests[new.req_id])
        # A preempted request recomputes from scratch (its state goes when it is preempted); a resumed
        # streaming session keeps its KV and compressed region (its frames are re-read once its prompt grew).
        gone = set(scheduler_output.finished_req_ids or ()) | set(scheduler_output.preempted_req_ids or ())
        gone |= {r for r in self.requests if r not in runner.requests}
        if self.capture is not None:
            gone |= {r for r in self.capture.rows if r not in runner.requests}
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids or ():
            state = runner.requests.get(req_id)
            if state is None or state.num_computed_tokens == 0:
                gone.add(req_id)  # resumed after a preemption: recomputes from scratch
        for req_id in set(scheduler_output.finished_req_ids or ()):
            self.sessions.forget(req_id)
        self.failed -= gone
        for req_id in gone:
            if self.capture is not None:
                self.capture.release(req_id)
            tracker = self.requests.pop(req_id, None)
            if tracker is not None:
                logger.debug("cords-vllm: request %s left the worker after %d compressions (%.1f ms selecting)",
                             req_id, tracker.compressions, 1e3 * tracker.selection_seconds)
        plans = [p for p in plans_of(scheduler_output) if isinstance(p, CompressionPlan)
                 and p.req_id not in gone and p.req_id in runner.requests and p.req_id not in self.failed]
        if plans:
            with intra_op_threads(self.selection_threads):
                self._apply(runner, plans)
        self._record_timings()
        self._publish_nonfinite()

    def _record_timings(self) -> None:
        """Account the compressions whose time is known (on a GPU: whose end event has completed)."""
        for timing in self.timer.completed():
            tracker = self.requests.get(timing.req_id)
            if tracker is not None:
                tracker.selection_seconds += timing.seconds
            self.totals.selection_seconds += timing.seconds
            self.publisher.add(selection_seconds=timing.seconds)

    def holes(self, input_batch: Any) -> list[RowHoles]:
        """The compressed rows of the persistent batch (host data only; empty when none is compressed)."""
        if not self.requests:
            return []
        index = input_batch.req_id_to_index
        return [RowHoles(row, *tracker.holes) for req_id, tracker in self.requests.items()
                if tracker.holes[0] < tracker.holes[1] and (row := index.get(req_id)) is not None]

    def _publish_nonfinite(self) -> None:
        """Publish the non-finite counter after a step that follows compressions: one host read per publication
        interval at most, never one per compression."""
        now = time.monotonic()
        if not self._unread_compressions or now - self._nonfinite_read_at < PUBLISH_INTERVAL_S:
            return
        self._nonfinite_read_at, self._unread_compressions = now, 0
        count = int(self.nonfinite)
        if count > self._nonfinite_published:
            logger.warning("cords-vllm: %d compression(s) met NaN or inf keys/values; selection read them as 0",
                           count - self._nonfinite_published)
            self.publisher.add(nonfinite_compressions=count - self._nonfinite_published)
            self._nonfinite_published = count

    def snapshot(self) -> WorkerSnapshot:
        t = self.totals
        return WorkerSnapshot(compressions=t.compressions, selection_seconds=t.selection_seconds,
                              held={r: w.holes for r, w in self.requests.items() if w.compressed},
                              events=tuple(t.events))

    # ------------------------------------------------------------------------------------------------
    def _rewrite_rows(self, runner: Any, plan: CompressionPlan) -> None:
        row = runner.requests[plan.req_id].block_ids[self.group_index]
        if plan.held_entries(row) != list(plan.src_blocks):
            raise WorkerPlanError(f"worker row of {plan.req_id} disagrees with the scheduler's plan")
        plan.compact_row(row, NULL_BLOCK_ID)
        index = runner.input_batch.req_id_to_index.get(plan.req_id)
        if index is not None:
            plan.compact_row(runner.input_batch.block_table[self.group_index].block_table.np[index], NULL_BLOCK_ID)

    def _labels(self, runner: Any, plan: CompressionPlan, tracker: WorkerRequest) -> torch.Tensor | None:
        """Frame labels of the tokens entering the region (host, ``long [N]``) when the plan needs them, after
        updating the request's frame sizes from its spans ahead of the region (those behind it were read by
        earlier compressions)."""
        if self.config.granularity not in ("frame", AUTO) and not self.setup.selector.needs_frame_length:
            return None
        begin, region_end = plan.prev_region_blocks * plan.block_size, plan.region_blocks * plan.block_size
        spans = [(max(a, begin), b) for a, b in plan.candidates.spans if b > begin]
        end = max([region_end, *(b for _, b in spans)])
        labels = self._frame_labels(runner.requests[plan.req_id], begin, end, tracker.removed_tokens)
        if labels is None:
            if self.config.granularity == "frame":
                raise WorkerPlanError(f"request {plan.req_id} has no M-RoPE positions to find its frames in")
            return None
        sizes = frame_sizes(labels, [(a - begin, b - begin) for a, b in spans])
        if sizes:
            tracker.first_frame = tracker.first_frame or sizes[0]
            tracker.largest_frame = max(tracker.largest_frame, *sizes)
        return labels[: region_end - begin]

    def _frame_labels(self, state: Any, begin: int, end: int, removed: int = 0) -> torch.Tensor | None:
        """Frame labels of the request's tokens ``[begin, end)`` (host, ``long [end - begin]``), non-decreasing
        along the stream: M-RoPE temporal positions, or, for a family whose placeholder is laid out frame after
        frame (:data:`~cords_vllm.model_facts.FRAMES_FROM_LAYOUT`), each input's offset in the stream (``removed``:
        tokens re-basing took out of the request before it) plus the frame index within it
        (:func:`~cords_vllm.compress.frames.layout_labels`), so they stay above the labels of the frames held from
        before a re-base. ``None``: the request has no M-RoPE positions."""
        if self.facts.frames_from == FRAMES_FROM_LAYOUT:
            inputs = [(f.mm_position.offset, f.mm_position.length) for f in state.mm_features
                      if f.modality != "prompt_embeds"]
            return layout_labels(begin, end, inputs, self.facts.tokens_per_frame) + removed
        mrope = getattr(state, "mrope_positions", None)
        return None if mrope is None else mrope[0, begin:end].to(torch.long)

    def _region_batch(self, plan: CompressionPlan, tracker: WorkerRequest, labels: torch.Tensor | None,
                      next_position: int = 0) -> RegionBatch:
        bs, base = plan.block_size, tracker.removed_tokens
        spans = np.asarray(plan.candidates.spans, dtype=np.int64).reshape(-1, 2) + base
        host = [np.asarray(plan.src_blocks), np.asarray(plan.kept_blocks), spans]
        frames = labels is not None
        if frames:
            host.append(labels.numpy())
        src, kept, spans_d, *rest = upload(host, self.device)
        entering = (base + plan.prev_region_blocks * bs, base + plan.region_blocks * bs)
        new_ids = torch.arange(*entering, device=self.device)
        unit = compression_unit(self.config.granularity, plan.num_keep_candidates,
                                tracker.largest_frame if frames else None, self.config.min_units)
        group_size = {"block": unit.group_size or bs, "frame": tracker.largest_frame if frames else None
                      }.get(unit.granularity)
        by_frames = self.config.granularity in ("frame", AUTO) and frames
        # No frame_budget: the exact one depends on which frames earlier compressions kept (and trimmed), chosen
        # on the device; select_exact reads it with the frame count in the compression's one host read. The fused
        # step reads nothing: the entering labels' runs and the held ones' (counted on the device, copied to the
        # host a compression late) bound the frames it sizes its units by.
        return RegionBatch(
            src_slots=slots_of(src, bs), dst_slots=slots_of(kept, bs), new_ids=new_ids, spans=spans_d,
            new_labels=rest[0] if by_frames else None,
            new_label_runs=label_runs(labels, video_mask(torch.arange(*entering), torch.from_numpy(spans)))
            if by_frames else None,
            num_keep=plan.num_keep, num_keep_candidates=plan.num_keep_candidates,
            num_candidates=plan.num_held_candidates, group_size=group_size,
            frame_tokens=tracker.first_frame if frames else None, num_recent=plan.num_recent,
            observed=None if self.capture is None else self.capture.observed(plan.req_id, next_position),
            granularity=unit.granularity)

    def _apply(self, runner: Any, plans: Sequence[CompressionPlan]) -> None:
        """Carry out a step's plans: every request's compression in one :func:`compress_regions` call (their greedy
        orders computed together). A compression that fails ends its request alone."""
        started: list[_Started] = []
        for plan in plans:
            try:
                started.append(self._begin(runner, plan))
            except Exception as exc:
                self._fail(plan.req_id, exc)
        if not started:
            return
        t0, mark = time.perf_counter(), self.timer.start()
        results = compress_regions(self.caches, self.accessors, [s.compression for s in started], self.setup,
                                   nonfinite=self.nonfinite, codecs=self.codecs)
        self.timer.stop([s.plan.req_id for s in started], mark)
        seconds = (time.perf_counter() - t0) / len(started)
        for begun, result in zip(started, results, strict=True):
            try:
                if isinstance(result, Exception):
                    raise result
                self._finish(runner, begun, result, seconds)
            except Exception as exc:
                self._fail(begun.plan.req_id, exc)

    def _fail(self, req_id: str, exc: Exception) -> None:
        """End ``req_id``, whose compression raised ``exc`` (called in its ``except`` block); re-raise where no
        scheduler can end it (its KV no longer matches its row)."""
        reason = f"the KV policy could not compress it ({type(exc).__name__}: {exc})"
        if not failures.report(req_id, reason):
            raise exc
        logger.error("cords-vllm: compressing request %s failed; it is ended", req_id, exc_info=exc)
        self.failed.add(req_id)

    def _begin(self, runner: Any, plan: CompressionPlan) -> _Started:
        """Rewrite the request's rows to the plan and build its compression (host work, a few uploads)."""
        self._rewrite_rows(runner, plan)
        tracker = self.requests.get(plan.req_id)
        if tracker is None:
            tracker = self.requests[plan.req_id] = WorkerRequest(held=[None] * len(self.caches))
        # only rows moved after the newest token read it (an O(prompt) host read of M-RoPE positions)
        next_position = self._next_position(runner, plan.req_id) if self.capture is not None and \
            self.capture.moves_rows else 0
        batch = self._region_batch(plan, tracker, self._labels(runner, plan, tracker), next_position)
        return _Started(plan, tracker, RegionCompression(tracker.held, batch))

    def _finish(self, runner: Any, begun: _Started, held: list[HeldTokens], seconds: float) -> None:
        """Account a carried-out compression (``seconds``: its share of the step's compress time)."""
        plan, tracker = begun.plan, begun.tracker
        tracker.held = held
        tracker.holes = (plan.num_keep // plan.block_size, plan.region_blocks)
        tracker.compressions += 1
        self.totals.compressions += 1
        self._unread_compressions += 1
        at = runner.requests[plan.req_id].num_computed_tokens
        logger.debug("cords-vllm: compressed %s at token %d: region %d blocks, kept %d of %d tokens (%d candidates), "
                     "%.1f ms", plan.req_id, at, plan.region_blocks, plan.num_keep, plan.num_held,
                     plan.num_keep_candidates, 1e3 * seconds)
        if self.trace:
            heads, base = self.accessors[0].num_kv_heads, tracker.removed_tokens
            tail = torch.arange(base + plan.region_blocks * plan.block_size, base + at).expand(heads, -1)
            self.totals.events.append(CompressionEvent(
                req_id=plan.req_id, at_token=base + at, region_blocks=plan.region_blocks,
                kept_logical=tuple(torch.cat([h.ids.cpu(), tail], dim=1) for h in tracker.held if h is not None),
                selection_seconds=seconds))
