"""The worker's hooks: what the patched model-runner and attention-group methods call (worker processes).

Each model runner gets its :class:`~cords_vllm.integration.worker.compressor.WorkerCompressor` (``None`` for
``--kv-policy none``: the wrappers then call straight through) the first time a patched method sees it, and
each of its attention groups is tied to it, so the metadata builder of a group finds the compressed rows of its
runner's batch. The wrappers are installed from the one patch table, :mod:`cords_vllm.integration.patch.table`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError
from cords_vllm.integration.patch.attach import Attached
from cords_vllm.integration.worker.attention_view import physical_view
from cords_vllm.integration.worker.compressor import WorkerCompressor
from cords_vllm.integration.worker.positions import shift_positions

_RUNNER_COMPRESSOR: Attached[WorkerCompressor | None] = Attached("model runner's compressor")
#: An attention group's runner and that runner's compressor.
_GROUP_OWNER: Attached[tuple[WorkerCompressor, Any]] = Attached("attention group's runner")


def _create(runner: Any) -> WorkerCompressor | None:
    policy = KVPolicyConfig.from_vllm_config(runner.vllm_config)
    if not policy.enabled:
        return None
    comp = WorkerCompressor(policy, runner)
    for group in runner.attn_groups[comp.group_index]:  # only the compressed KV cache group's builders
        _GROUP_OWNER.set(group, (comp, runner))
    return comp


def worker_compressor(runner: Any) -> WorkerCompressor | None:
    """The model runner's compressor (``None`` without a policy), created on first use."""
    return _RUNNER_COMPRESSOR.get_or_create(runner, lambda: _create(runner))


def attached_compressor(runner: Any) -> WorkerCompressor | None:
    """The runner's compressor if one was created (never creates one: introspection)."""
    return _RUNNER_COMPRESSOR.get(runner)


def check_runner(runner: Any, policy: KVPolicyConfig) -> None:
    """Refuse a model runner the worker hooks do not reach (:class:`KVPolicyConfigError`).

    The hooks wrap vLLM's V1 ``GPUModelRunner`` (the CPU runner subclasses it). Any other runner (Model Runner
    V2, an encoder-only runner, a platform's own) would never compact a row while the scheduler frees the
    evicted blocks, so blocks would be reused under live requests. Checked on the runner the worker built, so it
    holds whatever selected it (the start-up checks name the settings they can see).
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if policy.enabled and not isinstance(runner, GPUModelRunner):
        kind = f"{type(runner).__module__}.{type(runner).__qualname__}"
        raise KVPolicyConfigError(
            f"--kv-policy {policy.policy} needs vLLM's V1 model runner (vllm.v1.worker.gpu_model_runner."
            f"GPUModelRunner or a subclass), but this worker built {kind}: set VLLM_USE_V2_MODEL_RUNNER=0 and remove "
            "settings that require Model Runner V2 (watermarking, HiSparse), or serve with --kv-policy none")


# ------------------------------------------------------------------------------------------------------
# Wrappers (``make(original) -> wrapper``), installed by the patch table.
def make_initialize_from_config(original: Callable) -> Callable:
    def initialize_from_config(self, kv_cache_config):
        check_runner(self.model_runner, KVPolicyConfig.from_vllm_config(self.vllm_config))
        out = original(self, kv_cache_config)
        comp = worker_compressor(self.model_runner)  # the KV cache exists now: built here, not at the first step
        if comp is not None:
            comp.warm_up_kernels(self.model_runner)
        return out
    return initialize_from_config


def make_update_states(original: Callable) -> Callable:
    def _update_states(self, scheduler_output):
        comp = worker_compressor(self)
        if comp is not None:
            comp.sessions.receive(scheduler_output)
        result = original(self, scheduler_output)
        if comp is not None:
            comp.on_step(self, scheduler_output)
        return result
    return _update_states


def make_init_mrope_positions(original: Callable) -> Callable:
    def _init_mrope_positions(self, req_state):
        comp = worker_compressor(self)
        if comp is None or not comp.sessions.mrope_positions(self, req_state):
            original(self, req_state)
    return _init_mrope_positions


def make_prepare_inputs(original: Callable) -> Callable:
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        result = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        comp = worker_compressor(self)
        if comp is not None and not self.uses_mrope:
            shift_positions(self.positions, self.query_start_loc.np, comp.sessions.position_offsets(self.input_batch))
        if comp is not None and comp.capture is not None:
            comp.capture.prepare(self, num_scheduled_tokens)
        return result
    return _prepare_inputs


def make_get_kv_cache_spec(original: Callable) -> Callable:
    def get_kv_cache_spec(self):
        specs = original(self)
        policy = KVPolicyConfig.from_vllm_config(self.vllm_config)
        if policy.enabled and policy.compressed_layers is not None:
            from cords_vllm.integration.kv_groups import full_attention_layers, mark_compressed_layers

            if policy.layer_selective(full_attention_layers(specs)):
                specs = mark_compressed_layers(specs, policy.compressed_layers)
        return specs
    return get_kv_cache_spec


def make_build_metadata(original: Callable) -> Callable:
    def build_metadata(self, common_attn_metadata, *args, **kwargs):
        owner = _GROUP_OWNER.get(self)
        if owner is not None:
            comp, runner = owner
            holes = comp.holes(runner.input_batch)
            if holes:
                common_attn_metadata = physical_view(common_attn_metadata, holes, self.kv_cache_spec.block_size)
        return original(self, common_attn_metadata, *args, **kwargs)
    return build_metadata
