"""A model directory at a real model's shapes with no weights, for serving benchmarks without a download.

vLLM serves a directory with ``--load-format dummy`` (random weights, no weight file read, since ``config.json``
names its ``dtype``). Such a directory needs only a config at the real model's shapes and a tokenizer and
processor: the shipped tiny model's serve (its special token ids index its tokenizer; sampled ids past its
vocabulary decode to nothing). The answers are meaningless; the costs (prefill, decode, KV, compression, memory)
are the real model's. About 40 KB, written by :func:`write_dummy_model` or::

    python -m cords_vllm.lab.synthetic.dummy_model OUT_DIR --shape qwen2-vl-7b
    vllm serve OUT_DIR --load-format dummy --kv-policy cords

Shapes: :data:`SHAPES` (Qwen2-VL-7B-Instruct and Qwen2.5-VL-7B-Instruct, the second for vLLM's EVS); the
processor takes 448 x 448 frames whole (``longest_edge`` 448 * 448: four frames give the grid ``[2, 32, 32]``, 256
tokens a frame pair, as the real model does). ``overrides`` scale a shape down for a CPU test (e.g. two layers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The tokenizer and processor files copied from the source checkpoint (no weight file).
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
#: The processor's largest frame (pixels), so that 448 x 448 frames are kept whole.
FRAME_PIXELS = 448 * 448


@dataclass(frozen=True)
class DummyShape:
    """A model's shapes: the text decoder's and the vision tower's (``vision`` keys replace the source's)."""

    family: str  # "qwen2_vl" or "qwen2_5_vl": the source checkpoint of that family is copied
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    mrope_section: tuple[int, int, int]
    vision: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        """KV bytes one token takes in every layer (keys and values)."""
        return self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2 * element_bytes


#: Qwen2-VL-7B-Instruct and Qwen2.5-VL-7B-Instruct, from their published configs.
SHAPES: dict[str, DummyShape] = {
    "qwen2-vl-7b": DummyShape(
        "qwen2_vl", 3584, 18944, 28, 28, 4, 152064, 32768, (16, 24, 24),
        vision={"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16}),
    "qwen2.5-vl-7b": DummyShape(
        "qwen2_5_vl", 3584, 18944, 28, 28, 4, 152064, 128000, (16, 24, 24),
        vision={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112}),
}


#: Each shape scaled down for a CPU (two layers, narrow; the 7B vocabulary and the frame geometry kept): what the
#: test suite serves and ``benchmarks/gpu_bench.py --plan cpu`` runs, the 7B path on every run.
SCALED_DOWN: dict[str, dict[str, Any]] = {
    "qwen2-vl-7b": {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "mrope_section": (8, 12, 12),
                    "vision": {"depth": 2, "embed_dim": 64, "hidden_size": 256, "num_heads": 2}},
    "qwen2.5-vl-7b": {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "mrope_section": (8, 12, 12),
                      "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                                 "out_hidden_size": 256, "fullatt_block_indexes": [1]}},
}


class DummyModelError(ValueError):
    """A shape that cannot describe a working model, or a source that is not a checkpoint."""


def source_checkpoint(family: str) -> Path:
    """The shipped checkpoint whose tokenizer and processor a dummy model of ``family`` uses."""
    from cords_vllm.lab.vqa.model import SHIPPED_CHECKPOINTS

    return SHIPPED_CHECKPOINTS[family]


def scaled(shape: DummyShape, **overrides: Any) -> DummyShape:
    """``shape`` with some fields replaced (``vision`` merged key by key), e.g. two layers for a CPU test."""
    vision = {**shape.vision, **overrides.pop("vision", {})}
    return dataclasses.replace(shape, vision=vision, **overrides)


def check_shape(shape: DummyShape, tokenizer_vocab: int) -> None:
    """Raise :class:`DummyModelError` for shapes no model of this family can have: heads that do not divide the
    hidden size or each other, rotary sections that do not cover half a head, fewer than one layer, or a
    vocabulary smaller than the tokenizer's (its ids, the special tokens included, must index the embedding)."""
    problems = []
    if shape.num_hidden_layers < 1 or shape.vision.get("depth", 1) < 1:
        problems.append(f"{shape.num_hidden_layers} layers and vision depth {shape.vision.get('depth')}: at least 1")
    if shape.num_attention_heads < 1 or shape.hidden_size % shape.num_attention_heads:
        problems.append(f"{shape.num_attention_heads} attention heads do not divide hidden size {shape.hidden_size}")
    elif shape.num_key_value_heads < 1 or shape.num_attention_heads % shape.num_key_value_heads:
        problems.append(f"{shape.num_key_value_heads} KV heads do not divide {shape.num_attention_heads} heads")
    elif sum(shape.mrope_section) * 2 != shape.head_dim:
        problems.append(f"mrope_section {list(shape.mrope_section)} covers {sum(shape.mrope_section) * 2} of the "
                        f"head size {shape.head_dim}")
    if shape.vocab_size < tokenizer_vocab:
        problems.append(f"vocab_size {shape.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} ids")
    full = shape.vision.get("fullatt_block_indexes", ())
    if any(not 0 <= i < shape.vision.get("depth", 0) for i in full):
        problems.append(f"fullatt_block_indexes {list(full)} outside the vision depth {shape.vision.get('depth')}")
    heads, width = shape.vision.get("num_heads", 1), shape.vision.get("embed_dim", shape.vision.get("hidden_size"))
    if width is not None and width % heads:
        problems.append(f"{heads} vision heads do not divide the vision width {width}")
    if problems:
        raise DummyModelError("cannot write this dummy model: " + "; ".join(problems))


