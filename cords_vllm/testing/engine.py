"""Build an in-process vLLM ``LLM`` on the tiny model with settings that make CPU tests fast and exact."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
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


def engine_core(llm):
    """The in-process ``EngineCore`` of an ``LLM`` (scheduler, executor)."""
    return llm.llm_engine.engine_core.engine_core


def model_runner(llm):
    """The in-process model runner of an ``LLM`` (single worker)."""
    return engine_core(llm).model_executor.driver_worker.worker.model_runner


@dataclass
class StepRecorder:
    """What the scheduler held after each step of an in-process engine (installed by :func:`record_steps`).

    Each step is observed right after ``Scheduler.schedule`` returned, i.e. after the step's allocations: the
    peak of what is held. ``timeline`` rows are ``(seconds since start(), blocks in use, running requests)``.
    """

    total_blocks: int
    preemptions: int = 0
    peak_running: int = 0
    peak_decoding: int = 0
    peak_blocks: int = 0
    max_blocks_held: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def start(self) -> None:
        """Restart the timeline clock (call when the first request is submitted)."""
        self.started = time.perf_counter()

    def observe(self, scheduler, output) -> None:
        """Record one step: ``scheduler`` after ``schedule()`` returned ``output``."""
        manager = scheduler.kv_cache_manager
        in_use = self.total_blocks - manager.block_pool.get_num_free_blocks()
        for req_id, row in manager.coordinator.single_type_managers[0].req_to_blocks.items():
            held = sum(not b.is_null for b in row)
            self.max_blocks_held[req_id] = max(self.max_blocks_held.get(req_id, 0), held)
        running = len(scheduler.running)
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
        self.preemptions += len(output.preempted_req_ids or ())
        self.peak_running = max(self.peak_running, running)
        self.peak_decoding = max(self.peak_decoding, decoding)
        self.peak_blocks = max(self.peak_blocks, in_use)
        self.timeline.append((time.perf_counter() - self.started, in_use, running))


def record_steps(llm) -> StepRecorder:
    """Observe every scheduler step of ``llm`` (in-process engine) into a fresh :class:`StepRecorder`.

    Wraps the scheduler instance's ``schedule`` (the plugin's wrapper around vLLM's, when a policy is on), so it
    sees the step after compression and allocation. Held blocks exclude the null block's holes.
    """
    scheduler = engine_core(llm).scheduler
    recorder = StepRecorder(total_blocks=scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1)  # 0 is null
    inner = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any):
        output = inner(*args, **kwargs)
        recorder.observe(scheduler, output)
        return output

    scheduler.schedule = schedule
    return recorder
