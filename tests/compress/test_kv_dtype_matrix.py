"""Every CUDA backend layout x every KV dtype a policy supports, through the accessors and the compress step.

The physical cache of each layout is laid out with vLLM's own stride order (:class:`KVCacheLayout`), in the
storage dtype vLLM allocates for each ``--kv-cache-dtype`` (``uint8`` for fp8), and read back through each backend's
own K/V split (and, for fp8, its re-typing to ``float8_e4m3fn`` / ``float8_e5m2`` with the layer's scale).

* Selection reads the values the kernels read: the kept tokens are those selected on a float32 cache holding the
  dequantised values.
* The kept entries are moved as stored: every byte of a kept token equals its source's, scales untouched.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="reads vLLM's own KV cache layouts; vLLM is not installed")

from vllm.v1.kv_cache_layout import KVCacheLayout

from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.kv_codec import (
    FP8_KV_CACHE_DTYPES,
    SUPPORTED_KV_CACHE_DTYPES,
    Fp8Codec,
    PlainCodec,
    UnsupportedKVCacheDtype,
    check_kv_cache_dtype,
    codec_for,
)
from cords_vllm.compress.step import RegionBatch, SelectionSetup, compress_region
from cords_vllm.selection import get_selector
from tests.compress.test_kv_access import HEADS, LAYERS, D, backend_reads, layer_views

BLOCKS, BS = 12, 8
TEXT, FRAME, REGION_BLOCKS, KEEP_BLOCKS = 3, 8, 8, 3
#: Storage dtype vLLM allocates per --kv-cache-dtype (the model is bf16: ``auto`` stores bf16).
STORAGE = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.uint8,
           "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8}


def _scales(per_head: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_scale, v_scale)`` as vLLM keeps them (float32 device tensors), distinct per layer."""
    shape = (HEADS,) if per_head else ()
    return [(torch.full(shape, 0.05 * (layer + 1)) * (torch.arange(HEADS) + 1 if per_head else 1),
             torch.full(shape, 0.02 * (layer + 2))) for layer in range(LAYERS)]


def _fill(views: list[torch.Tensor], kv_cache_dtype: str, scales) -> None:
    """Random keys/values written in each layer's storage format (fp8: quantised with its scales)."""
    g = torch.Generator().manual_seed(3)
    slots = slots_of(torch.arange(1, BLOCKS), BS)
    for view, (k_scale, v_scale) in zip(views, scales, strict=True):
        k, v = torch.randn(len(slots), HEADS, D, generator=g) * 3, torch.randn(len(slots), HEADS, D, generator=g)
        if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            element = FP8_KV_CACHE_DTYPES[kv_cache_dtype]
            k = (k / k_scale.reshape(-1, 1)).to(element).view(torch.uint8)
            v = (v / v_scale.reshape(-1, 1)).to(element).view(torch.uint8)
        PagedAccessor.of(view, D).write(view, slots, k.to(view.dtype), v.to(view.dtype))


