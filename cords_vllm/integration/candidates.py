"""A request's candidate tokens (those of its videos and images that may be evicted), read the same way in every
process: the engine core plans with them and the workers pick the observation rows of attention-scored policies
with them. Works on a vLLM ``Request`` (engine core) and on a model runner's ``CachedRequestState`` (worker) alike:
both carry ``mm_features`` and ``prompt_token_ids``."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from cords_vllm.compress.plan import CandidateSpans
from cords_vllm.config import MODALITIES
from cords_vllm.model_facts import ModelFacts


def candidate_spans(request: Any, facts: ModelFacts, modalities: Collection[str] = MODALITIES,
                    floor: int = 0) -> CandidateSpans:
    """Logical ranges of a request's candidate tokens from token ``floor`` on: those of its multimodal inputs whose
    modality is in ``modalities`` (from their placeholders), in prompt order. (A re-based stream's tokens before
    ``floor`` are its held region, whose inputs' places no longer mean anything.)

    Images and videos alike: each image is one frame (its own M-RoPE temporal label), so the images of a
    request, e.g. video frames a client sent as ``image_url`` parts, are one stream of frames in time order,
    interleaved with its videos' frames. Text between and around them is protected, and so is text inside a
    placeholder that is not embedded (Qwen3-VL's timestamps between frames, :func:`embed_runs`).

    A vision marker (:attr:`~cords_vllm.model_facts.ModelFacts.vision_markers`) right before or after an input
    belongs to it: it is evicted with the input's tokens, so a live stream's per-clip markers (and the pair
    around every image) do not pile up as text that can never be evicted.
    """
    spans: list[tuple[int, int]] = []
    for feature in getattr(request, "mm_features", None) or ():
        if feature.modality not in modalities:
            continue
        pos = feature.mm_position
        spans.extend((pos.offset + first, pos.offset + first + n) for first, n in embed_runs(pos))
    markers = facts.vision_markers
    if markers and spans:
        tokens = request.prompt_token_ids or ()
        spans = [(start - (start > 0 and tokens[start - 1] in markers),
                  end + (end < len(tokens) and tokens[end] in markers)) for start, end in spans]
    return CandidateSpans(tuple(sorted((max(start, floor), end) for start, end in spans if end > floor)))


def embed_runs(position: Any) -> list[tuple[int, int]]:
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
