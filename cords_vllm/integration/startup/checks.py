"""Start-up checks of the KV policy against the model and the engine settings.

:mod:`cords_vllm.config` validates the policy's JSON on its own; what it cannot know is the model. Without
these checks, settings the model cannot honour start a healthy server and fail at the first request (an
anchor layer the model does not have, frame granularity without M-RoPE frame positions) or silently never
compress (a budget no request can exceed). They run once, right after
vLLM built its ``VllmConfig`` (:mod:`cords_vllm.integration.startup.cli_args`), on the plain values of
:class:`EngineFacts`, so each check is a pure function.

A check that fails raises :class:`~cords_vllm.config.KVPolicyConfigError` (a ``ValueError``): ``LLM(...)``
raises it and ``vllm serve`` exits non-zero with the message. What these checks cannot see: a model whose attention
layers end up in several KV cache groups for a reason its config does not show is refused by the engine when it first
schedules a
request (the groups exist only once the engine core has laid out its KV cache, after start-up).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cords_vllm.compress.kv_codec import UnsupportedKVCacheDtype, check_kv_cache_dtype
from cords_vllm.compress.pipeline import pipeline_anchors
from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError
from cords_vllm.integration.engine_facts import attention_stages_of, model_facts_of
from cords_vllm.selection import selector_class


@dataclass(frozen=True)
class EngineFacts:
    """What the checks need to know about the model and the engine, as plain values."""

    model: str
    num_layers: int
    max_model_len: int
    uses_mrope: bool
    sliding_window: int | None = None
    hybrid: bool = False
    attention_free: bool = False
    #: The flag that turned on micro-batching (``None``: off).
    ubatching: str | None = None
    #: Why vLLM will build Model Runner V2 (``None``: it builds the V1 runner the plugin patches).
    runner_v2: str | None = None
    #: ``--kv-cache-dtype``.
    kv_cache_dtype: str = "auto"
    #: Other settings whose code paths the plugin does not hook: ``(flag, why)`` each.
    unhooked: tuple[tuple[str, str], ...] = ()
    #: Each pipeline stage's attention layers (one range without pipeline parallelism; empty: not known).
    stages: tuple[range, ...] = ()

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> EngineFacts:
        mc = vllm_config.model_config
        stages = tuple(attention_stages_of(vllm_config))
        return cls(
            model=str(mc.model),
            num_layers=stages[-1].stop,
            max_model_len=mc.max_model_len,
            uses_mrope=model_facts_of(vllm_config).finds_frames,
            sliding_window=mc.get_sliding_window(),
            hybrid=bool(mc.is_hybrid),
            attention_free=bool(mc.is_attention_free),
            ubatching=ubatching_flag(vllm_config.parallel_config),
            runner_v2=runner_v2_reason(vllm_config),
            kv_cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto"),
            unhooked=unhooked_settings(vllm_config),
            stages=stages,
        )


def pipeline_change(policy: KVPolicyConfig, stages: Sequence[range]) -> str | None:
    """What pipeline parallelism changes in the policy's anchors, in words for the start-up line, or ``None``
    (one stage, or no change). Each stage selects on its own layers
    (:func:`~cords_vllm.compress.pipeline.pipeline_anchors`): the workers apply and check the same rule."""
    effective = pipeline_anchors(policy.anchors, stages)
    if len(stages) < 2 or effective == policy.anchors:
        return None
    layout = ", ".join(f"{s.start}..{s.stop - 1}" for s in stages)
    return (f"anchors {list(policy.anchors or ())} -> {list(effective or ())} (pipeline parallel, attention layers "
            f"{layout} per stage: each stage selects on its own layers)")


def ubatching_flag(parallel_config: Any) -> str | None:
    """The flag that turned on vLLM's micro-batching (dual-batch overlap), or ``None``."""
    if getattr(parallel_config, "enable_dbo", False):
        return "--enable-dbo"
    if int(getattr(parallel_config, "ubatch_size", 0) or 0) > 1:
        return f"--ubatch-size {parallel_config.ubatch_size}"
    return None


