"""Reading tokens back from vLLM's packed CPU KV cache, for every ISA layout available here."""

from __future__ import annotations

import pytest
import torch

from cords_vllm.engine.kv_layout import KVLayout, probe_cpu_tile_layout, slots_of

ISAS = [("vec", torch.float32), ("vec", torch.bfloat16)]
if torch.cpu._is_amx_tile_supported():
    ISAS.append(("amx", torch.bfloat16))


@pytest.mark.parametrize(("isa", "dtype"), ISAS)
def test_write_then_read_recovers_tokens(isa, dtype):
    from vllm import _custom_ops as ops

    blocks, heads, bs, d = 6, 2, 32, 64
    cache = torch.zeros(blocks, heads, bs, 2 * d, dtype=dtype)
    layout = KVLayout("cpu", bs, heads, d, isa)
    slots = torch.randperm(blocks * bs)[:100]
    keys = torch.randn(100, heads, d).to(dtype)
    values = torch.randn(100, heads, d).to(dtype)
    k_tiles, v_tiles = cache.view(blocks, heads, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, k_tiles, v_tiles, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")  # the backend's own write
    got_k, got_v = layout.read(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    # and our write lands where the backend's reader expects it
    layout.write(cache, slots[:10], -keys[:10], -values[:10])
    assert torch.equal(layout.read(cache, slots[:10])[0], -keys[:10])


def test_layouts_really_differ_between_isas():
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU")
    vec = probe_cpu_tile_layout("vec", torch.bfloat16, 32, 64)[0]
    amx = probe_cpu_tile_layout("amx", torch.bfloat16, 32, 64)[0]
    assert not torch.equal(vec, amx)  # a hard-coded layout would be wrong on one of them


def test_slots_of():
    assert slots_of([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert slots_of([3, 1], 4, 5).tolist() == [12, 13, 14, 15, 4]


@pytest.mark.parametrize("strided", [False, True])
def test_flash_layout_matches_the_backends_own_view(strided):
    """FlashAttention (vLLM 0.32) reads ``kv_cache.transpose(1, 2).split(D, -1)``; no GPU needed to check it."""
    blocks, heads, bs, d = 5, 2, 16, 32
    if strided:  # the physical order may differ from the logical [N, H, bs, 2D] (kv cache stride order)
        cache = torch.zeros(blocks, bs, heads, 2 * d).permute(0, 2, 1, 3)
    else:
        cache = torch.zeros(blocks, heads, bs, 2 * d)
    layer = type("FlashLayer", (), {"head_size": d})()
    layout = KVLayout.for_layer(cache, layer)
    assert layout.backend == "flash"
    slots = torch.tensor([3, 17, 40, 79])
    keys, values = torch.randn(4, heads, d), torch.randn(4, heads, d)
    layout.write(cache, slots, keys, values)
    key_cache, value_cache = cache.transpose(1, 2).split(d, dim=-1)  # [N, bs, H, D], as the backend reads it
    assert torch.equal(key_cache[slots // bs, slots % bs], keys)
    assert torch.equal(value_cache[slots // bs, slots % bs], values)
    got_k, got_v = layout.read(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
