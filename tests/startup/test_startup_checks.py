"""Start-up checks of the KV policy against the model: refused by ``LLM(...)`` before the engine starts."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError, kv_policy_args
from cords_vllm.integration.inprocess.llm import make_llm
from cords_vllm.integration.startup.checks import (
    EngineFacts,
    check_attention,
    check_budget,
    check_engine,
    check_engine_settings,
    check_frame_lengths,
    check_granularity,
    runner_v2_reason,
    ubatching_flag,
)

pytestmark = pytest.mark.engine


def text_only_model(directory: Path, tiny_model: str, **config) -> str:
    """A config-only Qwen2 text checkpoint (no M-RoPE, no weights: the checks refuse before loading)."""
    from transformers import Qwen2Config

    directory.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.symlink(Path(tiny_model) / name, directory / name)
    Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"],
                **config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, tiny_model) -> str:
    return text_only_model(tmp_path_factory.mktemp("text") / "qwen2", tiny_model)


@pytest.fixture(scope="module")
def sliding_window_model(tmp_path_factory, tiny_model) -> str:
    return text_only_model(tmp_path_factory.mktemp("sw") / "qwen2", tiny_model, use_sliding_window=True,
                           sliding_window=64, max_window_layers=0)


def refused(model: str, policy: str = "cords", engine: dict | None = None, **config) -> str:
    """The message of the start-up refusal of ``LLM(model, policy, config)``."""
    with pytest.raises(KVPolicyConfigError) as info:
        make_llm(model, **{**(engine or {}), **kv_policy_args(policy, **config)})
    return str(info.value)


# -- through LLM(...): the real create_engine_config path ------------------------------------------------
def test_anchor_the_model_lacks_is_refused(tiny_model):
    message = refused(tiny_model, anchors=[0, 99])
    assert "'anchors'" in message and "0..3" in message


def test_budget_no_request_can_exceed_is_refused(tiny_model):
    message = refused(tiny_model, budget=8000)  # + default slack 2000 >= max_model_len 8192
    assert "'budget'" in message and "max-model-len (8192)" in message


def test_frame_granularity_without_mrope_is_refused(text_model):
    message = refused(text_model, engine={"limit_mm_per_prompt": {}}, granularity="frame")
    assert "'granularity'" in message and "'token'" in message and "'block'" in message


def test_policy_reading_frame_lengths_without_mrope_is_refused(text_model):
    message = refused(text_model, "infinipot_v", engine={"limit_mm_per_prompt": {}}, granularity="token")
    assert "infinipot_v" in message and "M-RoPE" in message


def test_sliding_window_model_is_refused(sliding_window_model):
    message = refused(sliding_window_model, engine={"limit_mm_per_prompt": {}}, granularity="token")
    assert "sliding_window=64" in message and "--disable-sliding-window" in message


def test_valid_policy_logs_one_startup_line_and_no_warning(tiny_model):
    """The line names the policy, every setting in force (selector defaults too) and the engine changes."""
    from vllm.engine.arg_utils import EngineArgs

    from cords_vllm.plugin import register

    register()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    plugin_logger = logging.getLogger("cords_vllm")
    plugin_logger.addHandler(handler)
    try:
        EngineArgs(model=tiny_model, max_model_len=1024, max_num_batched_tokens=2048,
                   **kv_policy_args("cords", budget=256, anchors=[0, 2], alpha=0.1)).create_engine_config()
    finally:
        plugin_logger.removeHandler(handler)
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(infos) == 1, infos
    line = infos[0]
    for needle in ("--kv-policy cords", '"budget": 256', '"recent": 64', '"slack": 64', '"granularity": "auto"',
                   '"per_head": false', '"anchors": [0, 2]', '"alpha": 0.1', '"eta": 0.25', '"lam": 0.25',
                   "prefix caching only for the requests the policy never compresses"):
        assert needle in line, (needle, line)
    assert warnings == []  # one step may take a whole prompt: chunks end at compression points anyway


# -- the pure checks ----------------------------------------------------------------------------------
FACTS = EngineFacts(model="m", num_layers=4, max_model_len=4096, uses_mrope=True)


def test_pure_checks_refuse_naming_what_to_change():
    with pytest.raises(KVPolicyConfigError, match=r"'budget' \(3000\) \+ slack \(1096\) = 4096.*max-model-len"):
        check_budget(3000, 1096, 4096)
    check_budget(3000, 1095, 4096)  # one token more than budget + slack can be held: compresses
    with pytest.raises(KVPolicyConfigError, match=r"'granularity'.*'token' or 'block'"):
        check_granularity("frame", False, "m")
    for granularity in ("token", "block"):
        check_granularity(granularity, False, "m")
    with pytest.raises(KVPolicyConfigError, match="infinipot_v"):
        check_frame_lengths("infinipot_v", False, "m")
    check_frame_lengths("cords", False, "m")
    for kwargs, needle in (({"attention_free": True}, "no attention"), ({"sliding_window": 128}, "sliding_window=128")):
        with pytest.raises(KVPolicyConfigError, match=needle):
            check_attention("cords", "m", **{"sliding_window": None, "attention_free": False, **kwargs})
    with pytest.raises(KVPolicyConfigError, match="CORDS_VLLM_EXPERIMENTAL_HYBRID=1"):
        check_attention("cords", "m", None, False, hybrid=True)


def test_check_engine_runs_every_check_and_skips_none():
    check_engine(KVPolicyConfig.parse("cords", {"budget": 256}), FACTS)
    check_engine(KVPolicyConfig.parse("none", None), EngineFacts("m", 1, 8, False))
    check_engine(KVPolicyConfig.parse("cords", {"budget": 256, "anchors": "all"}), FACTS)
    with pytest.raises(KVPolicyConfigError, match=r"'anchors'.*0\.\.3"):
        check_engine(KVPolicyConfig.parse("cords", {"budget": 256, "anchors": [4]}), FACTS)


# -- engine settings the adapter does not hook ------------------------------------------------------
def test_micro_batching_and_runner_v2_are_refused_naming_the_flag():
    for flags in ("--enable-dbo", "--ubatch-size 2"):
        with pytest.raises(KVPolicyConfigError, match=f"micro-batching \\({flags}\\).*Remove {flags.split()[0]}"):
            check_engine(KVPolicyConfig.parse("cords", {"budget": 256}),
                         EngineFacts("m", 4, 4096, True, ubatching=flags))
    with pytest.raises(KVPolicyConfigError, match=r"Model Runner V2 would be built: watermarking \(--watermark"):
        check_engine_settings("cords", None, "watermarking (--watermark-config) requires it")
    check_engine_settings("cords", None, None)
    check_engine(KVPolicyConfig.parse("none", None), EngineFacts("m", 4, 4096, True, ubatching="--enable-dbo"))


def test_ubatching_flag_reads_vllms_parallel_config():
    from vllm.config import ParallelConfig

    assert ubatching_flag(ParallelConfig()) is None
    assert ubatching_flag(ParallelConfig(enable_dbo=True)) == "--enable-dbo"
    assert ubatching_flag(ParallelConfig(ubatch_size=2)) == "--ubatch-size 2"


def test_runner_v2_reason_follows_vllms_own_rule(tiny_model, monkeypatch):
    """vLLM's ``use_v2_model_runner`` (what its workers read) decides; the reason names the setting."""
    import vllm.envs as envs
    from vllm.engine.arg_utils import EngineArgs

    cached = envs._is_envs_cache_enabled()  # an engine started earlier in this process caches vLLM's env vars
    envs.disable_envs_cache()
    try:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        config = EngineArgs(model=tiny_model, max_model_len=4096).create_engine_config()  # V2 cannot start on CPU
        assert runner_v2_reason(config) is None
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the rule is read when the workers are built
        assert config.use_v2_model_runner
        assert runner_v2_reason(config) == "VLLM_USE_V2_MODEL_RUNNER selects it"
    finally:
        if cached:
            envs.enable_envs_cache()


