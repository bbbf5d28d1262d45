"""Token access to every KV cache layout of vLLM 0.32's attention backends, checked against each backend's view.

GPU backends (FlashAttention, FlashInfer, Triton attention) hand a layer a logical ``[N, H, bs, 2D]`` view over
a physical tensor in one of the :class:`~vllm.v1.kv_cache_layout.KVCacheLayout` stride orders; the CPU backend
packs ISA-specific tiles. Each accessor must write where the backend's kernels read and read what they wrote.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="reads vLLM's own KV cache layouts; vLLM is not installed")

from vllm.v1.kv_cache_layout import KVCacheLayout

from cords_vllm.compress.kv_access import CPUTileAccessor, PagedAccessor, slots_of
from cords_vllm.integration.worker.cpu_layout import accessor_for_layer, cpu_tile_accessor, probe_cpu_tile_layout

BLOCKS, HEADS, BS, D, LAYERS = 5, 2, 16, 8, 3

def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


#: The CPU attention backend's tiles and its write op exist in vLLM's CPU build only.
cpu_build_only = pytest.mark.skipif(not _cpu_build(), reason="vLLM's CPU attention op exists in its CPU build only")

ISAS = [("vec", torch.float32), ("vec", torch.bfloat16)]
if torch.cpu._is_amx_tile_supported():
    ISAS.append(("amx", torch.bfloat16))


def layer_views(layout: KVCacheLayout, dtype: torch.dtype = torch.float32, blocks: int = BLOCKS,
                block_size: int = BS) -> list[torch.Tensor]:
    """Per-layer logical ``[N, H, bs, 2D]`` views over one physical tensor in ``layout``'s stride order."""
    logical = (LAYERS, blocks, HEADS, block_size, 2 * D)  # [L, B, H, N, C]
    physical = torch.zeros(tuple(logical[i] for i in layout.stride_order), dtype=dtype)
    inverse = [layout.stride_order.index(i) for i in range(5)]
    view = physical.permute(*inverse)
    assert view.shape == logical
    return [view[layer] for layer in range(LAYERS)]


