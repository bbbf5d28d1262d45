"""A deterministic, tiny, randomly initialised Qwen-VL checkpoint built fully offline.

The checkpoint has the real architecture of its family (:data:`~cords_vllm.lab.synthetic.families.FAMILIES`:
Qwen2-VL, the one ``vllm serve Qwen/Qwen2-VL-7B-Instruct`` runs, Qwen2.5-VL, Qwen3-VL and the hybrid Qwen3.5),
a byte-level BPE tokenizer trained on a corpus generated here, the Qwen-VL special tokens, the family's image/video
processor and a chat template that accepts OpenAI ``video_url`` / ``image_url`` parts. vLLM serves it and HF
transformers runs it, so the two can be compared token for token.

Builds are cached in a directory keyed by a hash of :class:`TinyModelSpec` (and a format version), so the
same spec is built once per machine and reused. Concurrent builders are safe: each builds into a private
temporary directory and the first atomic rename wins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: Bumped whenever the builder changes what it writes, so stale caches are never reused.
BUILD_FORMAT_VERSION = 1

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

#: Qwen2-VL-style chat template. Adds the default system prompt unless the first message is a system
#: message, and renders ``video`` / ``video_url`` and ``image`` / ``image_url`` parts as vision placeholders.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenizer split (regex, then byte level).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WORDS = (
    "the a an video frame scene square circle red green blue yellow white black orange purple cyan what "
    "which how many color colour was is are did first last before after appear appears moving static "
    "object objects background describe question answer assistant user system helpful you count flash "
    "flashes left right top bottom middle small large bright dark time second minute one two three four "
    "five six seven eight nine zero and or not in on at of to from with this that"
).split()


def _corpus(num_lines: int = 4000, seed: int = 1234) -> list[str]:
    """A deterministic English-like corpus for training the BPE tokenizer (no files, no network)."""
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        n = rng.randint(4, 14)
        sentence = " ".join(rng.choice(_WORDS) for _ in range(n))
        punct = rng.choice(["?", ".", "!", ",", ":"])
        digits = " ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(0, 2)))
        lines.append(f"{sentence.capitalize()}{punct} {digits}\n")
    return lines


@dataclass(frozen=True)
class TinyModelSpec:
    """Geometry and contents of a tiny Qwen-VL checkpoint.

    Attributes
    ----------
    family:
        The architecture (:data:`~cords_vllm.lab.synthetic.families.FAMILIES`): ``"qwen2_vl"`` (default),
        ``"qwen2_5_vl"``, ``"qwen3_vl"`` or ``"qwen3_5"`` (hybrid: three Gated DeltaNet layers to one attention
        layer; vLLM's CPU build runs it in bf16 only). Vision geometry follows the family (patch 14 for the Qwen2
        families, 16 for the Qwen3 ones).
    num_layers, num_heads, num_kv_heads, head_dim:
        Text decoder geometry; ``hidden_size = num_heads * head_dim``. ``head_dim`` must be a multiple of 16
        (M-RoPE sections) and a head size the attention backend supports (vLLM CPU: 32, 64, 80, 96, 112,
        128, 192, 256).
    intermediate_size:
        MLP width of the text decoder.
    vocab_size:
        Embedding rows; must exceed ``tokenizer_vocab + len(SPECIAL_TOKENS) + len(extra_tokens)``.
    tokenizer_vocab:
        Size of the BPE vocabulary before special tokens.
    vision_depth, vision_embed_dim, vision_heads:
        Vision tower geometry (temporal patch 2, spatial merge 2 as in every Qwen-VL family).
    min_pixels, max_pixels:
        Resize bounds of the image and video processors (per frame).
    extra_tokens:
        Words added to the tokenizer as single tokens (e.g. answer words of a QA task).
    dtype:
        Storage dtype of the weights (``"bfloat16"`` or ``"float32"``); load in fp32 for exact comparisons.
    seed:
        Seed of the weight initialisation.
    max_position_embeddings:
        The rotary range (131072 by default; small values make a stream's position limit reachable in tests).
    """

    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 2048
    tokenizer_vocab: int = 1800
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_heads: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224
    extra_tokens: tuple[str, ...] = field(default_factory=tuple)
    dtype: str = "bfloat16"
    seed: int = 0
    max_position_embeddings: int = 131072
    family: str = "qwen2_vl"

    def __post_init__(self) -> None:
        from cords_vllm.lab.synthetic.families import FAMILIES

        if self.family not in FAMILIES:
            raise ValueError(f"TinyModelSpec.family must be one of {sorted(FAMILIES)}, got {self.family!r}")
        positive = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                    "vocab_size", "tokenizer_vocab", "vision_depth", "vision_embed_dim", "vision_heads")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TinyModelSpec.{name} must be a positive int, got {value!r}")
        if self.head_dim % 16:
            raise ValueError(f"TinyModelSpec.head_dim must be a multiple of 16, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyModelSpec.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.vision_embed_dim % self.vision_heads:
            raise ValueError("TinyModelSpec.vision_embed_dim must be a multiple of vision_heads")
        needed = self.tokenizer_vocab + len(SPECIAL_TOKENS) + len(self.extra_tokens)
        if self.vocab_size < needed:
            raise ValueError(f"TinyModelSpec.vocab_size must be >= {needed} for this tokenizer, "
                             f"got {self.vocab_size}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"TinyModelSpec.dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError("TinyModelSpec needs 0 < min_pixels <= max_pixels")

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    def cache_key(self) -> str:
        """Short stable hash of the spec and the builder's format version."""
        fields = dataclasses.asdict(self)
        if fields["max_position_embeddings"] == 131072:  # added later: the default keeps earlier keys
            del fields["max_position_embeddings"]
        if fields["family"] == "qwen2_vl":  # likewise
            del fields["family"]
        payload = json.dumps({"v": BUILD_FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$CORDS_VLLM_CACHE``, else ``$XDG_CACHE_HOME/cords-vllm``, else ``~/.cache/cords-vllm``."""
    if env := os.environ.get("CORDS_VLLM_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cords-vllm"


def build_tiny_model(spec: TinyModelSpec | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the tiny checkpoint for ``spec``, building it on first use.

    The directory holds ``config.json``, ``model.safetensors``, tokenizer files, processor configs and
    ``chat_template.jinja``: everything ``vllm serve <dir>`` and ``AutoProcessor.from_pretrained`` need.
    """
    spec = spec or TinyModelSpec()
    name = f"tiny-{spec.family.replace('_', '')}-{spec.cache_key()}"
    return build_cached(name, lambda out: _write_checkpoint(spec, out), cache_dir)


def build_cached(name: str, write: Callable[[Path], None], cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir / name`` (default: :func:`default_cache_dir`), written by ``write(directory)`` on first use.

    A build is complete once the directory holds ``cords_tiny_spec.json`` (``write`` writes it last). Concurrent
    builders are safe: each writes into a private temporary directory and the first atomic rename wins.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / name
    if (target / "cords_tiny_spec.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "cords_tiny_spec.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_qwen2vl(spec: TinyModelSpec | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """:func:`build_tiny_model` (the name from before other families; ``spec`` picks the family)."""
    return build_tiny_model(spec, cache_dir)


def build_tokenizer(spec: TinyModelSpec):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.tokenizer_vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if spec.extra_tokens:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(w, single_word=False, normalized=False) for w in spec.extra_tokens])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=131072,
        chat_template=CHAT_TEMPLATE,
    )
    hf_tok.image_token = "<|image_pad|>"
    hf_tok.video_token = "<|video_pad|>"
    return hf_tok


def _write_checkpoint(spec: TinyModelSpec, out: Path) -> None:
    import torch

    from cords_vllm.lab.synthetic.families import FAMILIES

    tokenizer = build_tokenizer(spec)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={spec.vocab_size}")
    text = {
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-6,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"], "dtype": spec.dtype,
    }
    tokens = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}
    family = FAMILIES[spec.family]
    processor = family.processor(spec, tokenizer, CHAT_TEMPLATE)
    config = family.config(spec, text, tokens)
    config.bos_token_id = ids["<|endoftext|>"]
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]

    devnull_rng = torch.random.fork_rng(devices=[])
    with devnull_rng:
        torch.manual_seed(spec.seed)
        model = family.model_class()(config)
    model = model.to(getattr(torch, spec.dtype))
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = ids["<|endoftext|>"]

    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    (out / "cords_tiny_spec.json").write_text(
        json.dumps({"format": BUILD_FORMAT_VERSION, **dataclasses.asdict(spec)}, indent=2) + "\n"
    )
