"""Worker side: keep the queries an attention-scored policy observes (SnapKV's window, StreamMem's proxy).

The paged cache holds keys and values only; a query lives for one forward. An attention-scored policy
(``Selector.needs_observation``) scores the held tokens by the attention of some tokens' queries, so the worker
keeps those queries as the engine computes them: per request and anchor layer, ``window`` rows of every query head,
rotary applied, exactly as the attention kernel read them.

Which rows (``Selector.observation_source``):

* ``"newest_candidates"``: the newest ``window`` video tokens computed so far (a ring: each step's newest video
  tokens replace the oldest rows), each with its token id, so a row sees only the tokens up to its own;
* ``"prompt_before_candidates"``: the ``window`` tokens right before the request's first video (the chat
  template's system and user-turn tokens), kept for the request's life; they see every held token;
* ``"prompt_at_newest"``: the same rows, handed to the compress step moved as one block to start right after the
  request's newest token (:meth:`QueryCapture.observed`, with the anchor layer's own rotary embedding).

How: every anchor layer's attention implementation gets an instance-level wrapper of its ``forward``, which vLLM
calls with the step's queries (``unified_attention_with_output`` calls ``layer.impl.forward(layer, query, ...)``;
the call is a custom op, opaque to ``torch.compile``, and runs eagerly in piecewise CUDA graphs, where prefill
runs; the wrapper checks the method's parameters when it is installed, so another signature stops the worker at
start-up). After ``_prepare_inputs`` the worker computes the step's rows to keep on the host, uploads their indices
once, and the wrapper then copies them with one ``index_copy_`` per anchor layer; a step without such rows (decode)
costs one attribute check per anchor layer. Nothing is recorded while a CUDA graph is being captured.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cords_vllm.compress.region import ObservedQueries
from cords_vllm.compress.transfer import upload
from cords_vllm.integration.candidates import candidate_spans
from cords_vllm.model_facts import ModelFacts
from cords_vllm.selection.base import Selector

NEWEST = "newest_candidates"
PROXY = "prompt_before_candidates"
AT_NEWEST = "prompt_at_newest"


@dataclass
class _Rows:
    """One request's rows: its slot in the store, how many of its rows were written, and its candidate spans with the
    inputs they were read from (:func:`_inputs_key`)."""

    slot: int
    written: int = 0
    spans: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    inputs: tuple[int, int] = (0, -1)


def _inputs_key(state: Any) -> tuple[int, int]:
    """How many multimodal inputs a worker request has and where its last one starts: changes when a session's turn
    brings (or re-basing replaces) inputs, not from one step to the next."""
    features = getattr(state, "mm_features", None) or ()
    return len(features), features[-1].mm_position.offset if features else -1


def newest_in(spans: Sequence[tuple[int, int]], start: int, end: int, count: int) -> list[int]:
    """The last ``count`` logical positions of ``[start, end)`` that lie in ``spans``, oldest first."""
    out: list[int] = []
    for a, b in reversed(spans):
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            out[:0] = range(max(lo, hi - (count - len(out))), hi)
            if len(out) >= count:
                break
    return out


class QueryCapture:
    """The observation queries of every request in one model runner, on its anchor layers.

    Parameters
    ----------
    selector:
        The policy (``needs_observation``); its ``window`` is the rows kept per request and anchor.
    modules:
        The anchor layers' vLLM ``Attention`` modules, in the compress step's anchor order.
    max_requests:
        Requests the runner holds at once (``max_num_seqs``): the store's slots.
    modalities, facts:
        Modalities whose tokens are candidates, and the model's facts: a request's candidates are those the
        scheduler plans with (:func:`~cords_vllm.integration.candidates.candidate_spans`, vision markers included).
    removed_tokens:
        ``req_id -> tokens re-basing removed before it`` (the offset of the ids the compress step uses).
    rotaries:
        ``"prompt_at_newest"`` only: the anchor layers' vLLM rotary embeddings (``cos_sin_cache``, ``rotary_dim``,
        ``head_size``, ``is_neox_style``), in anchor order.
    """

    def __init__(self, selector: Selector, modules: Sequence[Any], max_requests: int, modalities: Sequence[str],
                 facts: ModelFacts, dtype: torch.dtype, device: torch.device, removed_tokens: Callable[[str], int],
                 rotaries: Sequence[Any] | None = None) -> None:
        if selector.observation_source not in (NEWEST, PROXY, AT_NEWEST):
            raise ValueError(f"{selector.name}: unknown observation source {selector.observation_source!r}")
        self.source = selector.observation_source
        self.window = int(selector.window)
        self.modalities = tuple(modalities)
        self.facts = facts
        self.removed_tokens = removed_tokens
        if self.source == AT_NEWEST and (rotaries is None or len(rotaries) != len(modules)):
            raise ValueError(f"{selector.name}: moving its rows after the newest token needs each anchor layer's "
                             "rotary embedding")
        self.rotaries = rotaries
        #: Whether :meth:`observed` moves the rows (and so reads its ``next_position``).
        self.moves_rows = self.source == AT_NEWEST
        heads, size = modules[0].num_heads, modules[0].head_size
        slots = max_requests * self.window
        #: ``[A, slots * window, Hq, D]`` queries and ``long [slots * window]`` token ids (-1: none yet).
        self.store = torch.zeros((len(modules), slots, heads, size), dtype=dtype, device=device)
        self.ids = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.device = device
        self.rows: dict[str, _Rows] = {}
        self._free = list(range(max_requests - 1, -1, -1))
        #: This step's ``(source rows of the flat query, destination rows of the store)``, or ``None``.
        self.step: tuple[torch.Tensor, torch.Tensor] | None = None
        for index, module in enumerate(modules):
            if getattr(module, "query_quant", None) is not None:
                raise ValueError(f"--kv-policy {selector.name} scores tokens by the model's queries, which this "
                                 "attention backend quantises with the fp8 KV cache: use another --kv-cache-dtype "
                                 "or a policy that reads keys and values only")
            self._wrap(module.impl, index)

    def _wrap(self, impl: Any, anchor: int) -> None:
        original = impl.forward
        params = list(inspect.signature(original).parameters)
        if params[:2] != ["layer", "query"]:
            raise RuntimeError(f"{type(impl).__qualname__}.forward{inspect.signature(original)}: an attention-scored "
                               "policy needs vLLM 0.32's forward(layer, query, key, value, kv_cache, attn_metadata, "
                               "...) to keep the queries it observes")

        def forward(layer: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.step is not None and not _capturing_graph(query):
                src, dst = self.step
                self.store[anchor].index_copy_(0, dst, query.reshape(query.shape[0], *self.store.shape[2:])[src]
                                               .to(self.store.dtype))
            return original(layer, query, *args, **kwargs)

        impl.forward = forward

    # ------------------------------------------------------------------------------------------------
    def prepare(self, runner: Any, num_scheduled_tokens: np.ndarray) -> None:
        """Decide which of this step's query rows to keep (host data), and upload their indices once."""
        batch, starts = runner.input_batch, runner.query_start_loc.np
        src: list[int] = []
        dst: list[int] = []
        ids: list[int] = []
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
            n = int(num_scheduled_tokens[i])
            computed = int(batch.num_computed_tokens_cpu[i])
            state = runner.requests.get(req_id)
            if n == 0 or state is None:
                continue
            rows = self.rows.get(req_id)
            inputs = _inputs_key(state)
            if rows is None:
                spans = candidate_spans(state, self.facts, self.modalities).spans
                if not spans or not self._free:
                    continue
                rows = self.rows[req_id] = _Rows(self._free.pop(), spans=spans, inputs=inputs)
            elif inputs != rows.inputs:  # a session's turn brought inputs: read the spans again, once
                rows.spans, rows.inputs = candidate_spans(state, self.facts, self.modalities).spans, inputs
            removed = self.removed_tokens(req_id)
            for pos, row in self._positions(rows, computed, computed + n):
                src.append(int(starts[i]) + pos - computed)
                dst.append(rows.slot * self.window + row)
                ids.append(removed + pos)
        if not src:
            self.step = None
            return
        src_d, dst_d, ids_d = upload([np.asarray(src), np.asarray(dst), np.asarray(ids)], self.device)
        self.ids.index_copy_(0, dst_d, ids_d)
        self.step = (src_d, dst_d)

    def _positions(self, rows: _Rows, start: int, end: int) -> list[tuple[int, int]]:
        """``(logical position, row)`` of the tokens of ``[start, end)`` this request keeps."""
        if self.source == NEWEST:
            newest = newest_in(rows.spans, start, end, self.window)
            first = rows.written
            rows.written += len(newest)
            return [(pos, (first + j) % self.window) for j, pos in enumerate(newest)]
        first_video = rows.spans[0][0]  # PROXY and AT_NEWEST: the text right before the first video
        lo = max(first_video - self.window, 0, start)
        hi = min(first_video, end)
        return [(pos, pos - (first_video - self.window)) for pos in range(lo, hi)]

    def observed(self, req_id: str, next_position: int = 0) -> ObservedQueries:
        """The request's rows for the compress step: ``[A, Hq, window, D]`` and their ids (``-1``: none yet).

        ``next_position``: the rotary position right after the request's newest token, where ``"prompt_at_newest"``
        rows are moved as one block: each is rotated by ``next_position - p0`` more on every section, ``p0`` the
        position of the first row, as if the text were appended there (relative positions among the rows kept).
        """
        rows = self.rows.get(req_id)
        if rows is None:
            raise RuntimeError(f"request {req_id}: no observation queries were kept (it has no video input, or more "
                               "requests ran at once than max_num_seqs)")
        part = slice(rows.slot * self.window, (rows.slot + 1) * self.window)
        queries, ids = self.store[:, part], self.ids[part]  # [A, W, Hq, D], [W]
        if self.source == AT_NEWEST:
            # the rows hold the text before the first video, captured before any re-base (an id is a position): move
            # them as one block, the first kept row to the position right after the newest token
            first = torch.where(ids >= 0, ids, torch.iinfo(torch.long).max).min()
            queries = self._moved(queries, (next_position - first).clamp_min(0).expand(ids.shape[0]))
        return ObservedQueries(queries.transpose(1, 2), ids, causal=self.source == NEWEST)

    def _moved(self, queries: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``queries`` ``[A, W, Hq, D]`` rotated ``delta`` (``long [W]``) positions further, in float32, by each
        anchor's own rotary embedding (vLLM's native rotation: R(p + delta) = R(delta) R(p))."""
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        out = []
        for anchor, rope in enumerate(self.rotaries or ()):
            q = queries[anchor].float()
            moved, _ = RotaryEmbedding.forward_static(delta, q.reshape(q.shape[0], -1), None, rope.head_size,
                                                      rope.rotary_dim, rope.cos_sin_cache.float(), rope.is_neox_style)
            out.append(moved.reshape(q.shape))
        return torch.stack(out)

    def release(self, req_id: str) -> None:
        """The request left (or recomputes from scratch): free its slot."""
        rows = self.rows.pop(req_id, None)
        if rows is not None:
            self.ids[rows.slot * self.window:(rows.slot + 1) * self.window] = -1
            self._free.append(rows.slot)


def _capturing_graph(query: torch.Tensor) -> bool:
    return query.is_cuda and torch.cuda.is_current_stream_capturing()
