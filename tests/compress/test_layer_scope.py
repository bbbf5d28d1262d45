"""The layer scope's pure rules (:mod:`cords_vllm.compress.layer_scope`); the layout is checked against vLLM's own
grouping in ``tests/engine/test_layer_selective.py``."""

from __future__ import annotations

import pytest

from cords_vllm.compress.layer_scope import describe, kv_cache_layout, scope_problem
from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError


def test_the_papers_bottom_quarter_of_qwen2_vl_7b():
    layout = kv_cache_layout(7, 28)
    assert (layout.group_size, layout.compressed_groups, layout.whole_groups, layout.padding_layers) == (7, 1, 3, 0)
    # 7 layers hold 512 kept tokens, 21 hold all 8,192: layer-token pages, as vLLM's pool counts them
    assert layout.layer_tokens(512, 8192) == 7 * 512 + 21 * 8192
    assert scope_problem(7, 28) is None
    assert "0..6 compressed, 7..27 whole" in describe(7, 28)


@pytest.mark.parametrize("layers", [4, 12, 28, 36])
def test_compressed_layers_form_one_group_below_six_tenths(layers):
    for compressed in range(1, layers + 1):
        problem = scope_problem(compressed, layers)
        one_group = kv_cache_layout(compressed, layers).compressed_groups == 1
        assert (problem is None) == one_group
        assert one_group == (compressed == layers or compressed < 1.5 * (layers - compressed))


def test_padding_when_the_whole_layers_do_not_divide():
    layout = kv_cache_layout(6, 28)  # 22 whole layers in groups of 6: 4 groups, 2 padding layers
    assert (layout.group_size, layout.whole_groups, layout.padding_layers) == (6, 4, 2)
    assert "2 padding layers" in describe(6, 28)
    # near-equal counts: the larger sets the group size and the smaller is padded
    assert (kv_cache_layout(16, 28).group_size, kv_cache_layout(16, 28).padding_layers) == (16, 4)


def test_too_many_compressed_layers_are_refused_with_the_most_that_fits():
    problem = scope_problem(3, 4)
    assert problem is not None and "at most 2 of the 4 layers" in problem
    assert "has 4 attention layers" in scope_problem(5, 4)
    with pytest.raises(ValueError):
        kv_cache_layout(0, 4)


def test_config_key_and_its_checks():
    config = KVPolicyConfig.parse("cords", {"compressed_layers": 7})
    assert config.compressed_layers == 7 and config.to_json()["compressed_layers"] == 7
    assert KVPolicyConfig.parse("cords", config.to_json()) == config
    assert "compressed_layers" not in KVPolicyConfig.parse("cords", {}).to_json()
    assert config.layer_selective(28) and not config.layer_selective(7)
    config.check_model(28)
    for bad in (0, -1, 2.5, "7", True):
        with pytest.raises(KVPolicyConfigError, match="compressed_layers"):
            KVPolicyConfig.parse("cords", {"compressed_layers": bad})
    with pytest.raises(KVPolicyConfigError, match=r"names layer 7, but the compressed layers are 0\.\.6"):
        KVPolicyConfig.parse("cords", {"compressed_layers": 7, "anchors": [0, 7]}).check_model(28)
    with pytest.raises(KVPolicyConfigError, match="at most 16 of the 28"):
        KVPolicyConfig.parse("cords", {"compressed_layers": 20}).check_model(28)
    KVPolicyConfig.parse("cords", {"compressed_layers": 28, "anchors": [27]}).check_model(28)  # all: every anchor
