"""The plugin entry point, the version guard and the EngineArgs wiring (in-process, no engine start)."""

from importlib.metadata import entry_points

import pytest

from cords_vllm.version_guard import UnsupportedVLLMError, check_vllm_version, is_supported


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
    from cords_vllm.cli_args import add_kv_policy_args

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
    from cords_vllm.cli_args import merge_into_additional_config
    from cords_vllm.config import KVPolicyConfigError

    with pytest.raises(KVPolicyConfigError, match="conflicts"):
        merge_into_additional_config({"kv_policy": "uniform"}, "cords", None)
    assert merge_into_additional_config({"x": 1}, "none", None) == {"x": 1}


def test_engine_patches_refuse_a_foreign_signature():
    from cords_vllm.engine.patches import EngineSignatureError, _check_signature

    class Foreign:
        def schedule(self, budget):  # not vLLM 0.32's Scheduler.schedule(self, throttle_prefills)
            return budget

    _check_signature(Foreign, "schedule", ("self",))
    with pytest.raises(EngineSignatureError, match=r"Foreign\.schedule"):
        _check_signature(Foreign, "schedule", ("self", "throttle_prefills"))
    with pytest.raises(EngineSignatureError, match="reserved_blocks"):
        _check_signature(Foreign, "schedule", ("self",), keywords=("reserved_blocks",))


def test_engine_patches_are_installed_once():
    from vllm.v1.core.sched.scheduler import Scheduler

    from cords_vllm.engine import patches

    patches.install()
    first = Scheduler.schedule
    patches.install()
    assert Scheduler.schedule is first
    assert getattr(first, "_cords_vllm_patch", False)
