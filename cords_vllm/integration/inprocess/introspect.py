"""Read-only introspection of a KV policy inside a vLLM ``LLM``: the one API tests and benchmarks use.

This module is the one supported reach into a running engine's internals: tests, benchmarks and the demo
read the engine through it and never walk vLLM's objects themselves. The scheduler half comes from the
plugin's scheduler hooks (in-process engines, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
:func:`cords_vllm.integration.inprocess.llm.make_llm` builds them), the worker half through
``LLM.collective_rpc``, vLLM's supported way to reach workers in process or across processes. Nothing extra
crosses per step.

* :func:`snapshot`: requests (blocks and video tokens each holds, compressions), worker counters and, with
  ``CORDS_VLLM_TRACE=1``, every compression's kept logical ids.
* :func:`observe_steps` / :func:`record_steps`: a callback after every scheduler step (subscribed through
  the plugin's schedule hook, never by replacing ``schedule``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cords_vllm.config import KVPolicyConfig
from cords_vllm.integration.engine_core.hooks import observe_steps as subscribe
from cords_vllm.integration.engine_core.hooks import scheduler_hooks
from cords_vllm.integration.engine_core.tracker import RequestCompression, RequestTracker
from cords_vllm.integration.engine_facts import model_facts_of
from cords_vllm.integration.kv_groups import attention_manager
from cords_vllm.integration.worker.compressor import CompressionEvent, WorkerSnapshot
from cords_vllm.integration.worker.hooks import attached_compressor

__all__ = ["CompressionEvent", "PolicySnapshot", "RequestCompression", "StepRecorder", "answering_requests",
           "engine_core", "observe_steps", "record_steps", "requests_of", "scheduler_of", "snapshot",
           "worker_snapshots"]


@dataclass(frozen=True)
class PolicySnapshot:
    """What the KV policy of an engine holds and did, at one moment.

    Attributes
    ----------
    requests:
        Every request holding KV blocks, by engine request id (:class:`RequestCompression`).
    free_blocks, total_blocks:
        The block pool (the null block excluded from the total).
    compressions, selection_seconds:
        Worker totals (summed over workers).
    held_by_workers:
        Requests the workers hold a compressed region for, with ``(kept blocks, region blocks)``.
    events:
        Every compression carried out (``CORDS_VLLM_TRACE=1`` only; empty otherwise), in order.
    """

    requests: Mapping[str, RequestCompression]
    free_blocks: int
    total_blocks: int
    compressions: int
    selection_seconds: float
    held_by_workers: Mapping[str, tuple[int, int]]
    events: tuple[CompressionEvent, ...]


def engine_core(llm: Any) -> Any:
    """The in-process ``EngineCore`` of an ``LLM`` (raises with advice when the engine is in another process)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError("this LLM runs its engine core in another process; build it with "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 (cords_vllm.integration.inprocess.llm.make_llm "
                           "does) to introspect it")
    return core


def scheduler_of(llm: Any) -> Any:
    """The in-process scheduler of an ``LLM``."""
    return engine_core(llm).scheduler


def requests_of(scheduler: Any) -> dict[str, RequestCompression]:
    """Every request ``scheduler`` holds blocks for, with what it holds and its compression state (any policy,
    ``none`` too)."""
    compressor = scheduler_hooks(scheduler).compressor
    if compressor is not None:
        manager, describe = compressor.manager, compressor.describe
    else:
        manager = attention_manager(scheduler.kv_cache_manager)
        config, facts = KVPolicyConfig(), model_facts_of(scheduler.vllm_config)

        def describe(request: Any, row: list) -> RequestCompression:
            return RequestTracker(request.request_id).describe(request, row, facts, config, manager.block_size)
    return {req_id: describe(request, row) for req_id, row in manager.req_to_blocks.items()
            if (request := scheduler.requests.get(req_id)) is not None}


def answering_requests(scheduler: Any, output: Any) -> list[str]:
    """Ids of the requests that sample their first token in the step ``scheduler`` just scheduled (``output``):
    their whole prompt is computed, what they hold now is what they answer with."""
    scheduled = output.num_scheduled_tokens
    return [r.request_id for r in scheduler.running if r.num_computed_tokens == r.num_prompt_tokens
            and r.request_id in scheduled and r.num_output_tokens == 0]


def _worker_snapshot(worker: Any) -> WorkerSnapshot | None:
    comp = attached_compressor(worker.model_runner)
    return comp.snapshot() if comp is not None else None


def worker_snapshots(llm: Any) -> list[WorkerSnapshot]:
    """Each worker's :class:`~cords_vllm.integration.worker.compressor.WorkerSnapshot` (none before its first step or
    without a policy)."""
    return [s for s in llm.collective_rpc(_worker_snapshot) if s is not None]


def snapshot(llm: Any) -> PolicySnapshot:
    """A :class:`PolicySnapshot` of an in-process ``LLM``."""
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    workers = worker_snapshots(llm)
    held: dict[str, tuple[int, int]] = {}
    for w in workers:
        held.update(w.held)
    return PolicySnapshot(
        requests=requests_of(scheduler), free_blocks=pool.get_num_free_blocks(), total_blocks=pool.num_gpu_blocks - 1,
        compressions=sum(w.compressions for w in workers),
        selection_seconds=sum(w.selection_seconds for w in workers), held_by_workers=held,
        events=workers[0].events if workers else ())


def observe_steps(llm: Any, observer: Callable[[Any, Any], None]) -> Callable[[], None]:
    """Call ``observer(scheduler, scheduler_output)`` after every step of ``llm``; returns an unsubscribe."""
    return subscribe(scheduler_of(llm), observer)


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

    def observe(self, scheduler: Any, output: Any) -> None:
        """Record one step: ``scheduler`` after ``schedule()`` returned ``output``."""
        in_use = self.total_blocks - scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        for req_id, request in requests_of(scheduler).items():
            self.max_blocks_held[req_id] = max(self.max_blocks_held.get(req_id, 0), request.held_blocks)
        running = len(scheduler.running)
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
        self.preemptions += len(output.preempted_req_ids or ())
        self.peak_running = max(self.peak_running, running)
        self.peak_decoding = max(self.peak_decoding, decoding)
        self.peak_blocks = max(self.peak_blocks, in_use)
        self.timeline.append((time.perf_counter() - self.started, in_use, running))


def record_steps(llm: Any) -> StepRecorder:
    """Observe every scheduler step of ``llm`` (in-process engine) into a fresh :class:`StepRecorder`.

    The observer runs after the plugin's compression and vLLM's allocation of the step. Held blocks exclude
    the null block's holes.
    """
    scheduler = scheduler_of(llm)
    recorder = StepRecorder(total_blocks=scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1)  # 0 is null
    observe_steps(llm, recorder.observe)
    return recorder


@dataclass(frozen=True)
class HostLengths:
    """How much host state one request keeps, in each process (entries of each list or tensor).

    ``tokens``: the scheduler's token list (``Request._all_token_ids``); ``prompt``: its prompt token list;
    ``row``: its row of blocks (null entries included); ``inputs``: its multimodal inputs; ``worker_tokens``,
    ``worker_positions``, ``worker_row``, ``worker_inputs``: the same in the worker (``CachedRequestState``:
    prompt tokens, M-RoPE position columns, block ids, multimodal inputs); ``num_computed``: the scheduler's
    computed-token count.
    """

    tokens: int
    prompt: int
    row: int
    inputs: int
    num_computed: int
    worker_tokens: int
    worker_positions: int
    worker_row: int
    worker_inputs: int


def _worker_lengths(worker: Any, req_id: str) -> tuple[int, int, int, int] | None:
    state = worker.model_runner.requests.get(req_id)
    if state is None:
        return None
    positions = getattr(state, "mrope_positions", None)
    comp = attached_compressor(worker.model_runner)
    group = comp.group_index if comp is not None else 0
    return (len(state.prompt_token_ids or ()), 0 if positions is None else int(positions.shape[-1]),
            len(state.block_ids[group]), len(state.mm_features or ()))


def host_lengths(llm: Any, req_id: str) -> HostLengths:
    """:class:`HostLengths` of request ``req_id`` (engine-internal id) of an in-process ``LLM``."""
    scheduler = scheduler_of(llm)
    request = scheduler.requests[req_id]
    row = attention_manager(scheduler.kv_cache_manager).req_to_blocks.get(req_id, [])
    workers = [w for w in llm.collective_rpc(_worker_lengths, args=(req_id,)) if w is not None]
    worker = workers[0] if workers else (0, 0, 0, 0)
    return HostLengths(len(request._all_token_ids), len(request.prompt_token_ids), len(row),
                       len(request.mm_features), request.num_computed_tokens, *worker)
