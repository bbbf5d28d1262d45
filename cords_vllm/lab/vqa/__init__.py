"""Synthetic long-video QA with needle answers, and the tiny Qwen2-VL trained on it.

A KV policy is judged by what it keeps: the answers to these questions sit in rare frames anywhere in a
redundant video, so a policy that evicts the needle's tokens answers wrong. Importing this package needs
numpy only; :mod:`cords_vllm.lab.vqa.hf` (torch, transformers) and :mod:`cords_vllm.lab.vqa.serving` (vLLM) are
imported on demand.

- :mod:`~cords_vllm.lab.vqa.tasks`: question families, :class:`VQAExample`, deterministic example generation.
- :mod:`~cords_vllm.lab.vqa.video`: video geometry and rendering (background, marks).
- :mod:`~cords_vllm.lab.vqa.prompt`: the exact prompt / chat messages.
- :mod:`~cords_vllm.lab.vqa.metrics`: accuracy per family and by needle position.
- :mod:`~cords_vllm.lab.vqa.model`: base model spec, shipped checkpoint and its training record.
- :mod:`~cords_vllm.lab.vqa.stream_task`: what a long compressed stream holds when asked, as training examples.
- :mod:`~cords_vllm.lab.vqa.hf`, :mod:`~cords_vllm.lab.vqa.positions`: HF inputs (patches, M-RoPE ids), prediction.
- :mod:`~cords_vllm.lab.vqa.serving`: ``vllm.LLM`` arguments and prediction.
"""

from cords_vllm.lab.vqa.metrics import accuracy_report, answer_hits, format_report
from cords_vllm.lab.vqa.model import (
    ANSWER_TOKENS,
    SHIPPED_CHECKPOINT,
    base_model_spec,
    build_base_model,
    shipped_checkpoint,
    training_record,
)
from cords_vllm.lab.vqa.prompt import PROMPT_TEMPLATE, build_prompt, chat_messages
from cords_vllm.lab.vqa.tasks import (
    FAMILIES,
    SPLIT_SEEDS,
    ColourFamily,
    CountFamily,
    Family,
    OrderFamily,
    Plan,
    StaticFamily,
    VQAExample,
    answer_vocabulary,
    get_family,
    iter_examples,
    make_example,
    make_split,
    plan_example,
)
from cords_vllm.lab.vqa.video import COLOUR_NAMES, COLOURS, Mark, VideoGeometry

__all__ = [
    "ANSWER_TOKENS",
    "COLOURS",
    "COLOUR_NAMES",
    "FAMILIES",
    "PROMPT_TEMPLATE",
    "SHIPPED_CHECKPOINT",
    "SPLIT_SEEDS",
    "ColourFamily",
    "CountFamily",
    "Family",
    "Mark",
    "OrderFamily",
    "Plan",
    "StaticFamily",
    "VQAExample",
    "VideoGeometry",
    "accuracy_report",
    "answer_hits",
    "answer_vocabulary",
    "base_model_spec",
    "build_base_model",
    "build_prompt",
    "chat_messages",
    "format_report",
    "get_family",
    "iter_examples",
    "make_example",
    "make_split",
    "plan_example",
    "shipped_checkpoint",
    "training_record",
]
