"""The registry: names, construction, parameter errors, introspection, and no engine import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from cords_vllm.selection import (
    ParamSpec,
    Selector,
    available_selectors,
    get_selector,
    selector_class,
    selector_params,
)

NAMES = ["cords", "cords_layerwise", "infinipot", "infinipot_layerwise", "infinipot_v", "k_only", "random", "recency",
         "snapkv", "snapkv_layerwise", "streammem", "streammem_layerwise", "uniform", "v_only", "value_norm"]


def test_names_are_the_kv_policy_choices() -> None:
    assert available_selectors() == NAMES
    assert "none" not in available_selectors()


@pytest.mark.parametrize("name", NAMES)
def test_selectors_are_documented_frozen_dataclasses(name: str) -> None:
    sel = get_selector(name)
    assert isinstance(sel, Selector) and sel.name == name
    assert dataclasses.is_dataclass(sel)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sel.name_that_does_not_exist = 1  # type: ignore[attr-defined]
    doc = type(sel).__doc__ or ""
    assert "Paper" in doc and "Parameters" in doc
    for param in selector_params(name):
        assert param in doc  # every hyper-parameter is described in the docstring
    # Round trip through the parameters.
    assert get_selector(name, **sel.params()) == sel


def test_cords_defaults_and_introspection() -> None:
    sel = get_selector("cords")
    assert sel.params() == {"alpha": 0.25, "eta": 0.25, "lam": 0.25, "eps0": 1e-6, "novelty": "max_cosine",
                            "space": "paper"}
    specs = selector_params("cords")
    assert all(isinstance(s, ParamSpec) for s in specs.values())
    assert specs["alpha"].type is float and specs["alpha"].allowed() == "in [0, 1]"
    assert specs["eps0"].allowed() == "in (0, inf)"
    assert specs["novelty"].choices == ("max_cosine", "exact")
    assert specs["space"].choices == ("paper", "normalized")
    assert selector_params("recency")["sinks"].type is int
    assert selector_params("uniform") == {}
    assert selector_class("cords") is type(sel)


def test_unknown_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown KV selection policy 'corsd'") as err:
        get_selector("corsd")
    for name in NAMES:
        assert name in str(err.value)


def test_unknown_parameter_names_the_key_and_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown parameter 'lambda'.*alpha, eta, lam, eps0, novelty"):
        get_selector("cords", **{"lambda": 0.3})
    with pytest.raises(ValueError, match=r"unknown parameter 'alpha'; allowed parameters: none"):
        get_selector("uniform", alpha=0.3)


@pytest.mark.parametrize(("name", "params", "pattern"), [
    ("cords", {"alpha": 1.5}, r"'alpha' must be in \[0, 1\], got 1.5"),
    ("cords", {"eta": -0.1}, r"'eta' must be in \[0, 1\]"),
    ("cords", {"lam": -1}, r"'lam' must be in \[0, inf\)"),
    ("cords", {"eps0": 0.0}, r"'eps0' must be in \(0, inf\)"),
    ("cords", {"alpha": float("nan")}, r"'alpha' must be in"),
    ("cords", {"alpha": "0.3"}, r"'alpha' must be a number"),
    ("cords", {"alpha": True}, r"'alpha' must be a number"),
    ("cords", {"novelty": "cosine"}, r"'novelty' must be one of 'max_cosine', 'exact'"),
    ("recency", {"sinks": -1}, r"'sinks' must be an integer in \[0, inf\)"),
    ("recency", {"sinks": 1.5}, r"'sinks' must be an integer"),
    ("infinipot_v", {"tar_ratio": 2}, r"'tar_ratio' must be in \[0, 1\]"),
    ("random", {"seed": -3}, r"'seed' must be an integer"),
])
def test_out_of_range_values_name_the_key_and_the_range(name: str, params: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        get_selector(name, **params)


def test_direct_construction_is_validated_too() -> None:
    cls = selector_class("cords")
    with pytest.raises(ValueError, match="alpha"):
        cls(alpha=2.0)
    assert cls(alpha=1).alpha == 1.0 and isinstance(cls(alpha=1).alpha, float)


def test_selection_does_not_import_vllm() -> None:
    code = ("import sys, cords_vllm.selection, cords_vllm.lab.fidelity, cords_vllm.lab.synthetic.kv; "
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.') or m == 'matplotlib']; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", ["snapkv_layerwise", "infinipot_layerwise", "streammem_layerwise", "cords_layerwise"])
def test_layerwise_variants_select_in_every_layer_per_head_unless_told_otherwise(name: str) -> None:
    from cords_vllm.config import KVPolicyConfig

    base = name.removesuffix("_layerwise")
    assert type(get_selector(name)).__mro__[1] is type(get_selector(base))  # the same rule, its own name
    config = KVPolicyConfig.parse(name, None)
    assert config.anchors is None and config.per_head  # every layer, each KV head on its own
    assert config.granularity == ("token" if base == "snapkv" else "auto")  # SnapKV pools at every unit
    assert KVPolicyConfig.parse(base, None).anchors == (0,) and not KVPolicyConfig.parse(base, None).per_head
    mine = KVPolicyConfig.parse(name, {"anchors": [0], "per_head": False})  # the user's settings win
    assert mine.anchors == (0,) and not mine.per_head
