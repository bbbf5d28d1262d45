"""How many tokens one stream turn takes in the engine, counted in the API server before it is sent.

A push whose turn alone is longer than ``--max-model-len`` is refused with a 413 (the stream unchanged) instead
of reaching the engine, which would end the stream. The count must be the engine's: the turn's prompt with its
one video placeholder replaced by what the model's processor writes for the clip:

* Qwen2-VL and Qwen2.5-VL: the clip's video tokens (``get_num_video_tokens`` of the model's processing info,
  ``--mm-processor-kwargs`` applied);
* Qwen3-VL: for every temporal patch its timestamp as text (``<12.5 seconds>``, times since the stream opened)
  and its own vision start and end markers around its video tokens, built with vLLM's own
  ``get_video_repl`` and frame times (``_get_video_second_idx``), so the text counted is the text written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cords_vllm.integration.api_server.streams.push_bounds import VideoTokens
from cords_vllm.model_facts import ModelFacts

logger = logging.getLogger(__name__)

#: ``(prompt text, clip [T, H, W, 3] or None, clip metadata or None) -> (tokens, video tokens)``.
TurnCounter = Callable[[str, Any, "dict[str, Any] | None"], tuple[int, int]]


@dataclass(frozen=True)
class VideoProcessing:
    """The served model's multimodal processor, created once in the API server, and ``tokens``: ``(width, height,
    frames) -> video tokens`` of one clip (its processing info's ``get_num_video_tokens``, ``--mm-processor-kwargs``
    applied, which applies the processor's resize and raises ``ValueError`` for a frame shape it refuses)."""

    processor: Any
    tokens: VideoTokens


def video_processing(vllm_config: Any) -> VideoProcessing | None:
    """The served model's :class:`VideoProcessing`, or ``None`` for a model without a video token count (the
    engine then checks each push itself, and ends the stream on a refusal)."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    try:
        processor = MULTIMODAL_REGISTRY.create_processor(vllm_config.model_config)
        count_video, image_processor = processor.info.get_num_video_tokens, processor.info.get_image_processor()
    except Exception as exc:  # a model without a video token count
        logger.warning("cords-vllm: cannot count a clip's video tokens (%s: %s): a push whose frames the processor "
                       "refuses, or too long for the engine, ends its stream instead of being refused",
                       type(exc).__name__, exc)
        return None

    def tokens(width: int, height: int, frames: int) -> int:
        return int(count_video(image_width=width, image_height=height, num_frames=frames,
                               image_processor=image_processor, mm_kwargs={}))
    return VideoProcessing(processor, tokens)


def turn_counter(encode: Callable[[str], list[int]] | None, facts: ModelFacts, video: VideoProcessing | None,
                 tokenizer: Any = None) -> TurnCounter | None:
    """The turn counter of the served model (``video``: its :func:`video_processing`), or ``None`` when it cannot
    count (the engine then checks each turn's length itself, and ends the stream)."""
    placeholder = facts.placeholder_token_ids.get("video")
    if placeholder is None or video is None:
        return None
    if encode is None:
        logger.warning("cords-vllm: no tokenizer: a push longer than --max-model-len ends its stream instead of "
                       "being refused")
        return None
    frame_text = _frame_text_counter(video.processor, video.processor.info, tokenizer)

    def turn_tokens(prompt: str, clip: Any, metadata: dict[str, Any] | None = None) -> tuple[int, int]:
        ids = encode(prompt)
        if clip is None:
            return len(ids), 0
        count = video.tokens(int(clip.shape[2]), int(clip.shape[1]), int(clip.shape[0]))
        text = frame_text(metadata) if frame_text is not None and metadata is not None else 0
        return len(ids) - ids.count(placeholder) + count + text, count
    return turn_tokens


def engine_clip_tokens(engine_client: Any, max_model_len: int) -> int | None:
    """The most video tokens one clip may hold in the engine: vLLM's encoder cache size (what its input processor
    checks every multimodal item against; the encoder's per-step compute budget is the same number under vLLM's
    defaults), and at most ``max_model_len``. ``None`` when the engine client does not say."""
    size = getattr(getattr(engine_client, "input_processor", None), "mm_encoder_cache_size", None)
    if not isinstance(size, int) or size <= 0:
        return None
    return min(size, max_model_len)


def _frame_text_counter(processor: Any, info: Any, tokenizer: Any) -> Callable[[dict[str, Any]], int] | None:
    """``clip metadata -> text tokens written between a clip's frames`` for a model that writes each frame's time
    as text (Qwen3-VL: its processor has ``get_video_repl``); ``None`` for one that writes none."""
    build = getattr(type(processor), "get_video_repl", None)
    if build is None:
        return None
    times = getattr(info, "_get_video_second_idx", None)
    if times is None or tokenizer is None:
        logger.warning("cords-vllm: this model writes each frame's time as text, which this vLLM gives no way to "
                       "count here: a push a few tokens over --max-model-len ends its stream instead of being "
                       "refused")
        return None

    def frame_text(metadata: dict[str, Any]) -> int:
        timestamps = times(metadata)
        written = build(tokens_per_frame=[0] * len(timestamps), timestamps=timestamps, tokenizer=tokenizer,
                        vision_start_token_id=0, vision_end_token_id=0, video_token_id=0, select_token_id=False)
        return len(written.full)
    return frame_text
