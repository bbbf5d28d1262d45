"""Build an in-process vLLM ``LLM`` on the tiny model with settings that make CPU tests fast and exact."""

from __future__ import annotations

import os
from typing import Any

#: fp32, eager, small KV pool: what exactness tests and small benchmarks use on CPU.
DEFAULT_LLM_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 8192,
    "kv_cache_memory_bytes": 256 << 20,
    "limit_mm_per_prompt": {"image": 0, "video": 1},
    "seed": 0,
}


def make_llm(model: str | os.PathLike, **overrides: Any):
    """``vllm.LLM`` on ``model`` with :data:`DEFAULT_LLM_KWARGS` updated by ``overrides``.

    The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` must be set before vLLM is
    imported; it is set here if absent), which starts in seconds and exposes the scheduler and model runner.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(model=str(model), **{**DEFAULT_LLM_KWARGS, **overrides})


def engine_core(llm):
    """The in-process ``EngineCore`` of an ``LLM`` (scheduler, executor)."""
    return llm.llm_engine.engine_core.engine_core


def model_runner(llm):
    """The in-process model runner of an ``LLM`` (single worker)."""
    return engine_core(llm).model_executor.driver_worker.worker.model_runner
