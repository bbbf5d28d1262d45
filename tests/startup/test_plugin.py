"""The plugin entry point, the version guard and the EngineArgs wiring (in-process, no engine start)."""

import os
from importlib.metadata import entry_points

import pytest

from cords_vllm.integration.patch.version_guard import UnsupportedVLLMError, check_vllm_version, is_supported


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("cords_vllm") == "cords_vllm.plugin:register"


@pytest.mark.parametrize(("version", "ok"), [("0.32.0", True), ("0.32.3+cpu", True), ("0.32", True),
                                             ("0.33.0", False), ("0.3.2", False), ("0.320.0", False)])
def test_version_guard(version, ok):
    assert is_supported(version) is ok
    if not ok:
        with pytest.raises(UnsupportedVLLMError) as info:
            check_vllm_version(version)
        assert version in str(info.value) and "0.32" in str(info.value)


def test_register_is_idempotent_and_adds_flags(tiny_model):
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from cords_vllm.plugin import register

    register()
    wrapped = EngineArgs.add_cli_args
    register()
    assert EngineArgs.add_cli_args is wrapped
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", tiny_model, "--kv-policy", "cords", "--kv-policy-config", '{"budget": 256}'])
    args = AsyncEngineArgs.from_cli_args(ns)
    assert args.additional_config["kv_policy"] == "cords"
    assert args.additional_config["kv_policy_config"]["budget"] == 256
    none = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", tiny_model]))
    assert "kv_policy" not in none.additional_config
    # flags added once even if the group is added twice to one parser
    from cords_vllm.integration.startup.cli_args import add_kv_policy_args

    assert sum(a.dest == "kv_policy" for a in add_kv_policy_args(parser)._actions) == 1


def test_additional_config_form_is_validated_at_engine_creation(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    from cords_vllm.config import KVPolicyConfigError
    from cords_vllm.plugin import register

    register()
    args = EngineArgs(model=tiny_model, additional_config={"kv_policy": "cords",
                                                          "kv_policy_config": {"budgte": 1}})
    with pytest.raises(KVPolicyConfigError, match="budgte"):
        args.create_engine_config()


def test_conflicting_forms_are_rejected():
    from cords_vllm.config import KVPolicyConfigError
    from cords_vllm.integration.startup.cli_args import merge_into_additional_config

    with pytest.raises(KVPolicyConfigError, match="conflicts"):
        merge_into_additional_config({"kv_policy": "uniform"}, "cords", None)
    assert merge_into_additional_config({"x": 1}, "none", None) == {"x": 1}


def test_engine_changes_are_returned_for_the_startup_line(tiny_model, monkeypatch):
    """adjust_engine_args reports each change it made (the CUDA ones checked with the platform faked)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from cords_vllm.config import KVPolicyConfig
    from cords_vllm.integration.startup.engine_args import adjust_engine_args

    policy = KVPolicyConfig.parse("cords", None)
    args = EngineArgs(model=tiny_model)
    assert adjust_engine_args(args, KVPolicyConfig()) == []
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    changes = adjust_engine_args(args, policy)
    assert [c.split(" (")[0] for c in changes] == ["V1 model runner", "piecewise CUDA graphs"]
    assert args.enable_prefix_caching is None  # left to vLLM: the requests the policy may compress bypass the cache
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert adjust_engine_args(args, policy) == []  # nothing left to change
