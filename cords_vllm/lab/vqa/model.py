"""The tiny Qwen2-VL of the video-QA task: the untrained base model and the shipped trained checkpoint.

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
TRAINING_RECORD = "training.json"


def base_model_spec(*, dtype: str = "float32", seed: int = 0, family: str = "qwen2_vl") -> TinyModelSpec:
    """The :class:`TinyModelSpec` training starts from: default tiny geometry of ``family`` plus
    :data:`ANSWER_TOKENS`."""
    return TinyModelSpec(extra_tokens=ANSWER_TOKENS, dtype=dtype, seed=seed, family=family)


def build_base_model(cache_dir: str | os.PathLike | None = None, *, seed: int = 0, family: str = "qwen2_vl") -> Path:
    """Directory of the untrained fp32 base checkpoint of ``family`` (built on first use, cached)."""
    return build_tiny_qwen2vl(base_model_spec(seed=seed, family=family), cache_dir=cache_dir)


def shipped_checkpoint() -> Path:
    """Directory of the shipped trained checkpoint; raises ``FileNotFoundError`` if it is missing."""
    if not (SHIPPED_CHECKPOINT / "config.json").is_file():
        raise FileNotFoundError(f"no trained video-QA checkpoint at {SHIPPED_CHECKPOINT}")
    return SHIPPED_CHECKPOINT


def training_record(checkpoint: str | os.PathLike | None = None) -> dict[str, Any]:
    """The ``training.json`` of ``checkpoint`` (default: the shipped one)."""
    root = Path(checkpoint) if checkpoint is not None else shipped_checkpoint()
    return json.loads((root / TRAINING_RECORD).read_text())
