"""What the KV policy needs to know about a model family, in one place (pure: plain values, no vLLM).

A request's candidates are the tokens of its multimodal inputs (each input's placeholder span, found by the
engine); what else the policy reads of the model is here: the vision markers framing every input (evicted
with it, so a live stream's per-clip markers do not pile up as text), the placeholder token ids (what the
stream API counts as candidates in a turn's text), the temporal patch (frames merged into one temporal
position) and how frames are found (Qwen2-VL family: M-RoPE temporal positions). New families add their
facts here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: How a family's frames are found: from M-RoPE temporal positions (one label per temporal patch).
FRAMES_FROM_MROPE = "mrope"


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
        How frames are found (:data:`FRAMES_FROM_MROPE`), or ``None`` when the model gives no way to find them
        (then only ``token`` and ``block`` granularity apply).
    """

    model_type: str = ""
    placeholder_token_ids: Mapping[str, int] = field(default_factory=dict)
    vision_markers: frozenset[int] = frozenset()
    temporal_patch_size: int | None = None
    frames_from: str | None = None

    @property
    def finds_frames(self) -> bool:
        return self.frames_from is not None

    def candidate_token_ids(self, modalities: tuple[str, ...] | list[str]) -> frozenset[int]:
        """Token ids that are candidates in a prompt's text for ``modalities``, markers included."""
        ids = {self.placeholder_token_ids[m] for m in modalities if m in self.placeholder_token_ids}
        return frozenset(ids) | self.vision_markers

    @classmethod
    def from_hf_config(cls, hf_config: Any, uses_mrope: bool) -> ModelFacts:
        """The facts of a model from its HF config (``uses_mrope``: whether the engine gives it M-RoPE
        positions, which is how frames are found)."""
        markers = (getattr(hf_config, "vision_start_token_id", None), getattr(hf_config, "vision_end_token_id", None))
        placeholders = {m: getattr(hf_config, f"{m}_token_id", None) for m in ("image", "video")}
        vision = getattr(hf_config, "vision_config", None)
        patch = getattr(vision, "temporal_patch_size", None)
        return cls(model_type=str(getattr(hf_config, "model_type", "")),
                   placeholder_token_ids={m: i for m, i in placeholders.items() if isinstance(i, int)},
                   vision_markers=frozenset(i for i in markers if isinstance(i, int)),
                   temporal_patch_size=patch if isinstance(patch, int) else None,
                   frames_from=FRAMES_FROM_MROPE if uses_mrope else None)