def test_a_pool_smaller_than_one_footprint_names_the_footprints_parts(tiny_model):
    """The case a new user hits: a long max-model-len, a small pool and the default max_text_tokens (8192)."""
    mib = 1 << 20
    with pytest.raises(ValueError) as info:
        make_llm(tiny_model, max_model_len=16384, kv_cache_memory_bytes=8 * mib,
                 **kv_policy_args("cords", budget=512))
    message = str(info.value)
    for needle in ("bounded footprint", "max_text_tokens=8192", "budget=512", "slack=", "--kv-cache-memory-bytes"):
        assert needle in message, (needle, message)
    assert "decreasing `max_model_len`" not in message
    # the footprint fits once max_text_tokens is lowered: the engine starts
    make_llm(tiny_model, max_model_len=16384, kv_cache_memory_bytes=8 * mib,
             **kv_policy_args("cords", budget=512, max_text_tokens=1024))
    # without a policy vLLM's own message stands
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(tiny_model, max_model_len=16384, kv_cache_memory_bytes=1 * mib)


def test_layer_selective_pool_holds_a_whole_request_in_its_whole_layers(tiny_model):
    """The layers kept whole need one max-model-len request: a pool that holds every layer's footprint is too small
    once half the layers are whole, and the message says why."""
    mib = 1 << 20
    policy = {"budget": 512, "max_text_tokens": 1024}
    make_llm(tiny_model, max_model_len=16384, kv_cache_memory_bytes=8 * mib, **kv_policy_args("cords", **policy))
    with pytest.raises(ValueError, match=r"compressed_layers \(2\) are kept whole.*16384 tokens"):
        make_llm(tiny_model, max_model_len=16384, kv_cache_memory_bytes=8 * mib,
                 **kv_policy_args("cords", compressed_layers=2, **policy))
    make_llm(tiny_model, max_model_len=2048, kv_cache_memory_bytes=8 * mib,
             **kv_policy_args("cords", compressed_layers=2, **policy))


