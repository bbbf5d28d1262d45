"""The tiny video-QA models: the untrained base model and the shipped trained checkpoints (Qwen2-VL, Qwen2.5-VL).

The base model is :func:`cords_vllm.lab.synthetic.build_tiny_qwen2vl` with the task's colour words added to the
tokenizer as single tokens (digits already are). The trained checkpoint ships in the package at
``cords_vllm/lab/assets/tiny_vqa/`` with ``training.json``: training configuration, seed, data description,
prompt format and the measured held-out accuracy (HF and vLLM).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cords_vllm.lab.synthetic.tiny_model import TinyModelSpec, build_tiny_qwen2vl
from cords_vllm.lab.vqa.video import COLOUR_NAMES

#: Words added to the base tokenizer so that every answer is one token.
ANSWER_TOKENS: tuple[str, ...] = COLOUR_NAMES

#: Where the trained checkpoint ships (inside the package).
SHIPPED_CHECKPOINT = Path(__file__).resolve().parent.parent / "assets" / "tiny_vqa"
#: The trained checkpoint of each family: Qwen2-VL (the demo's), and Qwen2.5-VL (vLLM's video pruning runs on it).
SHIPPED_CHECKPOINTS = {"qwen2_vl": SHIPPED_CHECKPOINT,
                       "qwen2_5_vl": SHIPPED_CHECKPOINT.with_name("tiny_vqa_qwen2_5_vl")}
TRAINING_RECORD = "training.json"


def base_model_spec(*, dtype: str = "float32", seed: int = 0, family: str = "qwen2_vl") -> TinyModelSpec:
    """The :class:`TinyModelSpec` training starts from: default tiny geometry of ``family`` plus
    :data:`ANSWER_TOKENS`."""
    return TinyModelSpec(extra_tokens=ANSWER_TOKENS, dtype=dtype, seed=seed, family=family)


def build_base_model(cache_dir: str | os.PathLike | None = None, *, seed: int = 0, family: str = "qwen2_vl") -> Path:
    """Directory of the untrained fp32 base checkpoint of ``family`` (built on first use, cached)."""
    return build_tiny_qwen2vl(base_model_spec(seed=seed, family=family), cache_dir=cache_dir)


def shipped_checkpoint(family: str = "qwen2_vl") -> Path:
    """Directory of the shipped trained checkpoint of ``family`` (:data:`SHIPPED_CHECKPOINTS`); raises
    ``FileNotFoundError`` if it is missing."""
    if family not in SHIPPED_CHECKPOINTS:
        raise ValueError(f"no video-QA checkpoint ships for {family!r}; one of {sorted(SHIPPED_CHECKPOINTS)}")
    path = SHIPPED_CHECKPOINTS[family]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no trained video-QA checkpoint at {path}")
    return path


def training_record(checkpoint: str | os.PathLike | None = None) -> dict[str, Any]:
    """The ``training.json`` of ``checkpoint`` (default: the shipped one)."""
    root = Path(checkpoint) if checkpoint is not None else shipped_checkpoint()
    return json.loads((root / TRAINING_RECORD).read_text())