def write_dummy_model(out_dir: str | Path, shape: str | DummyShape = "qwen2-vl-7b", *, source: str | Path | None = None,
                      dtype: str = "bfloat16", **overrides: Any) -> Path:
    """Write a weightless model directory at ``shape`` (a name of :data:`SHAPES` or a :class:`DummyShape`) into
    ``out_dir``, with the tokenizer and processor of ``source`` (default: the shipped checkpoint of the shape's
    family). ``overrides`` replace fields of the shape (:func:`scaled`). Returns ``out_dir``."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise DummyModelError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    shape = scaled(shape, **overrides) if overrides else shape
    source = Path(source) if source is not None else source_checkpoint(shape.family)
    if not (source / "config.json").is_file() or not (source / "tokenizer.json").is_file():
        raise DummyModelError(f"{source} holds no checkpoint config and tokenizer (config.json, tokenizer.json)")
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != shape.family:
        raise DummyModelError(f"{source} is a {config.get('model_type')!r} checkpoint; this shape needs a "
                              f"{shape.family!r} one")
    check_shape(shape, _tokenizer_vocab(source))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "model.safetensors.index.json"):  # never a weight file beside the config
        (out / name).unlink(missing_ok=True)
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    (out / "config.json").write_text(json.dumps(_config(config, shape, dtype), indent=2) + "\n")
    processor = json.loads((source / "processor_config.json").read_text())
    for part in ("image_processor", "video_processor"):
        processor[part]["size"] = {**processor[part]["size"], "longest_edge": FRAME_PIXELS}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    (out / "dummy_model.json").write_text(json.dumps({
        "note": "weightless: serve with --load-format dummy; answers are meaningless, costs are real",
        "shape": dataclasses.asdict(shape), "source_tokenizer": source.name,
        "kv_bytes_per_token_bf16": shape.kv_bytes_per_token()}, indent=2) + "\n")
    return out


def _tokenizer_vocab(source: Path) -> int:
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    ids = list(tokenizer.get("model", {}).get("vocab", {}).values())
    ids += [t["id"] for t in tokenizer.get("added_tokens", [])]
    return max(ids) + 1 if ids else 0


def _config(config: dict[str, Any], shape: DummyShape, dtype: str) -> dict[str, Any]:
    config = json.loads(json.dumps(config))
    text = config["text_config"]
    layers = shape.num_hidden_layers
    text.update(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size, num_hidden_layers=layers,
                num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
                vocab_size=shape.vocab_size, max_position_embeddings=shape.max_position_embeddings,
                max_window_layers=layers, layer_types=["full_attention"] * layers, dtype=dtype)
    text["rope_parameters"] = {**text.get("rope_parameters", {}), "mrope_section": list(shape.mrope_section)}
    config["vision_config"].update(shape.vision, dtype=dtype)
    config["dtype"] = dtype
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cords_vllm.lab.synthetic.dummy_model",
                                     description="Write a weightless model directory at a 7B model's shapes "
                                                 "(serve it with vllm serve DIR --load-format dummy).")
    parser.add_argument("out_dir")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-vl-7b")
    parser.add_argument("--layers", type=int, help="text layers (default: the shape's)")
    parser.add_argument("--source", help="checkpoint whose tokenizer and processor to copy (default: shipped)")
    args = parser.parse_args(argv)
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    try:
        out = write_dummy_model(args.out_dir, args.shape, source=args.source, **overrides)
    except DummyModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size // 1024} KB, no weights): vllm serve {out} --load-format dummy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
