"""What the policy reads of a vLLM ``Request`` (engine-core process): its candidate spans and its external id."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from cords_vllm.compress.plan import CandidateSpans
from cords_vllm.compress.positions import Grid, next_position
from cords_vllm.config import MODALITIES
from cords_vllm.model_facts import ModelFacts

#: vLLM 0.32 makes a request's internal id ``f"{external_id}-{8 random characters}"``
#: (``InputProcessor.assign_request_id``) unless this variable is set; the engine core keeps only the internal id.
_NO_RANDOM_IDS_ENV = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"
_RANDOM_SUFFIX = 9  # "-" + 8 characters


def external_request_id(internal_id: str) -> str:
    """The id the API server gave a request (the stream API's stream id), from the engine's internal id."""
    if os.environ.get(_NO_RANDOM_IDS_ENV, "0") not in ("", "0"):
        return internal_id
    if len(internal_id) > _RANDOM_SUFFIX and internal_id[-_RANDOM_SUFFIX] == "-":
        return internal_id[:-_RANDOM_SUFFIX]
    return internal_id


def candidate_spans(request: Any, facts: ModelFacts, modalities: Collection[str] = MODALITIES,
                    floor: int = 0) -> CandidateSpans:
    """Logical ranges of a vLLM ``Request``'s candidate tokens from token ``floor`` on: those of its multimodal
    inputs whose modality is in ``modalities`` (from their placeholders), in prompt order. (A re-based stream's
    tokens before ``floor`` are its held region, whose inputs' places no longer mean anything.)

    Images and videos alike: each image is one frame (its own M-RoPE temporal label), so the images of a
    request, e.g. video frames a client sent as ``image_url`` parts, are one stream of frames in time order,
    interleaved with its videos' frames. Text between and around them is protected.

    A vision marker (:attr:`~cords_vllm.model_facts.ModelFacts.vision_markers`) right before or after an input
    belongs to it: it is evicted with the input's tokens, so a live stream's per-clip markers (and the pair
    around every image) do not pile up as text that can never be evicted.
    """
    spans: list[tuple[int, int]] = []
    for feature in getattr(request, "mm_features", None) or ():
        if feature.modality not in modalities:
            continue
        pos = feature.mm_position
        spans.extend((pos.offset + first, pos.offset + first + n) for first, n in _embed_runs(pos))
    markers = facts.vision_markers
    if markers and spans:
        tokens = request.prompt_token_ids or ()
        spans = [(start - (start > 0 and tokens[start - 1] in markers),
                  end + (end < len(tokens) and tokens[end] in markers)) for start, end in spans]
    return CandidateSpans(tuple(sorted((max(start, floor), end) for start, end in spans if end > floor)))



def _embed_runs(position: Any) -> list[tuple[int, int]]:
    """``(first, length)`` of each run of embedded tokens in a placeholder range (one run if it has no mask)."""
    if position.is_embed is None:
        return [(0, position.length)]
    runs: list[tuple[int, int]] = []
    run_start = None
    for i, embed in enumerate([*position.is_embed.tolist(), False]):
        if embed and run_start is None:
            run_start = i
        elif not embed and run_start is not None:
            runs.append((run_start, i - run_start))
            run_start = None
    return runs


def _field(data: Any, key: str) -> Any:
    elem = data.get(key) if data is not None else None
    return None if elem is None else elem.data


def grids_of(features: Any, facts: ModelFacts, start: int = 0) -> list[Grid]:
    """The :class:`~cords_vllm.compress.positions.Grid` of each multimodal input (``features``: vLLM
    ``MultiModalFeatureSpec``), offsets relative to token ``start``; read as vLLM 0.32's Qwen-VL models read
    them (``iter_mm_grid_thw``; Qwen3-VL's ``_iter_mm_grid_hw``).

    An input whose placeholder has an ``is_embed`` mask with several runs (Qwen3-VL: each frame's tokens after
    its timestamp text) is one ``1 x h x w`` grid per run, the text between them counted as text.

    Raises ``ValueError`` for an input whose grid the engine core was not sent (its positions cannot be counted).
    """
    grids = []
    merge = facts.spatial_merge_size
    for feature in features or ():
        thw = _field(feature.data, f"{feature.modality}_grid_thw")
        if thw is None:
            raise ValueError(f"a {feature.modality} input reached the engine core without its grid: its positions "
                             "cannot be counted")
        t, h, w = (int(x) for x in thw.tolist())
        runs = _embed_runs(feature.mm_position)
        if len(runs) > 1:
            per_run = h * w // merge**2
            if len(runs) != t or any(n != per_run for _, n in runs):
                raise ValueError(f"a {feature.modality} input's {len(runs)} placeholder runs do not match its "
                                 f"{t} x {per_run}-token grid: its positions cannot be counted")
            offset = feature.mm_position.offset - start
            grids.extend(Grid(offset + first, 1, h // merge, w // merge) for first, _ in runs)
            continue
        factor = 1.0
        if feature.modality == "video":
            per_grid = _field(feature.data, "second_per_grid_ts")
            factor = (float(per_grid.item()) if per_grid is not None else 1.0) * (facts.tokens_per_second or 1.0)
        grids.append(Grid(feature.mm_position.offset - start, t, h // merge, w // merge, factor))
    return grids


def positions_after(num_tokens: int, features: Any, facts: ModelFacts, start: int = 0, start_position: int = 0) -> int:
    """The first rotary position after a segment of ``num_tokens`` tokens from token ``start`` of a request on,
    whose first token takes ``start_position``; ``features`` are the segment's multimodal inputs.

    M-RoPE (:attr:`~cords_vllm.model_facts.ModelFacts.explicit_positions`): a grid takes its extent
    (:func:`~cords_vllm.compress.positions.next_position`); 1-D rotary positions: every token takes one, video
    tokens included. Raises ``ValueError`` when an M-RoPE input's grid is missing (:func:`grids_of`).
    """
    if not facts.explicit_positions:
        return start_position + num_tokens
    return next_position(num_tokens, grids_of(features, facts, start), start=start_position)
