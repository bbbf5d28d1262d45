"""An in-process vLLM ``LLM`` with settings that make CPU runs fast and exact (tests, benchmarks, demo).

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the engine starts in seconds, and
:mod:`cords_vllm.integration.inprocess.introspect` can read the scheduler directly.
"""

from __future__ import annotations

import logging
import os
from typing import Any

#: fp32, eager, small KV pool: what exactness tests and small benchmarks use on CPU. On a GPU the engine asks for
#: a tenth of its memory (vLLM's default is 0.9), so it starts beside servers and other engines on the same GPU.
DEFAULT_LLM_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 8192,
    "kv_cache_memory_bytes": 256 << 20,
    "gpu_memory_utilization": 0.1,
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

    _quiet_in_process_thread_warning()
    return LLM(model=str(model), **{**DEFAULT_LLM_KWARGS, **overrides})


class _DropMessage(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in str(record.msg)


def _quiet_in_process_thread_warning() -> None:
    """Drop vLLM's CPU-worker warning about ``torch.set_num_threads``, which floods in-process runs.

    vLLM's CPU worker replaces ``torch.set_num_threads`` with a function that logs a warning, to keep the
    worker's thread binding. In its own process only the worker sees that; in-process, vLLM's renderer (which wraps
    the processing of every multimodal request in ``set_default_torch_num_threads``) runs in the same process
    and logs the warning twice per request. Harmless, and nothing else is filtered.
    """
    logger = logging.getLogger("vllm.v1.worker.cpu_worker")
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage("torch.set_num_threads"))
