"""The Qwen-VL architectures a tiny checkpoint can have: each family's config, processor and model class.

:func:`~cords_vllm.lab.synthetic.tiny_model.build_tiny_model` builds the text config every family shares (from
:class:`~cords_vllm.lab.synthetic.tiny_model.TinyModelSpec`) and asks the family here for the rest: its rotary
layout, its vision tower and the processor that turns frames into its placeholder tokens. The geometry follows
each family's released checkpoints, scaled down (Qwen2-VL and Qwen2.5-VL: 14-pixel patches, Qwen3-VL: 16-pixel
patches with the image mean/std 0.5 its vLLM model normalises with; M-RoPE sections in the released proportions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's M-RoPE split (t, h, w) of the ``head_dim / 2`` rotary frequencies.

    Qwen2-VL-7B and Qwen2.5-VL-7B use ``[16, 24, 24]`` for ``head_dim = 128``; the same 2:3:3 proportions here.
    """
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def interleaved_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's interleaved M-RoPE split: ``[24, 20, 20]`` for ``head_dim = 128``, scaled to ``head_dim``."""
    half = head_dim // 2
    h = half * 20 // 64
    return [half - 2 * h, h, h]


@dataclass(frozen=True)
class Family:
    """How to build one architecture.

    ``config(spec, text, tokens)`` returns the HF config from the shared text config fields and the special token
    ids; ``processor(spec, tokenizer, chat_template)`` the HF processor; ``model`` names the HF model class.
    """

    config: Callable[[Any, dict[str, Any], Mapping[str, int]], Any]
    processor: Callable[[Any, Any, str], Any]
    model: str

    def model_class(self) -> type:
        """The HF model class (imported on use)."""
        import transformers

        return getattr(transformers, self.model)


def _qwen2_pixels(spec: Any) -> dict[str, int]:
    return {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2}


def _qwen2_vl_config(spec: Any, text: dict[str, Any], tokens: Mapping[str, int]) -> Any:
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section(spec.head_dim)}
    return Qwen2VLConfig(
        text_config={**text, "rope_parameters": rope},
        vision_config={"depth": spec.vision_depth, "embed_dim": spec.vision_embed_dim, "hidden_size": spec.hidden_size,
                       "num_heads": spec.vision_heads, "mlp_ratio": 2, "in_channels": 3, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "quick_gelu"},
        tie_word_embeddings=False, **tokens)


def _qwen2_processor(name: str) -> Callable[[Any, Any, str], Any]:
    """The builder of a Qwen2-VL-style processor (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``): Qwen2-VL's image
    and video processors at 14-pixel patches."""

    def build(spec: Any, tokenizer: Any, chat_template: str) -> Any:
        import transformers
        from transformers import Qwen2VLImageProcessor
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        pixels = _qwen2_pixels(spec)
        return getattr(transformers, name)(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                                           video_processor=Qwen2VLVideoProcessor(**pixels),
                                           chat_template=chat_template)
    return build


def _qwen2_5_vl_config(spec: Any, text: dict[str, Any], tokens: Mapping[str, int]) -> Any:
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope_section(spec.head_dim)}
    # Window attention on every layer but the last (Qwen2.5-VL's fullatt_block_indexes), two positions per second.
    return Qwen2_5_VLConfig(
        text_config={**text, "rope_parameters": rope},
        vision_config={"depth": spec.vision_depth, "hidden_size": spec.vision_embed_dim,
                       "intermediate_size": 2 * spec.vision_embed_dim, "num_heads": spec.vision_heads,
                       "out_hidden_size": spec.hidden_size, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [spec.vision_depth - 1], "tokens_per_second": 2,
                       "hidden_act": "silu"},
        tie_word_embeddings=False, **tokens)


def _qwen3_vision(spec: Any) -> dict[str, Any]:
    """The vision tower of the Qwen3 families (Qwen3-VL, Qwen3.5): 16-pixel patches, learnt position embeddings."""
    return {"depth": spec.vision_depth, "hidden_size": spec.vision_embed_dim,
            "intermediate_size": 2 * spec.vision_embed_dim, "num_heads": spec.vision_heads, "in_channels": 3,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "out_hidden_size": spec.hidden_size, "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh"}


def _qwen3_vl_config(spec: Any, text: dict[str, Any], tokens: Mapping[str, int]) -> Any:
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": interleaved_mrope_section(spec.head_dim),
            "mrope_interleaved": True}
    # Deepstack: every vision block's merged features are added to the first decoder layers' hidden states.
    return Qwen3VLConfig(
        text_config={**text, "head_dim": spec.head_dim, "rope_parameters": rope},
        vision_config={**_qwen3_vision(spec),
                       "deepstack_visual_indexes": list(range(min(spec.vision_depth, spec.num_layers)))},
        tie_word_embeddings=False, **tokens)


def _qwen3_vl_processor(spec: Any, tokenizer: Any, chat_template: str) -> Any:
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # mean/std 0.5 as in the released checkpoints: vLLM normalises in the model with the image processor's values,
    # videos included. Sizes are pixel counts (Qwen3-VL's ``shortest_edge`` / ``longest_edge``).
    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    grid = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2}
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**grid, **norm, size={"shortest_edge": spec.min_pixels,
                                                                    "longest_edge": spec.max_pixels}),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**grid, **norm, size={"shortest_edge": spec.min_pixels,
                                                                    "longest_edge": spec.max_pixels * 64}),
        chat_template=chat_template)


def _qwen3_5_config(spec: Any, text: dict[str, Any], tokens: Mapping[str, int]) -> Any:
    from transformers import Qwen3_5Config

    # Hybrid: three Gated DeltaNet (linear attention) layers to one full-attention layer, as released; a partial
    # rotary (a quarter of each head) with the interleaved M-RoPE split of Qwen3-VL over it.
    layers = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(spec.num_layers)]
    layers[-1] = "full_attention"
    rotary = spec.head_dim // 4
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_section": interleaved_mrope_section(rotary), "mrope_interleaved": True}
    return Qwen3_5Config(
        text_config={**text, "head_dim": spec.head_dim, "rope_parameters": rope, "layer_types": layers,
                     "linear_conv_kernel_dim": 4, "linear_key_head_dim": spec.head_dim,
                     "linear_value_head_dim": spec.head_dim, "linear_num_key_heads": spec.num_kv_heads,
                     "linear_num_value_heads": spec.num_heads},
        vision_config=_qwen3_vision(spec), tie_word_embeddings=False, **tokens)


#: Family name (the HF ``model_type``) -> how to build it.
FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(_qwen2_vl_config, _qwen2_processor("Qwen2VLProcessor"), "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": Family(_qwen2_5_vl_config, _qwen2_processor("Qwen2_5_VLProcessor"),
                         "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": Family(_qwen3_vl_config, _qwen3_vl_processor, "Qwen3VLForConditionalGeneration"),
    "qwen3_5": Family(_qwen3_5_config, _qwen3_vl_processor, "Qwen3_5ForConditionalGeneration"),
}
