"""What the policy reads of a vLLM ``Request`` (engine-core process): its inputs' grids, the positions after it and its
external id (its candidate spans: :mod:`cords_vllm.integration.candidates`)."""

from __future__ import annotations

import os
from typing import Any

from cords_vllm.compress.positions import Grid, next_position
from cords_vllm.integration.candidates import embed_runs
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
        runs = embed_runs(feature.mm_position)
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