def unhooked_settings(vllm_config: Any) -> tuple[tuple[str, str], ...]:
    """Settings (besides micro-batching and the runner) whose code paths move or split a request's KV where the
    plugin's compaction cannot follow, each as ``(flag, why)``."""
    out = []
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        out.append(("--kv-transfer-config (or --kv-offloading-size)",
                    "a KV connector saves, loads or sends a request's blocks by their logical position, and a "
                    "compressed row's blocks hold other tokens"))
    parallel = vllm_config.parallel_config
    for name, flag in (("decode_context_parallel_size", "--decode-context-parallel-size"),
                       ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            out.append((f"{flag} {size}", "context parallelism interleaves a request's tokens across ranks, and "
                                          "selection reads and compacts whole rows on one rank"))
    return tuple(out)


def runner_v2_reason(vllm_config: Any) -> str | None:
    """Why vLLM will build Model Runner V2 for ``vllm_config`` (its own ``use_v2_model_runner`` rule, which the
    workers read), or ``None`` when it builds the V1 runner. Settings that require V2 win over
    ``VLLM_USE_V2_MODEL_RUNNER=0``, so the reason names them."""
    if not vllm_config.use_v2_model_runner:
        return None
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        return "HiSparse attention (--attention-config hisparse_config) requires it"
    if getattr(vllm_config, "watermark_config", None) is not None:
        return "watermarking (--watermark-config) requires it, whatever VLLM_USE_V2_MODEL_RUNNER says"
    return "VLLM_USE_V2_MODEL_RUNNER selects it"


def check_engine(policy: KVPolicyConfig, facts: EngineFacts) -> None:
    """Refuse settings the model cannot serve (:class:`KVPolicyConfigError`).

    Nothing is checked for ``--kv-policy none``.
    """
    if not policy.enabled:
        return
    check_attention(policy.policy, facts.model, facts.sliding_window, facts.attention_free, facts.hybrid,
                    hybrid_checked=_on_cpu())
    policy.check_model(facts.num_layers)  # anchors, compressed_layers
    check_layer_scope(policy, facts.hybrid, len(facts.stages))
    check_budget(policy.budget, policy.slack, facts.max_model_len)
    check_granularity(policy.granularity, facts.uses_mrope, facts.model)
    check_frame_lengths(policy.policy, facts.uses_mrope, facts.model)
    check_engine_settings(policy.policy, facts.ubatching, facts.runner_v2, facts.unhooked)
    check_kv_dtype(policy.policy, facts.kv_cache_dtype)


def check_layer_scope(policy: KVPolicyConfig, hybrid: bool, num_stages: int) -> None:
    """Refuse layer-selective compression (``compressed_layers``) where its two KV cache groups are not checked:
    beside a hybrid model's state groups (vLLM's page-size unification of three kinds) and under pipeline
    parallelism (vLLM groups the layers of every stage together, so a stage may hold none of the compressed
    group's layers). Both run with every layer compressed."""
    if policy.compressed_layers is None:
        return
    if hybrid:
        where = "a hybrid model (attention beside Gated DeltaNet / Mamba state layers)"
    elif num_stages > 1:
        where = f"pipeline parallelism ({num_stages} stages)"
    else:
        return
    raise KVPolicyConfigError(f"--kv-policy {policy.policy}: kv_policy_config key 'compressed_layers' (layer-selective "
                              f"compression) is not supported on {where}; leave it out to compress every layer",
                              "compressed_layers")


def check_kv_dtype(policy: str, kv_cache_dtype: str) -> None:
    """Refuse a ``--kv-cache-dtype`` whose entries the compress step cannot read and copy (quantised per token
    and head, or packed below 8 bits): see :mod:`cords_vllm.compress.kv_codec`."""
    try:
        check_kv_cache_dtype(kv_cache_dtype, policy)
    except UnsupportedKVCacheDtype as e:
        raise KVPolicyConfigError(str(e)) from None


def check_engine_settings(policy: str, ubatching: str | None, runner_v2: str | None,
                          unhooked: tuple[tuple[str, str], ...] = ()) -> None:
    """Refuse engine settings whose code paths the plugin does not hook, naming the flag.

    Micro-batching renumbers each micro-batch's rows and builds the second one's attention metadata through
    ``update_block_table``, past the hook that hides evicted blocks: compressed rows would read null blocks. Model
    Runner V2 has none of the worker hooks: the scheduler would free compressed blocks that no worker compacts.
    """
    if ubatching is not None:
        raise KVPolicyConfigError(
            f"--kv-policy {policy} does not support micro-batching ({ubatching}): each micro-batch's attention "
            f"metadata bypasses the view that hides evicted blocks. Remove {ubatching.split()[0]}, or serve with "
            f"--kv-policy none")
    if runner_v2 is not None:
        raise KVPolicyConfigError(
            f"--kv-policy {policy} needs vLLM's V1 model runner, but Model Runner V2 would be built: {runner_v2}. "
            f"Remove that setting (and VLLM_USE_V2_MODEL_RUNNER=1), or serve with --kv-policy none")
    if unhooked:  # the first such setting; the message names it
        flag, why = unhooked[0]
        raise KVPolicyConfigError(f"--kv-policy {policy} does not support {flag}: {why}. Remove {flag.split()[0]}, "
                                  "or serve with --kv-policy none")


def _on_cpu() -> bool:
    """Whether the engine runs on vLLM's CPU build (where a compressed hybrid is checked exact)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


#: Set to ``1`` to compress a hybrid model's attention layers on a GPU anyway (experimental: see
#: :func:`check_attention`).
EXPERIMENTAL_HYBRID_ENV = "CORDS_VLLM_EXPERIMENTAL_HYBRID"


def check_attention(policy: str, model: str, sliding_window: int | None, attention_free: bool,
                    hybrid: bool = False, hybrid_checked: bool = False) -> None:
    """The policy compresses one full-attention KV cache: refuse sliding-window and attention-free models, and
    hybrid ones where they are not checked (``hybrid_checked``: vLLM's CPU build) unless
    :data:`EXPERIMENTAL_HYBRID_ENV` is set.

    A hybrid model (Qwen3.5: Gated DeltaNet layers with fixed-size state beside full attention) runs compressed:
    only its attention group is compressed (:func:`~cords_vllm.integration.kv_groups.attention_group_index`),
    its state groups are left alone, blocks come back, and on vLLM 0.32's CPU build its outputs equal the HF
    reference that drops the same tokens as closely as its uncompressed outputs do. No GPU has run it yet, where
    vLLM may also split a hybrid's large attention blocks into smaller kernel blocks: there it stays behind the
    switch until then rather than serving answers nobody has checked.
    """
    if attention_free:
        reason = "has no attention KV cache"
    elif hybrid and not hybrid_checked and os.environ.get(EXPERIMENTAL_HYBRID_ENV, "0") in ("", "0"):
        reason = ("is hybrid (attention beside Gated DeltaNet / Mamba state layers): compressing its attention layers "
                  "is checked exact against the HF reference with the same evictions on vLLM's CPU build only, not "
                  "yet on a GPU, where vLLM may split its attention blocks into smaller kernel blocks (see the "
                  f"README's model families); set {EXPERIMENTAL_HYBRID_ENV}=1 to use it")
    elif sliding_window is not None:
        reason = (f"uses sliding-window attention (sliding_window={sliding_window}); if it can run with full "
                  "attention, add --disable-sliding-window")
    else:
        return
    raise KVPolicyConfigError(f"--kv-policy {policy}: model {model} {reason}; cords-vllm compresses one "
                              "full-attention KV cache")


def check_budget(budget: int, slack: int, max_model_len: int) -> None:
    """Refuse a budget no request can exceed: compression starts above ``budget + slack`` video tokens.

    A budget that only exceeds *some* videos is fine (shorter videos are simply kept whole), so nothing is
    said about typical video lengths, which the server cannot know.
    """
    if budget + slack >= max_model_len:
        raise KVPolicyConfigError(
            f"kv_policy_config key 'budget' ({budget}) + slack ({slack}) = {budget + slack} is not below "
            f"max-model-len ({max_model_len}): a request compresses only once it holds more than budget + slack "
            "video tokens, so nothing would ever be compressed; lower 'budget' (or 'slack') or raise "
            "--max-model-len")


def check_granularity(granularity: str, uses_mrope: bool, model: str) -> None:
    """Frame granularity reads a video's frames from M-RoPE temporal positions or from the placeholder's layout
    (``uses_mrope``: the model's facts find frames either way,
    :attr:`~cords_vllm.model_facts.ModelFacts.finds_frames`)."""
    if granularity == "frame" and not uses_mrope:
        raise KVPolicyConfigError(
            f"kv_policy_config key 'granularity' is 'frame', which reads a video's frames from M-RoPE temporal "
            f"positions (Qwen-VL families) or a known placeholder layout (LLaVA-NeXT-Video), and model {model} has "
            "neither (no M-RoPE); use granularity 'token' or 'block'")


def check_frame_lengths(policy: str, uses_mrope: bool, model: str) -> None:
    """Policies that need the frame length (e.g. ``infinipot_v``) read it from M-RoPE positions too."""
    if selector_class(policy).needs_frame_length and not uses_mrope:
        raise KVPolicyConfigError(
            f"--kv-policy {policy} needs each video's frame length, read from M-RoPE temporal positions "
            f"(Qwen-VL families) or a known placeholder layout (LLaVA-NeXT-Video), and model {model} has neither "
            "(no M-RoPE); choose another policy")
