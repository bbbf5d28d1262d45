"""What the KV policy needs to know about a model family, in one place (pure: plain values, no vLLM).

A request's candidates are the tokens of its multimodal inputs (each input's placeholder span, found by the
engine); what else the policy reads of the model is here: the vision markers framing every input (evicted
with it, so a live stream's per-clip markers do not pile up as text), the placeholder token ids (what the
stream API counts as candidates in a turn's text), the temporal patch (frames merged into one temporal
position) and how frames are found (Qwen-VL families: M-RoPE temporal positions; LLaVA-NeXT-Video: the
placeholder's layout, a fixed count of contiguous tokens per frame). New families add their facts here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cords_vllm.conversation.transcript import Markup, markup_for

#: How a family's frames are found: from M-RoPE temporal positions (one label per temporal patch).
FRAMES_FROM_MROPE = "mrope"
#: ... or from the placeholder's layout: an input is its frames one after another, each ``tokens_per_frame``
#: contiguous tokens with no separators (LLaVA-NeXT-Video), so a token's frame is its offset in the input
#: divided by ``tokens_per_frame`` (1-D rotary positions).
FRAMES_FROM_LAYOUT = "layout"


def layout_tokens_per_frame(hf_config: Any) -> int | None:
    """Tokens of one frame of a family whose video placeholder is laid out frame after frame, or ``None``.

    LLaVA-NeXT-Video (``llava_next_video``): each frame's patch grid (``image_size / patch_size`` on a side, the
    CLS token dropped) is pooled by ``spatial_pool_stride`` into ``ceil(grid / stride) ** 2`` tokens, as vLLM 0.32
    counts them (``LlavaNextVideoProcessingInfo._get_num_frame_tokens``), and a video of ``F`` frames is
    ``F`` such runs with nothing between them.
    """
    if getattr(hf_config, "model_type", None) != "llava_next_video":
        return None
    vision = getattr(hf_config, "vision_config", None)
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    stride = getattr(hf_config, "spatial_pool_stride", None)
    if not all(isinstance(v, int) and v > 0 for v in (size, patch, stride)):
        return None
    side = -(-(size // patch) // stride)
    return side * side


@dataclass(frozen=True)
class ModelFacts:
    """The model facts the policy reads.

    Attributes
    ----------
    model_type:
        The HF ``model_type`` (``"qwen2_vl"``).
    placeholder_token_ids:
        vLLM modality -> the token id its inputs are expanded into (``<|image_pad|>``, ``<|video_pad|>``).
    vision_markers:
        Tokens right before or after an input that belong to it (``<|vision_start|>``, ``<|vision_end|>``).
    temporal_patch_size:
        Frames merged into one temporal position by the vision encoder (2 for Qwen2-VL); ``None``: unknown.
    frames_from:
        How frames are found (:data:`FRAMES_FROM_MROPE`, :data:`FRAMES_FROM_LAYOUT`), or ``None`` when the model
        gives no way to find them (then only ``token`` and ``block`` granularity apply).
    tokens_per_frame:
        :data:`FRAMES_FROM_LAYOUT` only: the tokens of one frame (25 for the tiny LLaVA-NeXT-Video, 144 for
        LLaVA-NeXT-Video-7B at 336 pixels); ``None`` otherwise.
    spatial_merge_size:
        Patches merged into one language-model token along each spatial axis (2 for the Qwen-VL families).
    tokens_per_second:
        Temporal positions per second of video (Qwen2.5-VL); ``None``: one position per temporal patch.
    max_positions:
        The model's rotary range (``max_position_embeddings``): every position must stay below it;
        ``None``: unknown.
    hybrid:
        Whether some layers keep a fixed-size recurrent state instead of per-token KV (Qwen3.5's Gated DeltaNet
        layers): only the attention layers' KV is compressed, and a stream's request is not re-based (the state
        layers' cache rows follow the request's token count).
    """

    model_type: str = ""
    placeholder_token_ids: Mapping[str, int] = field(default_factory=dict)
    vision_markers: frozenset[int] = frozenset()
    temporal_patch_size: int | None = None
    frames_from: str | None = None
    spatial_merge_size: int = 1
    tokens_per_second: float | None = None
    max_positions: int | None = None
    tokens_per_frame: int | None = None
    hybrid: bool = False

    @property
    def explicit_positions(self) -> bool:
        """Whether every token's rotary position is computed from the prompt's layout (M-RoPE), not its index in
        the request (1-D rotary: position = index, so a re-based request's new tokens take an offset, the tokens
        it lost; see :mod:`cords_vllm.integration.worker.positions`)."""
        return self.frames_from == FRAMES_FROM_MROPE

    @property
    def rebases_streams(self) -> bool:
        """Whether a stream's evicted tokens can leave its request: every layer keeps per-token KV (not a
        hybrid, whose state layers' cache rows follow the request's token count). The tokens after a removed
        range keep their positions: explicitly with M-RoPE, through the worker's position offset with 1-D
        rotary positions."""
        return not self.hybrid

    @property
    def chat_markup(self) -> Markup | None:
        """The chat markup a stream's turns are written in (``None``: the stream API knows none for this model)."""
        if "video" not in self.placeholder_token_ids:
            return None
        return markup_for(self.model_type, bool(self.vision_markers))

    @property
    def frames_per_patch(self) -> int:
        """Frames a live stream's clip holds whole multiples of (an odd frame waits for the next push): the vision
        encoder's temporal patch (:attr:`temporal_patch_size`, 2 for the Qwen-VL families), 2 where the model names
        none."""
        return self.temporal_patch_size or 2

    @property
    def streams_unsupported(self) -> str | None:
        """Why the stream API cannot serve this model (``None``: it can). A stream's turns are written in the
        family's chat markup (:attr:`chat_markup`): the Qwen-VL families' ChatML or LLaVA-NeXT-Video's."""
        if self.chat_markup is None:
            return (f"live streams write a known family's chat markup (Qwen-VL ChatML with <|vision_start|>"
                    f"<|video_pad|><|vision_end|> per clip, or LLaVA-NeXT-Video's USER: <video> ... ASSISTANT:), and "
                    f"this model ({self.model_type or 'unknown type'}) has none of them or no video placeholder; send "
                    "its videos through /v1/chat/completions")
        return None

    @property
    def finds_frames(self) -> bool:
        if self.frames_from == FRAMES_FROM_LAYOUT:
            return self.tokens_per_frame is not None and self.tokens_per_frame > 0
        return self.frames_from is not None

    def candidate_token_ids(self, modalities: tuple[str, ...] | list[str]) -> frozenset[int]:
        """Token ids that are candidates in a prompt's text for ``modalities``, markers included."""
        ids = {self.placeholder_token_ids[m] for m in modalities if m in self.placeholder_token_ids}
        return frozenset(ids) | self.vision_markers

    @classmethod
    def from_hf_config(cls, hf_config: Any, uses_mrope: bool, hybrid: bool = False) -> ModelFacts:
        """The facts of a model from its HF config (``uses_mrope``: whether the engine gives it M-RoPE
        positions, which is how frames are found; ``hybrid``: whether some layers keep recurrent state)."""
        markers = (getattr(hf_config, "vision_start_token_id", None), getattr(hf_config, "vision_end_token_id", None))
        placeholders = {m: getattr(hf_config, f"{m}_token_id", None) for m in ("image", "video")}
        vision = getattr(hf_config, "vision_config", None)
        patch = getattr(vision, "temporal_patch_size", None)
        merge = getattr(vision, "spatial_merge_size", 1)
        per_second = getattr(vision, "tokens_per_second", None)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        max_positions = getattr(text, "max_position_embeddings", None)
        per_frame = None if uses_mrope else layout_tokens_per_frame(hf_config)
        frames_from = FRAMES_FROM_MROPE if uses_mrope else FRAMES_FROM_LAYOUT if per_frame else None
        return cls(model_type=str(getattr(hf_config, "model_type", "")),
                   placeholder_token_ids={m: i for m, i in placeholders.items() if isinstance(i, int)},
                   vision_markers=frozenset(i for i in markers if isinstance(i, int)),
                   temporal_patch_size=patch if isinstance(patch, int) else None,
                   frames_from=frames_from, tokens_per_frame=per_frame,
                   spatial_merge_size=merge if isinstance(merge, int) else 1,
                   tokens_per_second=float(per_second) if isinstance(per_second, int | float) else None,
                   max_positions=max_positions if isinstance(max_positions, int) else None, hybrid=hybrid)
