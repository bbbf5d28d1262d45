"""Asking the video-QA questions through a vLLM engine (offline ``LLM``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from cords_vllm.utils import cdiv
from cords_vllm.vqa.tasks import VQAExample
from cords_vllm.vqa.video import VideoGeometry

#: Prompt tokens besides the video's (system prompt, question, chat markup), rounded up generously.
_TEXT_TOKENS = 64


def engine_kwargs(checkpoint: str | os.PathLike, geometry: VideoGeometry, *, dtype: str = "float32",
                  kv_cache_memory_bytes: int = 256 << 20, seed: int = 0) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for serving ``checkpoint`` on videos of ``geometry``.

    Eager mode, one video per prompt, and a ``max_model_len`` that fits the video tokens, the text and the
    one answer token (rounded up to a multiple of 256).
    """
    need = geometry.num_video_tokens + _TEXT_TOKENS
    return {"model": str(checkpoint), "dtype": dtype, "enforce_eager": True,
            "max_model_len": cdiv(need, 256) * 256, "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "limit_mm_per_prompt": {"image": 0, "video": 1}, "seed": seed}


def predict_vllm(llm: Any, examples: Sequence[VQAExample], *, chunk: int = 64,
                 **generate_kwargs: Any) -> list[str]:
    """Greedy one-token answers of a ``vllm.LLM`` to ``examples`` (raw prompts, numpy video frames).

    Requests are submitted ``chunk`` at a time: the engine preprocesses every submitted video up front
    (float32 patches, ~10 MB per 64-frame 112x112 video), so one call with thousands of videos would hold
    them all in memory.
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    texts: list[str] = []
    for i in range(0, len(examples), chunk):
        requests = [e.vllm_request() for e in examples[i:i + chunk]]
        outputs = llm.generate(requests, params, use_tqdm=False, **generate_kwargs)
        texts += [o.outputs[0].text for o in outputs]
    return texts
