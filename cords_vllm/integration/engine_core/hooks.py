"""The scheduler's hooks: what the patched ``Scheduler`` and ``KVCacheManager`` methods call (engine core).

Each scheduler gets one :class:`SchedulerHooks` the first time a patched method sees it: its compressor
(``None`` for ``--kv-policy none``: every wrapper then calls straight through), its publisher and its step
observers. The wrappers are installed from the one patch table, :mod:`cords_vllm.integration.patch.table`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError
from cords_vllm.integration.engine_core.ending import RequestEnder
from cords_vllm.integration.engine_core.observers import HeldKVObserver, StepObserver
from cords_vllm.integration.engine_core.scheduler import SchedulerCompressor
from cords_vllm.integration.handoff import engine_policy, failures
from cords_vllm.integration.handoff.published import Publisher
from cords_vllm.integration.patch.attach import Attached
from cords_vllm.utils import cdiv


def policy_of(vllm_config: Any) -> KVPolicyConfig | None:
    """The enabled policy of an engine (``None`` for ``--kv-policy none``)."""
    config = KVPolicyConfig.from_vllm_config(vllm_config)
    return config if config.enabled else None


@dataclass
class SchedulerHooks:
    """Per-scheduler plugin state: its compressor (``None`` without a policy), publisher, the requests it ends
    and its step observers."""

    compressor: SchedulerCompressor | None
    publisher: Publisher
    ender: RequestEnder
    observers: list[StepObserver] = field(default_factory=list)


_SCHEDULER_HOOKS: Attached[SchedulerHooks] = Attached("scheduler hooks")
_MANAGER_COMPRESSOR: Attached[SchedulerCompressor | None] = Attached("KV cache manager's compressor")


def _create_hooks(scheduler: Any) -> SchedulerHooks:
    policy = policy_of(scheduler.vllm_config)
    if policy is not None and engine_policy.announced() == "none":
        # its workers were started without the policy's hooks: compressing here would free blocks they still read
        raise KVPolicyConfigError(
            f"this engine runs --kv-policy {policy.policy}, but its processes were started as for --kv-policy none "
            f"({engine_policy.ENV}=none): build the engine through EngineArgs (vllm serve, LLM(...)), which "
            "announces its policy, or set the variable to the policy's name")
    publisher = Publisher("scheduler")
    compressor = SchedulerCompressor(policy, scheduler, publisher) if policy else None
    _MANAGER_COMPRESSOR.set(scheduler.kv_cache_manager, compressor)
    if compressor is not None:
        failures.scheduler_here()  # a worker in this process hands it the requests whose compression failed
    ender = RequestEnder(publisher, scheduler.vllm_config.model_config.max_model_len)
    return SchedulerHooks(compressor, publisher, ender, [HeldKVObserver(compressor, publisher)])


def scheduler_hooks(scheduler: Any) -> SchedulerHooks:
    """The scheduler's :class:`SchedulerHooks`, created (with its compressor) on first use."""
    return _SCHEDULER_HOOKS.get_or_create(scheduler, lambda: _create_hooks(scheduler))


def observe_steps(scheduler: Any, observer: StepObserver) -> Callable[[], None]:
    """Call ``observer(scheduler, output)`` after every step of ``scheduler``; returns an unsubscribe."""
    observers = scheduler_hooks(scheduler).observers
    observers.append(observer)
    return lambda: observers.remove(observer)


# ------------------------------------------------------------------------------------------------------
# Wrappers (``make(original) -> wrapper``), installed by the patch table.
def make_schedule(original: Callable) -> Callable:
    def schedule(self, *args, **kwargs):
        hooks = scheduler_hooks(self)
        comp = hooks.compressor
        hooks.ender.end_unservable(self, comp.invalid_reason if comp is not None else None)
        if comp is not None:
            comp.failed.update(failures.drain())  # compressions a worker of this process could not carry out
            comp.before_schedule(self)
            if comp.caching:  # before vLLM looks waiting requests up in the prefix cache
                for request in [*self.waiting, *self.kv_holding_waiting]:
                    comp.before_admission(request)
            for req_id, reason in comp.failed.items():  # the policy failed on these: each ends alone
                if (request := self.requests.get(req_id)) is not None:
                    hooks.ender.end(self, request, reason)
            comp.failed.clear()
        output = original(self, *args, **kwargs)
        if comp is not None:
            comp.after_schedule(output)
        for observer in hooks.observers:
            observer(self, output)
        return output
    return schedule


def make_allocate_slots(original: Callable) -> Callable:
    def allocate_slots(self, request, *args, **kwargs):
        comp = _MANAGER_COMPRESSOR.get(self)
        if comp is None:
            return original(self, request, *args, **kwargs)
        manager = comp.manager
        saved = manager.max_admission_blocks_per_request
        manager.max_admission_blocks_per_request = comp.admission_cap(request)
        kwargs["reserved_blocks"] = kwargs.get("reserved_blocks", 0) + comp.growth_reserve(request)
        if comp.caching and comp.may_compress(request):
            kwargs["delay_cache_blocks"] = True  # vLLM's own switch: allocate without filling the prefix cache
        try:
            return original(self, request, *args, **kwargs)
        finally:
            manager.max_admission_blocks_per_request = saved
    return allocate_slots


