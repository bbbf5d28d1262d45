"""The typed KV policy configuration: defaults, validation messages, layer schedule."""

import pytest

from cords_vllm.config import (
    KVPolicyConfig,
    KVPolicyConfigError,
    available_policies,
    kv_policy_args,
)

BASELINES = {"cords", "uniform", "recency", "value_norm", "k_only", "v_only", "random", "infinipot_v"}


def test_registry_lists_none_first_then_every_selector():
    names = available_policies()
    assert names[0] == "none"
    assert set(names) >= BASELINES


def test_defaults():
    cfg = KVPolicyConfig.parse("cords", None)
    assert (cfg.budget, cfg.recent, cfg.slack, cfg.granularity, cfg.per_head, cfg.anchors) == (
        2048, 512, 512, "auto", False, (0,))
    assert cfg.modalities == ("image", "video")  # frames sent as images are compressed too
    assert cfg.enabled
    assert not KVPolicyConfig.parse(None, None).enabled


def test_modalities_choose_the_candidates():
    assert KVPolicyConfig.parse("cords", {"modalities": ["video"]}).modalities == ("video",)
    assert KVPolicyConfig.parse("cords", {"modalities": "image"}).modalities == ("image",)
    both = KVPolicyConfig.parse("cords", {"modalities": ["video", "image"]})
    assert both.modalities == ("image", "video") and both.to_json()["modalities"] == ["image", "video"]


def test_roundtrip_through_json():
    cfg = KVPolicyConfig.parse("cords", '{"budget": 1024, "anchors": [0, 2], "alpha": 0.5}')
    again = KVPolicyConfig.parse("cords", cfg.to_json())
    assert again == cfg
    assert cfg.params == {"alpha": 0.5}


def test_settings_are_everything_in_force():
    """What the start-up line shows: the engine keys and every selector hyper-parameter, defaults included."""
    cfg = KVPolicyConfig.parse("cords", '{"budget": 1024, "alpha": 0.5}')
    settings = cfg.settings()
    assert settings["budget"] == 1024 and settings["recent"] == 256 and settings["anchors"] == [0]
    assert settings["alpha"] == 0.5 and settings["eta"] == 0.25 and settings["lam"] == 0.25
    assert KVPolicyConfig.parse("cords", settings).settings() == settings  # pasted back as --kv-policy-config
    assert KVPolicyConfig.parse("none", None).settings() == {}


@pytest.mark.parametrize(("config", "needle"), [
    ('{"budgett": 10}', "budgett"),
    ('{"budget": 0}', "budget"),
    ('{"budget": 256, "recent": 256}', "recent"),
    ('{"slack": -1}', "slack"),
    ('{"granularity": "pixel"}', "granularity"),
    ('{"per_head": 1}', "per_head"),
    ('{"anchors": []}', "anchors"),
    ('{"anchors": [1, 1]}', "anchors"),
    ('{"alpha": 7}', "alpha"),
    ('{"modalities": []}', "modalities"),
    ('{"modalities": ["audio"]}', "modalities"),
    ('{"modalities": ["image", "image"]}', "modalities"),
    ("[1, 2]", "JSON object"),
    ("{budget: 1}", "not valid JSON"),
])
def test_bad_config_names_the_key(config, needle):
    with pytest.raises(KVPolicyConfigError, match=needle):
        KVPolicyConfig.parse("cords", config)


def test_unknown_policy_lists_choices():
    with pytest.raises(KVPolicyConfigError, match="cords") as info:
        KVPolicyConfig.parse("bogus", None)
    assert "bogus" in str(info.value)


def test_config_without_policy_is_rejected():
    with pytest.raises(KVPolicyConfigError, match="kv_policy is 'none'"):
        KVPolicyConfig.parse("none", '{"budget": 64}')


def test_layer_schedule():
    one = KVPolicyConfig.parse("cords", {"anchors": [2]})
    assert KVPolicyConfig.parse("cords", {"anchors": 2}).anchors == one.anchors == (2,)
    assert [one.anchor_of(layer, 4) for layer in range(4)] == [2, 2, 2, 2]
    several = KVPolicyConfig.parse("cords", {"anchors": [0, 2]})
    assert [several.anchor_of(layer, 4) for layer in range(4)] == [0, 0, 2, 2]
    every = KVPolicyConfig.parse("cords", {"anchors": "all"})
    assert [every.anchor_of(layer, 4) for layer in range(4)] == [0, 1, 2, 3]
    with pytest.raises(KVPolicyConfigError, match="anchors"):
        KVPolicyConfig.parse("cords", {"anchors": [5]}).check_model(4)


def test_kv_policy_args_is_the_additional_config_form():
    kwargs = kv_policy_args("uniform", budget=256)
    assert kwargs == {"additional_config": {"kv_policy": "uniform", "kv_policy_config": {"budget": 256}}}
    assert KVPolicyConfig.from_additional_config(kwargs["additional_config"]).budget == 256
    with pytest.raises(KVPolicyConfigError):
        kv_policy_args("uniform", nope=1)


def test_lambda_is_an_alias_of_lam():
    assert KVPolicyConfig.parse("cords", {"lambda": 0.5}).params == {"lam": 0.5}
    with pytest.raises(KVPolicyConfigError, match="not both"):
        KVPolicyConfig.parse("cords", {"lambda": 0.5, "lam": 0.5})
