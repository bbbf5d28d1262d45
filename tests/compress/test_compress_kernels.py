"""The compress step on its Triton kernels equals the PyTorch path, in a fixed number of launches.

Where no GPU is, on CPU under Triton's interpreter (with a GPU, compiled, on CUDA tensors):
:func:`~cords_vllm.compress.step.compress_region` with ``kernels="triton"`` (the greedy kernel and the one-launch
copy) against ``kernels="torch"`` (the reference), on paged caches in every physical stride order vLLM's GPU backends
use, in every KV dtype the plugin supports (fp8 as its raw bytes), for first and later compressions, joint and per
head, one anchor or several. Equal means the same kept ids per layer and the same cache contents, bit for bit.

Launches (what a CUDA device would run, counted on CPU by :class:`~tests.support.device_audit.HostSyncCounter`): per
compression they do not grow with the layer count or the kept count, grow by :data:`PER_EXTRA_ANCHOR` per extra
anchor, and stay within :data:`LAUNCH_BUDGET`.
"""

from __future__ import annotations

import pytest
import torch

import cords_vllm.compress.copy_triton as copy_triton
import cords_vllm.compress.step_triton as step_triton
import cords_vllm.selection.cords_triton as cords_triton
from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.kv_codec import PlainCodec, codec_for
from cords_vllm.compress.step import HOST_SYNCS_PER_COMPRESSION, RegionBatch, SelectionSetup, compress_region
from cords_vllm.selection import get_selector
from tests.support.device_audit import HostSyncCounter
from tests.support.regions import on_device

pytest.importorskip("triton")

#: Where the kernels run: compiled on a GPU, interpreted on CPU (the launch counts run on CPU either way).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, BS, D, TEXT, FRAME, FRAMES = 2, 8, 8, 5, 12, 10
NUM_BLOCKS = 30
REGION = (TEXT + FRAMES * FRAME) // BS  # 15 blocks
#: Kernel launches (aten ops that launch and Triton kernels) one compression may make on the kernel path, per
#: granularity, whatever the layer, anchor and kept counts: the issue's budget. The fused step makes 7 (the plan,
#: the units, two Gram GEMMs, the greedy run, the finish and the copy).
LAUNCH_BUDGET = {"token": 16, "block": 16, "frame": 16}
#: Launches each anchor beyond the first adds: none (every anchor is a problem of the same launches).
PER_EXTRA_ANCHOR = 0

#: Physical stride orders of the logical [num_blocks, H, block_size, 2 * D] view (vLLM's KVCacheLayout family).
LAYOUTS = {"NHBC": (0, 1, 2, 3), "NBHC": (0, 2, 1, 3), "HNBC": (1, 0, 2, 3)}


def _labels() -> torch.Tensor:
    return torch.cat([torch.zeros(TEXT, dtype=torch.long), torch.arange(FRAMES).repeat_interleave(FRAME) + 1,
                      torch.full((64,), FRAMES + 1)])


