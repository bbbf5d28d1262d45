"""Asking the video-QA questions through a vLLM engine (offline ``LLM``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from cords_vllm.lab.vqa.tasks import VQAExample
from cords_vllm.lab.vqa.video import VideoGeometry
from cords_vllm.utils import cdiv

#: Prompt tokens besides the video's (system prompt, question, chat markup), rounded up generously.
_TEXT_TOKENS = 64


def engine_kwargs(checkpoint: str | os.PathLike, geometry: VideoGeometry, *, dtype: str = "float32",
                  kv_cache_memory_bytes: int = 256 << 20, seed: int = 0, inputs: str = "video") -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for serving ``checkpoint`` on videos of ``geometry``.

    Eager mode, and a ``max_model_len`` that fits the video tokens, the text and the one answer token
    (rounded up to a multiple of 256). ``inputs="video"``: one video per prompt; ``"images"``: the frames as
    images (one per frame, each frame its own patch of ``tokens_per_patch`` tokens between two markers).
    """
    need = candidate_tokens(geometry, inputs)
    limit = {"image": 0, "video": 1} if inputs == "video" else {"image": geometry.num_frames, "video": 0}
    return {"model": str(checkpoint), "dtype": dtype, "enforce_eager": True,
            "max_model_len": cdiv(need + _TEXT_TOKENS, 256) * 256, "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "limit_mm_per_prompt": limit, "seed": seed}


def candidate_tokens(geometry: VideoGeometry, inputs: str = "video") -> int:
    """Tokens a request's video occupies when sent as ``inputs``: ``"video"``, its video tokens; ``"images"``,
    one image per frame, each a patch of ``tokens_per_patch`` tokens between two vision markers."""
    if inputs == "video":
        return geometry.num_video_tokens
    if inputs == "images":
        return geometry.num_frames * (geometry.tokens_per_patch + 2)
    raise ValueError(f"inputs must be 'video' or 'images', got {inputs!r}")


def predict_vllm(llm: Any, examples: Sequence[VQAExample], *, chunk: int = 64, fps: float | None = None,
                 **generate_kwargs: Any) -> list[str]:
    """Greedy one-token answers of a ``vllm.LLM`` to ``examples`` (raw prompts, numpy video frames).

    Requests are submitted ``chunk`` at a time: the engine preprocesses every submitted video up front
    (float32 patches, ~10 MB per 64-frame 112x112 video), so one call with thousands of videos would hold
    them all in memory. ``fps``: send each video with its times (Qwen2.5-VL needs them).
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    texts: list[str] = []
    for i in range(0, len(examples), chunk):
        requests = [e.vllm_request(fps=fps) for e in examples[i:i + chunk]]
        outputs = llm.generate(requests, params, use_tqdm=False, **generate_kwargs)
        texts += [o.outputs[0].text for o in outputs]
    return texts
