"""What the policy reads of a vLLM ``Request`` (engine-core process): its candidate spans and its external id."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from cords_vllm.compress.plan import CandidateSpans
from cords_vllm.compress.positions import Grid
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
    markers = facts.vision_markers
    if markers and spans:
        tokens = request.prompt_token_ids or ()
        spans = [(start - (start > 0 and tokens[start - 1] in markers),
                  end + (end < len(tokens) and tokens[end] in markers)) for start, end in spans]
    return CandidateSpans(tuple(sorted((max(start, floor), end) for start, end in spans if end > floor)))



def _field(data: Any, key: str) -> Any:
    elem = data.get(key) if data is not None else None
    return None if elem is None else elem.data


def grids_of(features: Any, facts: ModelFacts, start: int = 0) -> list[Grid]:
    """The :class:`~cords_vllm.compress.positions.Grid` of each multimodal input (``features``: vLLM
    ``MultiModalFeatureSpec``), offsets relative to token ``start``; read as vLLM 0.32's Qwen-VL models read
    them (``iter_mm_grid_thw``).

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
        factor = 1.0
        if feature.modality == "video":
            per_grid = _field(feature.data, "second_per_grid_ts")
            factor = (float(per_grid.item()) if per_grid is not None else 1.0) * (facts.tokens_per_second or 1.0)
        grids.append(Grid(feature.mm_position.offset - start, t, h // merge, w // merge, factor))
    return grids
