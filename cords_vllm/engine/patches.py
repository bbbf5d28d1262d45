"""The engine patches the KV policy needs in vLLM 0.32: one table, installed by :mod:`cords_vllm.engine.patching`.

Each wrapper looks up the engine object's state once (:mod:`cords_vllm.engine.attach`) and calls straight
through when the policy is ``none``. The same changes, as upstream would make them, are the patch series in
``patches/`` at the repository root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cords_vllm.config import KVPolicyConfig
from cords_vllm.engine.attach import attach, attached
from cords_vllm.engine.patching import EngineSignatureError, Patch, installed
from cords_vllm.engine.patching import install as install_patches
from cords_vllm.utils import cdiv

#: ``callback(scheduler, scheduler_output)`` after every ``Scheduler.schedule`` (see :func:`observe_steps`).
StepObserver = Callable[[Any, Any], None]
_MISSING: Any = object()


def policy_of(vllm_config: Any) -> KVPolicyConfig | None:
    """The enabled policy of an engine (``None`` for ``--kv-policy none``)."""
    config = KVPolicyConfig.from_vllm_config(vllm_config)
    return config if config.enabled else None


@dataclass
class SchedulerHooks:
    """Per-scheduler plugin state: its compressor (``None`` without a policy) and step observers."""

    compressor: Any
    observers: list[StepObserver] = field(default_factory=list)


def scheduler_hooks(scheduler: Any) -> SchedulerHooks:
    """The scheduler's :class:`SchedulerHooks`, created (with its compressor) on first use."""
    hooks = attached(scheduler, _MISSING)
    if hooks is _MISSING:
        from cords_vllm.engine.held_kv import HeldKVPublisher
        from cords_vllm.engine.peak_kv import PeakHeldBlocks
        from cords_vllm.engine.scheduler import SchedulerCompressor

        policy = policy_of(scheduler.vllm_config)
        compressor = SchedulerCompressor(policy, scheduler) if policy else None
        hooks = SchedulerHooks(compressor, [HeldKVPublisher(compressor), PeakHeldBlocks(compressor)])
        attach(scheduler, hooks)
        attach(scheduler.kv_cache_manager, hooks.compressor)
    return hooks


def observe_steps(scheduler: Any, observer: StepObserver) -> Callable[[], None]:
    """Call ``observer(scheduler, output)`` after every step of ``scheduler``; returns an unsubscribe."""
    observers = scheduler_hooks(scheduler).observers
    observers.append(observer)
    return lambda: observers.remove(observer)


def worker_compressor(runner: Any) -> Any:
    """The model runner's worker compressor (``None`` without a policy), created on first use."""
    comp = attached(runner, _MISSING)
    if comp is _MISSING:
        from cords_vllm.engine.worker import WorkerCompressor

        policy = policy_of(runner.vllm_config)
        comp = WorkerCompressor(policy, runner) if policy else None
        attach(runner, comp)
        if comp is not None:
            for groups in runner.attn_groups:
                for group in groups:
                    attach(group, (comp, runner))
    return comp


# ------------------------------------------------------------------------------------------------------
def _make_schedule(original: Callable) -> Callable:
    def schedule(self, *args, **kwargs):
        hooks = scheduler_hooks(self)
        comp = hooks.compressor
        if comp is not None:
            comp.before_schedule(self)
        output = original(self, *args, **kwargs)
        if comp is not None:
            comp.after_schedule(output)
        for observer in hooks.observers:
            observer(self, output)
        return output
    return schedule


def _make_allocate_slots(original: Callable) -> Callable:
    def allocate_slots(self, request, *args, **kwargs):
        comp = attached(self, None)
        if comp is None:
            return original(self, request, *args, **kwargs)
        manager = comp.manager
        saved = manager.max_admission_blocks_per_request
        manager.max_admission_blocks_per_request = comp.admission_cap(request)
        kwargs["reserved_blocks"] = kwargs.get("reserved_blocks", 0) + comp.growth_reserve(request)
        try:
            return original(self, request, *args, **kwargs)
        finally:
            manager.max_admission_blocks_per_request = saved
    return allocate_slots


def _make_reserve_prefill_lookahead(original: Callable) -> Callable:
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        comp = scheduler_hooks(self).compressor
        if comp is not None and num_new_tokens > 0:
            limit = comp.chunk_limit(request, num_computed_tokens)
            if limit is not None:
                num_new_tokens = min(num_new_tokens, limit)
        return original(self, request, num_computed_tokens, num_new_tokens)
    return _reserve_prefill_lookahead