def _batch(granularity: str) -> RegionBatch:
    blocks = torch.arange(2, 2 + REGION_BLOCKS)
    n = REGION_BLOCKS * BS
    labels = torch.cat([torch.zeros(TEXT, dtype=torch.long), torch.arange(n - TEXT) // FRAME + 1])
    num_keep = KEEP_BLOCKS * BS
    return RegionBatch(src_slots=slots_of(blocks, BS), dst_slots=slots_of(blocks[:KEEP_BLOCKS], BS),
                       new_ids=torch.arange(n), spans=torch.tensor([[TEXT, n]]),
                       new_labels=labels if granularity == "frame" else None, num_keep=num_keep,
                       num_keep_candidates=num_keep - TEXT, num_candidates=n - TEXT,
                       group_size={"frame": FRAME, "block": BS}.get(granularity), frame_tokens=FRAME)


#: (--kv-cache-dtype, per-head scales): fp8 with one scale per tensor and one per KV head.
DTYPES = [(d, False) for d in STORAGE] + [(d, True) for d in FP8_KV_CACHE_DTYPES]
#: (backend, layout) pairs the backend supports.
LAYOUTS = [(b, lay) for b in ("flash_attn", "flashinfer", "triton_attn") for lay in KVCacheLayout
           if not (b == "flashinfer" and lay.name == "LHBNC")]


@pytest.mark.parametrize("granularity", ["token", "frame"])
@pytest.mark.parametrize(("kv_cache_dtype", "per_head_scale"), DTYPES,
                         ids=[f"{d}-{'head' if h else 'tensor'}-scale" for d, h in DTYPES])
@pytest.mark.parametrize(("backend", "layout"), LAYOUTS, ids=[f"{b}-{lay.name}" for b, lay in LAYOUTS])
def test_compress_step_over_every_layout_and_kv_dtype(backend: str, layout: KVCacheLayout, kv_cache_dtype: str,
                                                      per_head_scale: bool, granularity: str) -> None:
    fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
    views = layer_views(layout, STORAGE[kv_cache_dtype], BLOCKS, BS)
    scales = _scales(per_head_scale)
    _fill(views, kv_cache_dtype, scales)
    codecs = [codec_for(kv_cache_dtype, *s) for s in scales]
    before = [v.clone() for v in views]
    batch, setup = _batch(granularity), SelectionSetup(get_selector("cords"), granularity, False, (0, 0, 2))
    # The reference: the same selection on float32 caches holding the values the kernels read.
    accessor = PagedAccessor.of(views[0], D)
    reference = []
    for view, codec in zip(views, codecs, strict=True):
        k, v = codec.features(*accessor.read(view, slots_of(torch.arange(BLOCKS), BS)))
        ref = torch.zeros(BLOCKS, HEADS, BS, 2 * D)
        PagedAccessor.of(ref, D).write(ref, slots_of(torch.arange(BLOCKS), BS), k.float(), v.float())
        reference.append(ref)
    expected = compress_region(reference, [PagedAccessor.of(reference[0], D)] * LAYERS, [None] * LAYERS, batch,
                               setup)
    held = compress_region(views, [accessor] * LAYERS, [None] * LAYERS, batch, setup, codecs=codecs)
    for layer in range(LAYERS):
        assert torch.equal(held[layer].ids, expected[layer].ids)
        # Read back through the backend's own split: each kept entry holds its source's bytes.
        ids = held[layer].ids[0]                                                  # [num_keep]
        k_now, v_now = backend_reads(backend, views[layer], layout)               # [N, bs, H, D]
        k_was, v_was = backend_reads(backend, before[layer], layout)
        dst, src = batch.dst_slots, batch.src_slots[ids]
        assert torch.equal(k_now[dst // BS, dst % BS], k_was[src // BS, src % BS])
        assert torch.equal(v_now[dst // BS, dst % BS], v_was[src // BS, src % BS])
        if fp8:  # the backend's re-typed view reads the values selection scored
            element = FP8_KV_CACHE_DTYPES[kv_cache_dtype]
            k_scale = scales[layer][0].reshape(-1, 1)
            got = k_now[dst // BS, dst % BS].view(element).float() * k_scale
            ref_k = PagedAccessor.of(reference[layer], D).read(reference[layer], dst)[0]
            assert torch.equal(got, ref_k)


def test_codecs_of_every_kv_cache_dtype_vllm_offers() -> None:
    from typing import get_args

    from vllm.config.cache import CacheDType

    offered = set(get_args(CacheDType))
    assert set(SUPPORTED_KV_CACHE_DTYPES) <= offered  # nothing invented
    for name in sorted(offered):
        if name in SUPPORTED_KV_CACHE_DTYPES:
            check_kv_cache_dtype(name)
            codec = codec_for(name)
            assert isinstance(codec, Fp8Codec if name in FP8_KV_CACHE_DTYPES else PlainCodec)
        else:
            with pytest.raises(UnsupportedKVCacheDtype, match=f"--kv-cache-dtype {name}"):
                check_kv_cache_dtype(name)


def test_fp8_codec_reads_scales_when_decoding_and_runs_on_meta() -> None:
    scale = torch.tensor(2.0)
    codec = Fp8Codec(torch.float8_e4m3fn, scale, scale)
    stored = torch.tensor([1.5], dtype=torch.float8_e4m3fn).view(torch.uint8).view(1, 1, 1)
    assert float(codec.features(stored, stored)[0]) == 3.0
    scale.fill_(4.0)  # vLLM updates scales in place (--calculate-kv-scales)
    assert float(codec.features(stored, stored)[0]) == 6.0
    meta = torch.empty(5, HEADS, D, dtype=torch.uint8, device="meta")
    k, _ = Fp8Codec(torch.float8_e5m2, torch.ones(HEADS, device="meta"), 1.0).features(meta, meta)
    assert k.device.type == "meta" and k.dtype == torch.float32 and k.shape == (5, HEADS, D)