def backend_reads(backend: str, cache: torch.Tensor, layout: KVCacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, bs, H, D]`` keys and values as the backend's own forward expression sees them."""
    if backend == "flashinfer":  # kv_cache.permute(layer_view_order) is the physical [B, H|N, N|H, C] order
        from vllm.v1.attention.backends.utils import get_flashinfer_layout_string

        try:
            name = get_flashinfer_layout_string(layout)
        except AssertionError:
            pytest.skip(f"FlashInfer does not support {layout.name}")
        k, v = cache.permute(*layout.layer_view_order).split(D, dim=-1)
        return (k.transpose(1, 2), v.transpose(1, 2)) if name == "HND" else (k, v)  # -> [B, N, H, D]
    return cache.transpose(1, 2).split(D, dim=-1)  # flash_attn.py / triton_attn.py


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("backend", ["flash_attn", "flashinfer", "triton_attn"])
def test_paged_accessor_matches_every_backend_and_layout(backend: str, layout: KVCacheLayout) -> None:
    views = layer_views(layout)
    layer = type("Attention", (), {"head_size": D})()
    accessor = accessor_for_layer(views[1], layer)
    assert isinstance(accessor, PagedAccessor)
    slots = torch.tensor([3, 17, 40, 79])
    keys, values = torch.randn(4, HEADS, D), torch.randn(4, HEADS, D)
    accessor.write(views[1], slots, keys, values)
    key_cache, value_cache = backend_reads(backend, views[1], layout)
    assert torch.equal(key_cache[slots // BS, slots % BS], keys)
    assert torch.equal(value_cache[slots // BS, slots % BS], values)
    got_k, got_v = accessor.read(views[1], slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    for other in (0, 2):  # the other layers of the shared tensor are untouched
        assert not views[other].any()


@cpu_build_only
@pytest.mark.parametrize(("isa", "dtype"), ISAS)
def test_cpu_tile_accessor_reads_the_backends_writes_and_back(isa: str, dtype: torch.dtype) -> None:
    from vllm import _custom_ops as ops

    blocks, heads, bs, d = 6, 2, 32, 64
    cache = torch.zeros(blocks, heads, bs, 2 * d, dtype=dtype)
    accessor = cpu_tile_accessor(cache, isa)
    assert isinstance(accessor, CPUTileAccessor)
    slots = torch.randperm(blocks * bs)[:100]
    keys, values = torch.randn(100, heads, d).to(dtype), torch.randn(100, heads, d).to(dtype)
    k_tiles, v_tiles = cache.view(blocks, heads, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, k_tiles, v_tiles, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")  # the backend's own write
    got_k, got_v = accessor.read(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    accessor.write(cache, slots[:10], -keys[:10], -values[:10])  # lands where the backend's reader expects it
    assert torch.equal(accessor.read(cache, slots[:10])[0], -keys[:10])


@cpu_build_only
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize(("isa", "dtype"), [i for i in ISAS if i[1] == torch.bfloat16])
def test_cpu_tile_accessor_reads_the_backends_fp8_writes(isa: str, dtype: torch.dtype, kv_cache_dtype: str) -> None:
    """An fp8 cache (``uint8`` bytes): the layout is learnt in fp8 and the codec reads the backend's values."""
    from vllm import _custom_ops as ops

    from cords_vllm.compress.kv_codec import codec_for

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's CPU backend stores fp8 KV only with AVX-512 or AMX")
    blocks, heads, bs, d, scale = 4, 2, 32, 64, 0.5
    cache = torch.zeros(blocks, heads, bs, 2 * d, dtype=torch.uint8)
    accessor = cpu_tile_accessor(cache, isa, dtype, kv_cache_dtype)
    exact = torch.tensor([-4.0, -1.5, -0.5, 0.5, 1.0, 3.0])  # exact in e4m3 and e5m2
    slots = torch.randperm(blocks * bs)[:50]
    pick = torch.randint(0, len(exact), (2, 50, heads, d))
    keys, values = (exact[pick[0]] * scale).to(dtype), (exact[pick[1]] * scale).to(dtype)
    k_tiles, v_tiles = cache.view(blocks, heads, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, k_tiles, v_tiles, slots, isa, k_scale=scale, v_scale=scale,
                                   kv_cache_dtype=kv_cache_dtype)  # the backend's own quantising write
    got_k, got_v = codec_for(kv_cache_dtype, scale, scale).features(*accessor.read(cache, slots))
    assert torch.equal(got_k, keys.float()) and torch.equal(got_v, values.float())
    raw_k, raw_v = accessor.read(cache, slots[:10])
    accessor.write(cache, slots[10:20], raw_k, raw_v)  # raw bytes move as they are
    assert torch.equal(accessor.read(cache, slots[10:20])[0], raw_k)


@cpu_build_only
def test_cpu_layouts_really_differ_between_isas() -> None:
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU")
    vec = probe_cpu_tile_layout("vec", torch.bfloat16, 32, 64)[0]
    amx = probe_cpu_tile_layout("amx", torch.bfloat16, 32, 64)[0]
    assert not torch.equal(vec, amx)  # a hard-coded layout would be wrong on one of them


def test_slots_of_stays_on_the_blocks_device() -> None:
    assert slots_of(torch.tensor([3, 1]), 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert slots_of(torch.tensor([3, 1], device="meta"), 4).device.type == "meta"


def test_paged_accessor_runs_on_the_meta_device() -> None:
    """No host read and no CPU tensor in the GPU accessor: it runs with the cache and slots on ``meta``."""
    cache = torch.empty(BLOCKS, HEADS, BS, 2 * D, device="meta")
    accessor = PagedAccessor.of(cache, D)
    slots = slots_of(torch.tensor([1, 3], device="meta"), BS)
    k, v = accessor.read(cache, slots)
    assert k.device.type == "meta" and k.shape == (2 * BS, HEADS, D)
    accessor.write(cache, slots, k, v)


def test_unknown_layouts_are_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match="cannot address this KV cache layout"):
        accessor_for_layer(torch.zeros(4, 2, 16, 10), type("Attention", (), {"head_size": 8})())