def make_reserve_prefill_lookahead(original: Callable) -> Callable:
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        comp = scheduler_hooks(self).compressor
        if comp is not None and num_new_tokens > 0:
            limit = comp.chunk_limit(request, num_computed_tokens)
            if limit is not None:
                num_new_tokens = min(num_new_tokens, limit)
        return original(self, request, num_computed_tokens, num_new_tokens)
    return _reserve_prefill_lookahead


def make_max_memory_usage(original: Callable) -> Callable:
    def _max_memory_usage_bytes_from_groups(vllm_config, kv_cache_groups):
        policy = policy_of(vllm_config)
        if policy is None:
            return original(vllm_config, kv_cache_groups)
        groups = [g for g in kv_cache_groups if not getattr(g, "host_resident", False)]
        if not groups:
            return 0
        from cords_vllm.integration.kv_groups import whole_group_indices

        max_len = vllm_config.model_config.max_model_len
        whole = set(whole_group_indices([g.kv_cache_spec for g in groups]))  # layer-selective: need max-model-len
        blocks = 0
        for index, group in enumerate(groups):
            bs = group.kv_cache_spec.block_size
            full = cdiv(max_len, bs)
            blocks += full if index in whole else min(policy.stream_footprint_blocks(max_len, bs), full)
        from vllm.v1.core import kv_cache_utils  # the module this wrapper patches: imported already

        return kv_cache_utils._pool_bytes_per_block(vllm_config, groups) * blocks
    return _max_memory_usage_bytes_from_groups


def make_check_enough_kv_cache_memory(original: Callable) -> Callable:
    def _check_enough_kv_cache_memory(available_memory, get_needed_memory, max_model_len, estimate_max_model_len):
        try:
            return original(available_memory, get_needed_memory, max_model_len, estimate_max_model_len)
        except ValueError as exc:
            policy_bound = _policy_bound(get_needed_memory)
            if policy_bound is None or available_memory <= 0:
                raise
            raise ValueError(footprint_message(*policy_bound, available_memory, get_needed_memory())) from exc
    return _check_enough_kv_cache_memory


def _policy_bound(get_needed_memory: Any) -> tuple[KVPolicyConfig, int, int] | None:
    """``(policy, max_model_len, block_size)`` when the start-up check sizes a request by the policy's footprint:
    vLLM passes ``partial(_max_memory_usage_bytes_from_groups, vllm_config, groups)``."""
    args = getattr(get_needed_memory, "args", ())
    if len(args) != 2 or not hasattr(args[0], "model_config") or not args[1]:
        return None
    policy = policy_of(args[0])
    if policy is None:
        return None
    return policy, args[0].model_config.max_model_len, min(g.kv_cache_spec.block_size for g in args[1])


def footprint_message(policy: KVPolicyConfig, max_model_len: int, block_size: int, available: int,
                      needed: int) -> str:
    """Why one request's bounded footprint does not fit the KV cache, with the plugin's knobs that shrink it."""
    text = policy.text_limit(max_model_len)
    settings = policy.budget_settings
    blocks = policy.stream_footprint_blocks(max_model_len, block_size)
    gib = 1 << 30
    whole = ("" if policy.compressed_layers is None else
             f" Here the layers above compressed_layers ({policy.compressed_layers}) are kept whole, and each holds a "
             f"whole --max-model-len request ({max_model_len} tokens) besides: lower --max-model-len, or compress more "
             "layers.")
    return (f"--kv-policy {policy.policy}: one request's bounded footprint does not fit the KV cache: {blocks} blocks "
            f"of {block_size} tokens ({needed / gib:.3f} GiB; text max_text_tokens={text} + budget="
            f"{settings.budget} + slack={settings.slack} + 2 blocks) against {available / gib:.3f} GiB available. "
            f"Lower kv_policy_config 'max_text_tokens' (the protected text one request may hold; default "
            f"min(max-model-len, 8192)), 'budget' or 'slack' in --kv-policy-config, or give the KV cache more "
            f"memory (--gpu-memory-utilization, --kv-cache-memory-bytes). --max-model-len does not change the "
            f"footprint beyond capping max_text_tokens.{whole}")


def make_update_request_as_session(original: Callable) -> Callable:
    def _update_request_as_session(self, session, update):
        comp = scheduler_hooks(self).compressor
        if comp is None:
            return original(self, session, update)
        comp.before_session_update(self, session)
        result = original(self, session, update)
        comp.after_session_update(session)
        return result
    return _update_request_as_session


def make_preempt_request(original: Callable) -> Callable:
    def _preempt_request(self, request, timestamp, *args, **kwargs):
        result = original(self, request, timestamp, *args, **kwargs)
        hooks = scheduler_hooks(self)
        if hooks.compressor is not None and (reason := hooks.compressor.preemption_reason(request)) is not None:
            hooks.ender.end(self, request, reason)
        return result
    return _preempt_request
