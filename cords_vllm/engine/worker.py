"""Worker side: carry out the scheduler's compression plans on the paged KV cache, before the forward.

For each plan on the step's ``SchedulerOutput`` (run right after ``GPUModelRunner._update_states``, so new
block ids are appended and the persistent batch is condensed):

1. Rewrite the worker's two copies of the request's row (``CachedRequestState.block_ids``, which survives
   the request leaving the persistent batch, and the persistent ``InputBatch`` block table the kernels read):
   ``row[:j] = plan.row_head``.
2. Read the held tokens of each anchor layer, run the selector (:func:`select_region`), and for every layer
   copy the kept tokens (its anchor's positions) into the first ``k`` held blocks, in logical order.
   Sources of a layer are read in full before that layer is written, so kept blocks may overlap sources.

The freed blocks may be handed to another request in this very step; that is safe because the copy runs
before this step's forward, which is the first thing that can write them.

State per request: the logical ids held in its compacted region, per layer and head (``[H, n]``), to know
which held tokens are video (candidates) at the next compression. It is dropped when the request finishes,
is preempted (it recomputes from scratch) or resumes.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cords_vllm.config import KVPolicyConfig
from cords_vllm.engine.kv_layout import KVLayout, slots_of
from cords_vllm.engine.planner import CompressionPlan
from cords_vllm.engine.region_selection import select_region
from cords_vllm.observability import CounterSink
from cords_vllm.selection import get_selector
from cords_vllm.threads import intra_op_threads

logger = logging.getLogger(__name__)

#: Set to ``1`` to keep a record of every compression (kept logical ids per layer) for tests and debugging.
TRACE_ENV = "CORDS_VLLM_TRACE"
#: Intra-op threads compression (read, selection, copy) runs with (default 1). Greedy selection is a long
#: chain of small ops;
#: with several OpenMP threads each op waits for every thread, and one busy core stalls the chain
#: (measured here: 0.09 s with 1 thread vs 3 s with 2 threads for 4 x 768 tokens, next to a busy process).
SELECTION_THREADS_ENV = "CORDS_VLLM_SELECTION_THREADS"
PLANS_ATTR = "cords_plans"


@dataclass
class CompressionEvent:
    """A compression as carried out by a worker (recorded when ``CORDS_VLLM_TRACE=1``).

    ``kept_logical[l]`` is ``long [H, n]``: the logical ids layer ``l`` holds right after the compression,
    up to ``at_token`` (the first logical token of the chunk computed next).
    """

    req_id: str
    at_token: int
    region_blocks: int
    kept_logical: list[torch.Tensor]
    selection_seconds: float


@dataclass
class WorkerStats:
    compressions: int = 0
    selection_seconds: float = 0.0
    copy_seconds: float = 0.0
    per_request: dict[str, dict[str, float]] = field(default_factory=dict)


def frame_labels(request_state: Any, spans: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, int]:
    """Frame label of every token of a request and the largest frame of its videos.

    A video token's label is its M-RoPE temporal position: the tokens of one frame (temporal patch) share
    it and later frames have larger ones, across all videos of the request. Returns ``(long [L], tokens of
    the largest frame)``.
    """
    temporal = request_state.mrope_positions[0]
    largest = max(int(torch.unique_consecutive(temporal[start:end], return_counts=True)[1].max())
                  for start, end in spans)
    return temporal.to(torch.long), largest


def tokens_per_frame(request_state: Any, spans: tuple[tuple[int, int], ...]) -> int | None:
    """Tokens of one frame (temporal patch) of the request's first video, from its M-RoPE positions.

    Video tokens of one frame share their temporal position; ``None`` without M-RoPE positions.
    """
    mrope = getattr(request_state, "mrope_positions", None)
    if mrope is None or not spans:
        return None
    start, end = spans[0]
    t = mrope[0, start:end]
    return int((t == t[0]).sum())


def _layer_index(name: str) -> int:
    match = re.search(r"\.layers\.(\d+)\.", name)
    if match is None:
        raise ValueError(f"cannot find the decoder layer index in attention layer name {name!r}")
    return int(match.group(1))


class WorkerCompressor:
    """Applies compression plans inside one model runner."""

    def __init__(self, config: KVPolicyConfig, runner: Any) -> None:
        self.config = config
        self.selector = get_selector(config.policy, **dict(config.params))
        groups = runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise NotImplementedError(
                f"--kv-policy {config.policy}: models with {len(groups)} KV cache groups (hybrid or sliding-window "
                "attention) are not supported; cords-vllm compresses one full-attention KV cache group")
        names = list(groups[0].layer_names)
        self.layer_names = sorted(names, key=_layer_index)
        self.num_layers = len(self.layer_names)
        config.check_model(self.num_layers)
        self.anchor = [config.anchor_of(i, self.num_layers) for i in range(self.num_layers)]
        self.anchors = sorted(set(self.anchor))
        if config.granularity == "frame" and not getattr(runner, "uses_mrope", False):
            raise ValueError(
                f"--kv-policy {config.policy}: granularity 'frame' reads frames from M-RoPE temporal positions "
                "(Qwen2-VL family); this model has none. Use granularity 'token' or 'block'.")
        forward_context = runner.compilation_config.static_forward_context
        self.modules = [forward_context[n] for n in self.layer_names]
        self.layouts = [KVLayout.for_layer(self._cache(i), m) for i, m in enumerate(self.modules)]
        self.held: dict[str, list[torch.Tensor]] = {}
        self.stats = WorkerStats()
        self.trace = os.environ.get(TRACE_ENV) == "1"
        self.events: list[CompressionEvent] = []
        self.sink = CounterSink("worker")
        self.selection_threads = int(os.environ.get(SELECTION_THREADS_ENV, "1"))
        self._probe_layouts()

    def _cache(self, layer: int) -> torch.Tensor:
        cache = self.modules[layer].kv_cache
        return cache[0] if isinstance(cache, list | tuple) else cache

    def _probe_layouts(self) -> None:
        """Write/read-back check of every layer layout at start-up (fails loudly, never silently)."""
        for i, layout in enumerate(self.layouts):
            cache = self._cache(i)
            if cache.numel() == 0:
                continue
            slots = slots_of([1], layout.block_size, 1)  # block 1 (0 is the null block), first slot
            saved = layout.read(cache, slots)
            probe_k = torch.arange(layout.num_kv_heads * layout.head_size, dtype=torch.float32).view(
                1, layout.num_kv_heads, layout.head_size).to(cache.dtype)
            layout.write(cache, slots, probe_k, -probe_k)
            got_k, got_v = layout.read(cache, slots)
            layout.write(cache, slots, *saved)
            if not (torch.equal(got_k, probe_k) and torch.equal(got_v, -probe_k)):
                raise RuntimeError(f"KV layout of layer {self.layer_names[i]} ({layout}) failed its read-back probe")

    # ------------------------------------------------------------------------------------------------
    def on_step(self, runner: Any, scheduler_output: Any) -> None:
        gone = set(scheduler_output.finished_req_ids or ()) | set(getattr(scheduler_output, "preempted_req_ids",
                                                                           None) or ())
        gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())
        gone |= {r for r in self.held if r not in runner.requests}
        for req_id in gone:
            self.held.pop(req_id, None)
            per = self.stats.per_request.pop(req_id, None)
            if per:
                logger.debug("cords-vllm: request %s left the worker after %d compressions (%.1f ms selecting)",
                             req_id, per["compressions"], 1e3 * per["selection_seconds"])
        plans = [p for p in getattr(scheduler_output, PLANS_ATTR, None) or ()
                 if p.req_id not in gone and p.req_id in runner.requests]
        if plans:
            with intra_op_threads(self.selection_threads):
                for plan in plans:
                    self._apply(runner, plan)

    def _rewrite_rows(self, runner: Any, plan: CompressionPlan) -> None:
        j = plan.region_blocks
        state = runner.requests[plan.req_id]
        row = state.block_ids[0]
        if [b for b in row[:j] if b != 0] != list(plan.src_blocks):
            raise AssertionError(f"worker row of {plan.req_id} disagrees with the scheduler's plan")
        row[:j] = plan.row_head
        index = runner.input_batch.req_id_to_index.get(plan.req_id)
        if index is not None:
            table = runner.input_batch.block_table[0]
            table.block_table.np[index, :j] = plan.row_head

    @torch.inference_mode()
    def _apply(self, runner: Any, plan: CompressionPlan) -> None:
        self._rewrite_rows(runner, plan)
        bs = plan.block_size
        held_before = self.held.get(plan.req_id)
        new_ids = torch.arange(plan.prev_region_blocks * bs, plan.region_blocks * bs)
        heads = self.layouts[0].num_kv_heads
        held = [torch.cat([held_before[i] if held_before else torch.empty(heads, 0, dtype=torch.long),
                           new_ids.expand(heads, -1)], dim=1) for i in range(self.num_layers)]
        if held[0].shape[1] != plan.num_held:
            raise AssertionError(f"{plan.req_id}: worker holds {held[0].shape[1]} region tokens, plan says "
                                 f"{plan.num_held}")
        src = slots_of(plan.src_blocks, bs)
        dst = slots_of(plan.kept_blocks, bs)

        t0 = time.perf_counter()
        read = {a: self.layouts[a].read(self._cache(a), src) for a in self.anchors}  # [T, H, D] each
        keys = torch.stack([read[a][0].transpose(0, 1) for a in self.anchors])
        values = torch.stack([read[a][1].transpose(0, 1) for a in self.anchors])
        request_state = runner.requests[plan.req_id]
        frame_tokens = tokens_per_frame(request_state, plan.video.spans)
        held_ids = torch.stack([held[a] for a in self.anchors])  # [A, H, T]
        group, frame_index = bs, None
        if self.config.granularity == "frame":
            labels, group = frame_labels(request_state, plan.video.spans)
            frame_index = labels.to(held_ids.device)[held_ids]
        positions = select_region(
            self.selector, keys, values, held_ids, plan.video.spans, plan.num_keep_video,
            granularity=self.config.granularity, group_size=group, per_head=self.config.per_head,
            frame_tokens=frame_tokens, frame_index=frame_index,
        )  # [A, H, n_keep]
        t1 = time.perf_counter()
        if positions.shape[-1] != plan.num_keep:
            raise AssertionError(f"{plan.req_id}: selection kept {positions.shape[-1]} tokens, plan needs "
                                 f"{plan.num_keep}")
        anchor_row = {a: i for i, a in enumerate(self.anchors)}
        new_held = []
        for layer in range(self.num_layers):
            pos = positions[anchor_row[self.anchor[layer]]]  # [H, n_keep]
            k, v = read[layer] if layer in read else self.layouts[layer].read(self._cache(layer), src)
            head_index = torch.arange(heads)[None, :]
            self.layouts[layer].write(self._cache(layer), dst, k[pos.T, head_index], v[pos.T, head_index])
            new_held.append(torch.gather(held[layer], 1, pos))
        t2 = time.perf_counter()
        self.held[plan.req_id] = new_held

        self.stats.compressions += 1
        self.stats.selection_seconds += t1 - t0
        self.stats.copy_seconds += t2 - t1
        per = self.stats.per_request.setdefault(plan.req_id, {"compressions": 0, "selection_seconds": 0.0})
        per["compressions"] += 1
        per["selection_seconds"] += t1 - t0
        self.sink.add(selection_seconds=t1 - t0)
        at = runner.requests[plan.req_id].num_computed_tokens
        logger.debug("cords-vllm: compressed %s at token %d: region %d blocks, kept %d of %d tokens (%d video), "
                     "selection %.1f ms, copy %.1f ms", plan.req_id, at, plan.region_blocks, plan.num_keep,
                     plan.num_held, plan.num_keep_video, 1e3 * (t1 - t0), 1e3 * (t2 - t1))
        if self.trace:
            tail = torch.arange(plan.region_blocks * bs, at).expand(heads, -1)
            self.events.append(CompressionEvent(
                req_id=plan.req_id, at_token=at, region_blocks=plan.region_blocks,
                kept_logical=[torch.cat([h, tail], dim=1) for h in new_held], selection_seconds=t1 - t0))
