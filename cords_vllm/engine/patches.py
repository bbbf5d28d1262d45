"""The runtime patches the KV policy needs in vLLM 0.32, in one place.

vLLM 0.32 has no extension point for evicting tokens from a running request's paged KV cache. Each patch
below wraps one engine method, says what vLLM lacks, and is:

* **version-guarded**: the wrapped function's parameter names are checked against the 0.32 signature when
  the plugin loads; a mismatch refuses to start (naming the function) instead of misbehaving;
* **idempotent**: a marker attribute on the wrapper, so loading the plugin twice in a process is harmless;
* **off with ``--kv-policy none``**: each wrapper looks up the engine object's policy once (cached on the
  object) and calls straight through when there is none.

The same changes, as upstream would make them, are the patch series in ``patches/`` at the repository root.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from cords_vllm.config import KVPolicyConfig

logger = logging.getLogger(__name__)

_MARK = "_cords_vllm_patch"
_UNSET = object()


class EngineSignatureError(RuntimeError):
    """A patched vLLM function does not have the signature the plugin was written against."""


def _check_signature(owner: type, name: str, params: tuple[str, ...], keywords: tuple[str, ...] = ()) -> Callable:
    fn = getattr(owner, name)
    fn = getattr(fn, "__wrapped__", fn) if getattr(fn, _MARK, False) else fn
    got = tuple(inspect.signature(fn).parameters)
    if got[: len(params)] != params or not set(keywords) <= set(got):
        raise EngineSignatureError(
            f"cords-vllm: {owner.__module__}.{owner.__qualname__}.{name}{got} does not match the vLLM 0.32 "
            f"signature {params} (+ keywords {keywords}) it patches; this vLLM build is not supported")
    return fn


def _wrap(owner: type, name: str, params: tuple[str, ...], make: Callable[[Callable], Callable],
          keywords: tuple[str, ...] = ()) -> None:
    current = getattr(owner, name)
    if getattr(current, _MARK, False):
        return
    original = _check_signature(owner, name, params, keywords)
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


def policy_of(obj: Any, vllm_config: Any) -> KVPolicyConfig | None:
    """The enabled policy of an engine object (cached on it), or ``None``."""
    cached = obj.__dict__.get("_cords_policy", _UNSET)
    if cached is _UNSET:
        config = KVPolicyConfig.from_vllm_config(vllm_config)
        cached = config if config.enabled else None
        obj.__dict__["_cords_policy"] = cached
    return cached


# ------------------------------------------------------------------------------------------------------
# Scheduler: decide compressions before the step allocates (vLLM has no hook between steps that may
# change a running request's blocks).
# ------------------------------------------------------------------------------------------------------
def _patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from cords_vllm.engine.scheduler import SchedulerCompressor

    def compressor(sched: Any) -> SchedulerCompressor | None:
        comp = sched.__dict__.get("_cords_compressor", _UNSET)
        if comp is _UNSET:
            policy = policy_of(sched, sched.vllm_config)
            comp = SchedulerCompressor(policy, sched) if policy else None
            sched.__dict__["_cords_compressor"] = comp
            if comp is not None:
                sched.kv_cache_manager.__dict__["_cords_compressor"] = comp
        return comp

    def make_schedule(original: Callable) -> Callable:
        def schedule(self, *args, **kwargs):
            comp = compressor(self)
            if comp is None:
                return original(self, *args, **kwargs)
            comp.before_schedule(self)
            output = original(self, *args, **kwargs)
            comp.after_schedule(output)
            return output
        return schedule

    _wrap(Scheduler, "schedule", ("self",), make_schedule)


# ------------------------------------------------------------------------------------------------------
# KV cache manager: admission reserves a request's whole prompt; cap it at the compressed footprint
# (vLLM's cap, ``max_admission_blocks_per_request``, is per manager and meant for sliding windows) and keep
# free the blocks admitted compressed requests will still grow into (``reserved_blocks``).
# ------------------------------------------------------------------------------------------------------
def _patch_admission() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def make_allocate_slots(original: Callable) -> Callable:
        def allocate_slots(self, request, *args, **kwargs):
            comp = self.__dict__.get("_cords_compressor")
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

    _wrap(KVCacheManager, "allocate_slots", ("self", "request", "num_new_tokens"), make_allocate_slots,
          keywords=("reserved_blocks",))


# ------------------------------------------------------------------------------------------------------
# Model runner: carry out the plans after the step's block ids are applied and before the forward
# (vLLM's KV connector worker hook runs before new block ids are appended and cannot edit rows).
# ------------------------------------------------------------------------------------------------------
def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from cords_vllm.engine.worker import WorkerCompressor

    def make_update_states(original: Callable) -> Callable:
        def _update_states(self, scheduler_output):
            result = original(self, scheduler_output)
            comp = self.__dict__.get("_cords_worker", _UNSET)
            if comp is _UNSET:
                policy = policy_of(self, self.vllm_config)
                comp = WorkerCompressor(policy, self) if policy else None
                self.__dict__["_cords_worker"] = comp
                if comp is not None:
                    for groups in self.attn_groups:
                        for group in groups:
                            group.__dict__["_cords_view"] = True
            if comp is not None:
                comp.on_step(self, scheduler_output)
            return result
        return _update_states

    _wrap(GPUModelRunner, "_update_states", ("self", "scheduler_output"), make_update_states)


# ------------------------------------------------------------------------------------------------------
# Attention metadata: kernels must see compressed rows compacted (no "holes" concept in vLLM's kernels).
# ------------------------------------------------------------------------------------------------------
def _patch_attention_metadata() -> None:
    from vllm.v1.worker.utils import AttentionGroup

    from cords_vllm.engine.attention_view import physical_view

    def make_build_metadata(original: Callable) -> Callable:
        def build_metadata(self, common_attn_metadata, *args, **kwargs):
            if self.__dict__.get("_cords_view"):
                common_attn_metadata = physical_view(common_attn_metadata, self.kv_cache_spec.block_size)
            return original(self, common_attn_metadata, *args, **kwargs)
        return build_metadata

    _wrap(AttentionGroup, "build_metadata", ("self", "common_attn_metadata", "ubatch_idx", "common_prefix_len"),
          make_build_metadata)


def install() -> None:
    """Install every engine patch (idempotent). Raises :class:`EngineSignatureError` on a foreign vLLM."""
    _patch_scheduler()
    _patch_admission()
    _patch_model_runner()
    _patch_attention_metadata()