def _caches(layers: int, layout: str, dtype: torch.dtype, shared: bool, device: str = DEVICE
            ) -> list[torch.Tensor]:
    """Per layer a logical view over a physical tensor in ``layout``'s order; ``shared``: one buffer for all."""
    order = LAYOUTS[layout]
    logical = (NUM_BLOCKS, HEADS, BS, 2 * D)
    physical = tuple(logical[i] for i in order)
    inverse = [order.index(i) for i in range(4)]
    g = torch.Generator().manual_seed(1)

    def fill(n: int) -> torch.Tensor:
        if dtype == torch.uint8:  # an fp8 cache: e4m3 bytes
            return torch.randn(n, *physical, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.randn(n, *physical, generator=g).to(dtype)

    buffer = fill(layers).to(device) if shared else None
    raw = [buffer[i] if shared else fill(1)[0] for i in range(layers)]
    return [r.to(device).permute(*inverse) for r in raw]


def _first(granularity: str, keep_blocks: int, region: int = REGION) -> RegionBatch:
    blocks = torch.tensor([3, 9, 4, 11, 2, 17, 6, 20, 7, 13, 8, 25, 10, 21, 12, 29, 14][:region])
    n_video = min(region * BS, TEXT + FRAMES * FRAME) - TEXT
    return RegionBatch(
        src_slots=slots_of(blocks, BS), dst_slots=slots_of(blocks[:keep_blocks], BS),
        new_ids=torch.arange(region * BS), spans=torch.tensor([[TEXT, TEXT + FRAMES * FRAME]]),
        new_labels=_labels()[: region * BS] if granularity == "frame" else None, num_keep=keep_blocks * BS,
        num_keep_candidates=keep_blocks * BS - TEXT, num_candidates=n_video,
        group_size={"frame": FRAME, "block": BS}.get(granularity), frame_tokens=FRAME)


def _second(granularity: str, first_src: torch.Tensor, first_keep: int) -> RegionBatch:
    """The next compression: the blocks the first kept, then the five blocks that followed the region (the video's
    last tokens, then text), with the ids and frame labels that follow the first region's."""
    blocks = torch.cat([first_src.view(-1, BS)[:first_keep, 0] // BS, torch.tensor([5, 15, 16, 18, 19])])
    prev = first_keep * BS
    new_ids = torch.arange(REGION * BS, (REGION + 5) * BS)
    n_new_video = TEXT + FRAMES * FRAME - REGION * BS
    return RegionBatch(
        src_slots=slots_of(blocks, BS), dst_slots=slots_of(blocks[:8], BS), new_ids=new_ids,
        spans=torch.tensor([[TEXT, TEXT + FRAMES * FRAME]]),
        new_labels=_labels()[new_ids] if granularity == "frame" else None, num_keep=8 * BS,
        num_keep_candidates=8 * BS - TEXT - (new_ids.numel() - n_new_video),
        num_candidates=prev - TEXT + n_new_video,
        group_size={"frame": FRAME, "block": BS}.get(granularity), frame_tokens=FRAME)


def _run(kernels: str, caches: list[torch.Tensor], anchors: tuple[int, ...], granularity: str, per_head: bool,
         twice: bool = True):
    setup = SelectionSetup(get_selector("cords"), granularity, per_head, anchors, kernels=kernels)
    accessors = [PagedAccessor.of(caches[0], D)] * len(caches)
    codecs = [codec_for("fp8_e4m3", 0.5, 0.25) if caches[0].dtype == torch.uint8 else PlainCodec()] * len(caches)
    device = str(caches[0].device)
    first = _first(granularity, 10)
    held = compress_region(caches, accessors, [None] * len(caches), on_device(first, device), setup, codecs=codecs)
    if twice:
        held = compress_region(caches, accessors, held, on_device(_second(granularity, first.src_slots, 10), device),
                               setup, codecs=codecs)
    return held


@pytest.mark.parametrize(("layout", "dtype"), [
    ("NHBC", torch.float32), ("NBHC", torch.bfloat16), ("HNBC", torch.float16),
    ("NHBC", torch.uint8), ("NBHC", torch.uint8), ("HNBC", torch.uint8)])
def test_the_kernels_move_the_same_elements_in_every_layout_and_dtype(layout, dtype):
    """fp8 caches move as raw bytes (decoded with their scales only to score them)."""
    results = []
    for kernels in ("torch", "triton"):
        caches = _caches(4, layout, dtype, shared=layout == "NHBC")
        held = _run(kernels, caches, (0, 0, 2, 2), "token", per_head=False)
        results.append((held, caches))
    (ref_held, ref_caches), (held, caches) = results
    for a, b in zip(ref_caches, caches, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                           b.view(torch.uint8) if b.dtype != torch.uint8 else b)
    for a, b in zip(ref_held, held, strict=True):
        assert torch.equal(a.ids, b.ids)


@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("anchors", [(0, 1, 2)])  # one anchor per layer (tests/compress/test_step_triton.py: shared)
def test_the_kernel_path_keeps_what_the_reference_keeps(granularity, per_head, anchors):
    results = []
    for kernels in ("torch", "triton"):
        caches = _caches(3, "NBHC", torch.bfloat16, shared=False)
        results.append((_run(kernels, caches, anchors, granularity, per_head), caches))
    (ref_held, ref_caches), (held, caches) = results
    for a, b in zip(ref_held, held, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.candidates, b.candidates)
    for a, b in zip(ref_caches, caches, strict=True):
        assert torch.equal(a, b)


def test_a_copy_that_writes_before_it_reads_is_caught(monkeypatch):
    """The in-place copy's order matters: the same kernel run row by row from the last row to the first
    overwrites sources that earlier rows still read, and the comparison sees it."""
    one_launch = copy_triton.copy_kept

    def last_row_first(caches, positions, anchor_row, src_slots, dst_slots) -> None:
        for i in reversed(range(dst_slots.shape[0])):
            one_launch(caches, positions[..., i:i + 1], anchor_row, src_slots, dst_slots[i:i + 1])

    results = []
    for kernels in ("torch", "triton"):
        caches = _caches(2, "NHBC", torch.float32, shared=False)
        if kernels == "triton":
            monkeypatch.setattr(copy_triton, "copy_kept", last_row_first)
        _run(kernels, caches, (0, 0), "token", per_head=False, twice=False)
        results.append(caches)
    assert any(not torch.equal(a, b) for a, b in zip(*results, strict=True))


def _launches(monkeypatch, layers: int, anchors: tuple[int, ...], granularity: str, keep: int,
              dtype: torch.dtype = torch.bfloat16, **params) -> HostSyncCounter:
    """Counted on CPU (under the interpreter): the counter's dispatch mode is a CPU stand-in."""
    if not copy_triton.interpreting():
        pytest.skip("launches are counted on CPU under TRITON_INTERPRET=1")
    caches = _caches(layers, "NBHC", dtype, shared=True, device="cpu")
    codecs = [codec_for("fp8_e4m3", 0.5, 0.25)] * layers if dtype == torch.uint8 else None
    setup = SelectionSetup(get_selector("cords", **params), granularity, False, anchors, kernels="triton")
    counter = HostSyncCounter()
    counter.watch_triton(monkeypatch, cords_triton, copy_triton, step_triton)
    accessors, batch = [PagedAccessor.of(caches[0], D)] * layers, _first(granularity, keep)
    with counter:
        compress_region(caches, accessors, [None] * layers, batch, setup, codecs=codecs)
    return counter


@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
def test_launches_per_compression_do_not_grow_with_layers_or_kept_tokens(monkeypatch, granularity):
    _launches(monkeypatch, 3, (0, 0, 0), granularity, 6)  # the copy's layer tables: uploaded once per engine
    base = _launches(monkeypatch, 3, (0, 0, 0), granularity, 6)
    for layers, keep in ((8, 11),):
        _launches(monkeypatch, layers, (0,) * layers, granularity, keep)
        other = _launches(monkeypatch, layers, (0,) * layers, granularity, keep)
        assert other.launches == base.launches, (layers, keep, other.launch_names)
    # Every anchor is a problem of the same launches: PER_EXTRA_ANCHOR (none) more.
    _launches(monkeypatch, 8, (0,) * 4 + (4,) * 4, granularity, 11)
    two = _launches(monkeypatch, 8, (0,) * 4 + (4,) * 4, granularity, 11)
    assert two.launches == base.launches + PER_EXTRA_ANCHOR, two.launch_names
    assert base.launches <= LAUNCH_BUDGET[granularity], base.launch_names
    assert [n for n in base.launch_names if n.startswith("triton:")] == [
        "triton:step_triton:plan", "triton:step_triton:units", "triton:cords_triton", "triton:step_triton:finish",
        "triton:copy_triton"]
    assert len(base.syncs) <= HOST_SYNCS_PER_COMPRESSION[granularity]
    assert base.uploads == []
    _launches(monkeypatch, 3, (0, 0, 0), granularity, 6, torch.uint8)  # the scales, uploaded once per value
    fp8 = _launches(monkeypatch, 3, (0, 0, 0), granularity, 6, torch.uint8)
    assert fp8.launch_names == [*base.launch_names[:1], "cat.default", *base.launch_names[1:]]  # one more: scales
    assert fp8.uploads == [] and len(fp8.syncs) <= HOST_SYNCS_PER_COMPRESSION[granularity]
    # The exact novelty (an ablation) runs the same kernels, with its directions' buffer beside them; the normalized
    # space one more, which scales the units before the Gram GEMMs.
    exact = _launches(monkeypatch, 3, (0, 0, 0), granularity, 6, novelty="exact")
    assert exact.launch_names == base.launch_names
    normalized = _launches(monkeypatch, 3, (0, 0, 0), granularity, 6, space="normalized", novelty="exact")
    at = base.launch_names.index("triton:step_triton:units") + 1
    assert normalized.launch_names == [*base.launch_names[:at], "triton:step_triton:normalize",
                                       *base.launch_names[at:]]
    for other in (exact, normalized):
        assert other.launches <= LAUNCH_BUDGET[granularity]
        assert len(other.syncs) <= HOST_SYNCS_PER_COMPRESSION[granularity] and other.uploads == []


def test_the_reference_path_launches_per_layer_and_per_step(monkeypatch):
    """The counter sees what the kernels removed: the PyTorch path launches more with every layer and step."""
    def count(layers: int, keep: int) -> int:
        caches = _caches(layers, "NBHC", torch.bfloat16, shared=True, device="cpu")
        setup = SelectionSetup(get_selector("cords"), "token", False, (0,) * layers, kernels="torch")
        with HostSyncCounter() as counter:
            compress_region(caches, [PagedAccessor.of(caches[0], D)] * layers, [None] * layers,
                            _first("token", keep), setup)
        return counter.launches

    assert count(6, 6) > count(3, 6) and count(3, 11) > count(3, 6)


def test_the_copy_works_out_its_layers_layout_once_per_list_of_caches_and_again_when_a_cache_changes(monkeypatch):
    """``copy_kept`` groups the layers by layout and reads each one's address (for 28 layers, a quarter of the fused
    step's host time per compression): once per list of cache tensors. A list holding another tensor, or a cache
    given new storage in place, is worked out again and moved right; the memo holds no cache alive."""
    import weakref

    if not copy_triton.interpreting():
        pytest.skip("the copy runs on CPU under TRITON_INTERPRET=1")
    looked_at = []
    signature = copy_triton.cache_signature
    monkeypatch.setattr(copy_triton, "cache_signature", lambda cache: looked_at.append(cache) or signature(cache))
    positions = torch.tensor([1, 3, 4, 7, 8, 10]).view(1, 1, -1).expand(1, HEADS, -1)  # kept rows, pos[i] >= i
    src = slots_of(torch.tensor([3, 9, 4]), BS)
    dst = src[: positions.shape[-1]]

    def copied(caches: list[torch.Tensor]) -> None:
        """The copy moves each layer's kept rows as a loop over rows does."""
        expected = []
        for cache in caches:
            want = cache.clone()
            for h in range(HEADS):
                for i, row in enumerate(positions[0, h].tolist()):
                    s, d = src[row].item(), dst[i].item()
                    want[d // BS, h, d % BS] = cache[s // BS, h, s % BS]
            expected.append(want)
        copy_triton.copy_kept(caches, positions, [0] * len(caches), src, dst)
        assert all(torch.equal(c, w) for c, w in zip(caches, expected, strict=True))

    caches = _caches(3, "NBHC", torch.bfloat16, shared=False, device="cpu")
    copied(caches)
    assert len(looked_at) == 3
    copied(caches)
    assert len(looked_at) == 3  # the same tensors: nothing looked at again
    other = _caches(3, "NBHC", torch.bfloat16, shared=False, device="cpu")[1]
    caches[1] = other
    copied(caches)
    assert len(looked_at) == 6  # another tensor in the list
    caches[2].set_(caches[2].clone())  # new storage, same tensor
    copied(caches)
    assert len(looked_at) == 9
    gone = weakref.ref(other)
    looked_at.clear()
    del caches, other
    assert gone() is None