def _make_update_states(original: Callable) -> Callable:
    def _update_states(self, scheduler_output):
        result = original(self, scheduler_output)
        comp = worker_compressor(self)
        if comp is not None:
            comp.on_step(self, scheduler_output)
        return result
    return _update_states


def _make_build_metadata(original: Callable) -> Callable:
    from cords_vllm.engine.attention_view import physical_view

    def build_metadata(self, common_attn_metadata, *args, **kwargs):
        owner = attached(self, None)
        if owner is not None:
            comp, runner = owner
            holes = comp.holes(runner.input_batch)
            if holes:
                common_attn_metadata = physical_view(common_attn_metadata, holes, self.kv_cache_spec.block_size)
        return original(self, common_attn_metadata, *args, **kwargs)
    return build_metadata


def _make_max_memory_usage(original: Callable) -> Callable:
    from cords_vllm.compress.plan import BudgetSettings, stream_footprint_blocks

    def _max_memory_usage_bytes_from_groups(vllm_config, kv_cache_groups):
        policy = policy_of(vllm_config)
        if policy is None:
            return original(vllm_config, kv_cache_groups)
        from vllm.v1.core import kv_cache_utils

        groups = [g for g in kv_cache_groups if not getattr(g, "host_resident", False)]
        if not groups:
            return 0
        settings = BudgetSettings(policy.budget, policy.recent, policy.slack)
        max_len = vllm_config.model_config.max_model_len
        blocks = 0
        for group in groups:
            bs = group.kv_cache_spec.block_size
            blocks += min(stream_footprint_blocks(policy.text_limit(max_len), settings, bs), cdiv(max_len, bs))
        return kv_cache_utils._pool_bytes_per_block(vllm_config, groups) * blocks
    return _max_memory_usage_bytes_from_groups


ENGINE_PATCHES: tuple[Patch, ...] = (
    Patch("vllm.v1.core.sched.scheduler:Scheduler.schedule", ("self",), _make_schedule,
          why="no hook between steps may change a running request's blocks: compress before the step allocates",
          upstream="patches/0001-scheduler-kv-compactor-hook.patch"),
    Patch("vllm.v1.core.sched.scheduler:Scheduler._reserve_prefill_lookahead",
          ("self", "request", "num_computed_tokens", "num_new_tokens"), _make_reserve_prefill_lookahead,
          why="a prefill chunk ends wherever the batch's token budget runs out (and a lone request is never "
              "chunked); end it at the request's next compression point, so what a request keeps does not "
              "depend on batching or chunk settings",
          upstream="patches/0005-scheduler-chunk-end-at-compression-points.patch"),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", ("self", "request", "num_new_tokens"),
          _make_allocate_slots, keywords=("reserved_blocks",),
          why="admission reserves a request's whole prompt; cap it at the compressed footprint and keep free "
              "the blocks admitted compressed requests will still grow into",
          upstream="patches/0002-kv-cache-manager-admission-policy.patch"),
    Patch("vllm.v1.core.kv_cache_utils:_max_memory_usage_bytes_from_groups", ("vllm_config", "kv_cache_groups"),
          _make_max_memory_usage,
          why="the start-up check asks the pool to hold one max-model-len request; a request under the policy "
              "holds at most its bounded footprint (max_text_tokens of text + its bounded video), so ask for "
              "that instead and let a stream's logical length exceed the pool"),
    Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states", ("self", "scheduler_output"),
          _make_update_states,
          why="the KV connector's worker hook runs before new block ids are appended and cannot edit rows: "
              "carry out the plans after the step's block ids are applied and before the forward",
          upstream="patches/0003-model-runner-kv-compactor-hook.patch"),
    Patch("vllm.v1.worker.utils:AttentionGroup.build_metadata",
          ("self", "common_attn_metadata", "ubatch_idx", "common_prefix_len"), _make_build_metadata,
          why="attention kernels have no notion of holes in a row: show them compressed rows compacted",
          upstream="patches/0004-attention-null-block-holes.patch"),
)


def install() -> None:
    """Install every engine patch (idempotent). Raises :class:`EngineSignatureError` on a foreign vLLM."""
    install_patches(ENGINE_PATCHES)


__all__ = ["ENGINE_PATCHES", "EngineSignatureError", "install", "installed", "observe_steps", "scheduler_hooks",
           "worker_compressor"]
