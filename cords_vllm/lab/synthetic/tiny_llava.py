"""A deterministic, tiny, randomly initialised LLaVA-NeXT-Video checkpoint built fully offline.

``LlavaNextVideoForConditionalGeneration`` with its real architecture, scaled down: a CLIP vision tower (8-pixel
patches, ``image_size`` pixels per frame side), the 2 x 2 average pooling of every frame's patch grid, a two-layer
projector and a Llama text model with 1-D rotary positions (no M-RoPE). A video of ``F`` frames becomes
``F x tokens_per_frame`` contiguous ``<video>`` tokens with no separators (vLLM 0.32 lays it out so:
``LlavaNextVideoProcessingInfo.get_num_video_tokens``), which is how its frames are found
(:data:`~cords_vllm.model_facts.FRAMES_FROM_LAYOUT`). With the default 80 pixels a frame is a 10 x 10 patch grid
pooled to 5 x 5 = 25 tokens, so a 16-frame video is 400 tokens.

The tokenizer is the Qwen-VL tiny models' (:func:`~cords_vllm.lab.synthetic.tiny_model.build_tokenizer`) plus the
``<video>`` and ``<image>`` special tokens, with a LLaVA-style chat template (``USER: <video>\\n... ASSISTANT:``).
vLLM serves it and HF transformers runs it, so the two can be compared token for token. Builds are cached like
:func:`~cords_vllm.lab.synthetic.tiny_model.build_tiny_model` (same cache directory, keyed by the spec).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cords_vllm.lab.synthetic.tiny_model import SPECIAL_TOKENS, TinyModelSpec, build_cached

#: Bumped whenever the builder changes what it writes, so stale caches are never reused.
BUILD_FORMAT_VERSION = 1

VIDEO_TOKEN = "<video>"
IMAGE_TOKEN = "<image>"
POOL_STRIDE = 2

#: LLaVA-NeXT-Video-style chat template (``USER: <video>\n{text} ASSISTANT:``): ``video`` / ``video_url`` parts
#: become ``<video>\n``, ``image`` / ``image_url`` parts ``<image>\n``, in the order the message gives them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] if message['content'] is string else "
    "message['content'] | map(attribute='text') | join(' ') }}\n"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'video' or 'video' in content or 'video_url' in content %}<video>\n"
    "{% elif content['type'] == 'image' or 'image' in content or 'image_url' in content %}<image>\n"
    "{% elif 'text' in content %}{{ content['text'] + ' ' }}{% endif %}{% endfor %}{% endif %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@dataclass(frozen=True)
class TinyLlavaSpec:
    """Geometry and contents of a tiny LLaVA-NeXT-Video checkpoint.

    Attributes
    ----------
    num_layers, num_heads, num_kv_heads, head_dim:
        Llama text decoder geometry; ``hidden_size = num_heads * head_dim``. ``head_dim`` must be a head size
        vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, 192, 256).
    intermediate_size:
        MLP width of the text decoder.
    vocab_size, tokenizer_vocab:
        Embedding rows, and the BPE vocabulary before special tokens.
    image_size, patch_size:
        Pixels per frame side (frames are resized and cropped to it) and per patch side. ``image_size`` is a
        multiple of ``2 * patch_size``, so the pooled grid has no remainder (vLLM rounds it up, transformers
        down), and at least ``patch_size ** 2`` (vLLM 0.32's pooler divides by ``image_size // patch_size ** 2``).
    vision_layers, vision_hidden, vision_heads:
        CLIP vision tower geometry (``vision_feature_layer = -2``: the last layer's input is the feature).
    dtype:
        Storage dtype of the weights (``"bfloat16"`` or ``"float32"``).
    seed:
        Seed of the weight initialisation.
    max_position_embeddings:
        The rotary range.
    """

    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 2048
    tokenizer_vocab: int = 1800
    image_size: int = 80
    patch_size: int = 8
    vision_layers: int = 3
    vision_hidden: int = 64
    vision_heads: int = 2
    dtype: str = "float32"
    seed: int = 0
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        positive = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                    "tokenizer_vocab", "image_size", "patch_size", "vision_layers", "vision_hidden", "vision_heads")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TinyLlavaSpec.{name} must be a positive int, got {value!r}")
        if self.image_size % (self.patch_size * POOL_STRIDE) or self.image_size < self.patch_size ** 2:
            raise ValueError(f"TinyLlavaSpec.image_size must be a multiple of {self.patch_size * POOL_STRIDE} and at "
                             f"least {self.patch_size ** 2}, got {self.image_size}")
        if self.num_heads % self.num_kv_heads or self.vision_hidden % self.vision_heads:
            raise ValueError("TinyLlavaSpec: heads must divide evenly (num_heads by num_kv_heads, "
                             "vision_hidden by vision_heads)")
        if self.vision_layers < 2:
            raise ValueError("TinyLlavaSpec.vision_layers must be >= 2 (the feature is the second-to-last layer's)")
        needed = self.tokenizer_vocab + len(SPECIAL_TOKENS) + 2
        if self.vocab_size < needed:
            raise ValueError(f"TinyLlavaSpec.vocab_size must be >= {needed}, got {self.vocab_size}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"TinyLlavaSpec.dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def tokens_per_frame(self) -> int:
        """Language-model tokens of one frame: the pooled patch grid."""
        side = self.image_size // self.patch_size // POOL_STRIDE
        return side * side

    def cache_key(self) -> str:
        """Short stable hash of the spec and the builder's format version."""
        payload = json.dumps({"v": BUILD_FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def build_tiny_llava_next_video(spec: TinyLlavaSpec | None = None,
                                cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the tiny LLaVA-NeXT-Video checkpoint for ``spec``, building it on first use.

    The directory holds ``config.json``, ``model.safetensors``, the tokenizer, the processor configs and the chat
    template: everything ``vllm serve <dir>`` and ``AutoProcessor.from_pretrained`` need. Concurrent builders are
    safe (each builds into a private directory; the first atomic rename wins).
    """
    spec = spec or TinyLlavaSpec()
    return build_cached(f"tiny-llavanextvideo-{spec.cache_key()}", lambda out: _write_checkpoint(spec, out), cache_dir)


def _tokenizer(spec: TinyLlavaSpec):
    from tokenizers import AddedToken

    from cords_vllm.lab.synthetic.tiny_model import build_tokenizer

    tok = build_tokenizer(TinyModelSpec(tokenizer_vocab=spec.tokenizer_vocab, vocab_size=spec.vocab_size))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in (VIDEO_TOKEN, IMAGE_TOKEN)],
                   special_tokens=True)
    tok.video_token, tok.image_token = VIDEO_TOKEN, IMAGE_TOKEN
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _processor(spec: TinyLlavaSpec, tokenizer):
    from transformers import LlavaNextImageProcessor, LlavaNextVideoProcessor
    from transformers.models.llava_next_video.video_processing_llava_next_video import (
        LlavaNextVideoVideoProcessor,
    )

    size, crop = {"shortest_edge": spec.image_size}, {"height": spec.image_size, "width": spec.image_size}
    pinpoints = [[spec.image_size, 2 * spec.image_size], [2 * spec.image_size, spec.image_size],
                 [2 * spec.image_size, 2 * spec.image_size]]
    images = LlavaNextImageProcessor(size=size, crop_size=crop, image_grid_pinpoints=pinpoints)
    videos = LlavaNextVideoVideoProcessor(size=size, crop_size=crop)
    return LlavaNextVideoProcessor(video_processor=videos, image_processor=images, tokenizer=tokenizer,
                                   chat_template=CHAT_TEMPLATE, patch_size=spec.patch_size,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)


def _write_checkpoint(spec: TinyLlavaSpec, out: Path) -> None:
    import torch
    from transformers import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    tokenizer = _tokenizer(spec)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={spec.vocab_size}")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", VIDEO_TOKEN, IMAGE_TOKEN)}
    text = {
        "model_type": "llama", "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
        "dtype": spec.dtype,
    }
    vision = {
        "model_type": "clip_vision_model", "hidden_size": spec.vision_hidden,
        "intermediate_size": 2 * spec.vision_hidden,
        "num_hidden_layers": spec.vision_layers, "num_attention_heads": spec.vision_heads,
        "image_size": spec.image_size, "patch_size": spec.patch_size, "projection_dim": spec.vision_hidden,
    }
    config = LlavaNextVideoConfig(
        vision_config=vision, text_config=text, video_token_index=ids[VIDEO_TOKEN],
        image_token_index=ids[IMAGE_TOKEN], vision_feature_layer=-2, vision_feature_select_strategy="default",
        spatial_pool_mode="average", spatial_pool_stride=POOL_STRIDE,
        video_seq_length=spec.tokens_per_frame, image_seq_length=(spec.image_size // spec.patch_size) ** 2,
        image_grid_pinpoints=[[spec.image_size, 2 * spec.image_size], [2 * spec.image_size, spec.image_size],
                              [2 * spec.image_size, 2 * spec.image_size]],
        tie_word_embeddings=False)
    config.bos_token_id = ids["<|endoftext|>"]
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    config.dtype = spec.dtype

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlavaNextVideoForConditionalGeneration(config)
    model = model.to(getattr(torch, spec.dtype))
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out, safe_serialization=True)
    _released_weight_names(out / "model.safetensors")
    _processor(spec, tokenizer).save_pretrained(out)
    (out / "cords_tiny_spec.json").write_text(
        json.dumps({"format": BUILD_FORMAT_VERSION, "family": "llava_next_video", **dataclasses.asdict(spec)},
                   indent=2) + "\n")


def _released_weight_names(path: Path) -> None:
    """Rename the vision tower's weights as the released checkpoints name them (``vision_tower.vision_model.*``).

    transformers 5 saves its CLIP tower without the ``vision_model`` level, which vLLM 0.32's loader does not
    map; it reads the released names itself (its conversion mapping drops the level again).
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {(f"vision_tower.vision_model.{k[len('vision_tower.'):]}"
                if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})