def test_layer_selective_is_refused_on_hybrid_models_and_pipelines():
    policy = KVPolicyConfig.parse("cords", {"budget": 256, "compressed_layers": 2})
    check_engine(policy, FACTS)
    for facts, where in ((EngineFacts("m", 4, 4096, True, hybrid=True), "hybrid"),
                         (EngineFacts("m", 4, 4096, True, stages=(range(0, 2), range(2, 4))), "pipeline")):
        with pytest.raises(KVPolicyConfigError, match=f"'compressed_layers'.*{where}"):
            check_engine(policy, facts)


def test_a_runner_the_worker_hooks_do_not_reach_is_refused_on_the_runner_built():
    """Whatever selected it, a worker that built anything but vLLM's V1 runner (or a subclass) refuses to allocate
    its KV cache under a policy; under ``none`` it serves."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from cords_vllm.integration.worker.hooks import check_runner, make_initialize_from_config

    class OtherRunner:  # e.g. vllm.v1.worker.gpu.model_runner.GPUModelRunner (V2), which cannot start on CPU
        pass

    class V1Subclass(GPUModelRunner):  # as vLLM's CPUModelRunner
        def __init__(self) -> None:
            pass

    cords = KVPolicyConfig.from_additional_config({"kv_policy": "cords"})
    with pytest.raises(KVPolicyConfigError, match=r"needs vLLM's V1 model runner .* built .*OtherRunner"):
        check_runner(OtherRunner(), cords)
    check_runner(V1Subclass(), cords)
    check_runner(OtherRunner(), KVPolicyConfig.from_additional_config(None))
    calls = []
    worker = type("Worker", (), {"model_runner": OtherRunner(),
                                 "vllm_config": type("C", (), {"additional_config": {"kv_policy": "cords"}})()})()
    with pytest.raises(KVPolicyConfigError):
        make_initialize_from_config(lambda self, cfg: calls.append(cfg))(worker, "kv-cache-config")
    assert calls == []  # refused before the KV cache is allocated


def test_kv_connectors_and_context_parallelism_are_refused_naming_the_flag(tiny_model):
    """Read off the VllmConfig vLLM builds (a KV offloading size becomes a connector there)."""
    from vllm.engine.arg_utils import EngineArgs

    from cords_vllm.integration.startup.checks import unhooked_settings

    assert unhooked_settings(EngineArgs(model=tiny_model, max_model_len=4096).create_engine_config()) == ()
    config = EngineArgs(model=tiny_model, max_model_len=4096, kv_offloading_size=1.0).create_engine_config()
    (flag, _), = unhooked_settings(config)
    assert flag.startswith("--kv-transfer-config")
    with pytest.raises(KVPolicyConfigError, match=r"does not support --kv-transfer-config .*Remove --kv-transfer"):
        check_engine(KVPolicyConfig.parse("cords", {"budget": 256}),
                     EngineFacts("m", 4, 4096, True, unhooked=unhooked_settings(config)))
    check_engine(KVPolicyConfig.parse("none", None), EngineFacts("m", 4, 4096, True, unhooked=(("--x", "y"),)))
    cp = type("C", (), {"kv_transfer_config": None,
                        "parallel_config": type("P", (), {"decode_context_parallel_size": 2})()})()
    assert unhooked_settings(cp)[0][0] == "--decode-context-parallel-size 2"


@pytest.mark.parametrize("setting", [{"enable_dbo": True}, {"ubatch_size": 2}])
def test_micro_batching_asked_for_is_refused_on_every_platform(tiny_model, setting):
    """vLLM's CPU build turns DBO off by itself; asked for with a policy, it is refused all the same (as on CUDA)."""
    with pytest.raises(KVPolicyConfigError, match=r"does not support micro-batching \(--(enable-dbo|ubatch-size 2)\)"):
        make_llm(tiny_model, **setting, **kv_policy_args("cords", budget=256))
