"""The pure compress step: exact against a direct reading of the cache, device-clean, and sync-free in its glue."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.step import RegionBatch, SelectionSetup, compress_region, video_mask
from cords_vllm.selection import available_selectors, get_selector
from cords_vllm.selection.base import SelectionResult, Selector
from tests.support.device_audit import DeviceAudit
from tests.support.observed import with_observation

LAYERS, HEADS, BS, D, BLOCKS = 4, 2, 8, 16, 40
TEXT = 5  # protected tokens before the video
FRAME = 12  # tokens per frame


def _request(device: str = "cpu", frames: int = 10, prev: int = 0):
    """Caches holding one request's first ``region`` logical tokens in blocks 3, 4, ... (block 0 is null)."""
    g = torch.Generator().manual_seed(7)
    region_blocks = (TEXT + frames * FRAME) // BS
    caches = [torch.randn(BLOCKS, HEADS, BS, 2 * D, generator=g).to(device) for _ in range(LAYERS)]
    blocks = torch.arange(3, 3 + region_blocks, device=device)
    labels = torch.cat([torch.zeros(TEXT, dtype=torch.long), torch.arange(frames).repeat_interleave(FRAME) + 1,
                        torch.full((64,), frames + 1)]).to(device)
    spans = torch.tensor([[TEXT, TEXT + frames * FRAME]], device=device)
    num_candidates = region_blocks * BS - TEXT
    return caches, blocks, labels, spans, num_candidates, region_blocks


def _batch(blocks, labels, spans, num_candidates, keep_blocks, granularity) -> RegionBatch:
    num_keep = keep_blocks * BS
    return RegionBatch(
        src_slots=slots_of(blocks, BS), dst_slots=slots_of(blocks[:keep_blocks], BS),
        new_ids=torch.arange(blocks.numel() * BS, device=blocks.device), spans=spans,
        new_labels=labels[: blocks.numel() * BS] if granularity == "frame" else None, num_keep=num_keep,
        num_keep_candidates=num_keep - TEXT, num_candidates=num_candidates,
        group_size={"frame": FRAME, "block": BS}.get(granularity), frame_budget=None, frame_tokens=FRAME)


@pytest.mark.parametrize("anchors", [(0,), (0, 2), None], ids=["one", "two", "all"])
@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
@pytest.mark.parametrize("per_head", [False, True])
def test_kept_tokens_are_the_anchor_selection_copied_in_logical_order(anchors, granularity, per_head):
    caches, blocks, labels, spans, n_cand, _ = _request()
    before = [c.clone() for c in caches]
    accessor = PagedAccessor.of(caches[0], D)
    anchor_of = tuple(i if anchors is None else max([a for a in anchors if a <= i] or [min(anchors)])
                      for i in range(LAYERS))
    setup = SelectionSetup(get_selector("cords"), granularity, per_head, anchor_of)
    batch = _batch(blocks, labels, spans, n_cand, 5, granularity)
    held = compress_region(caches, [accessor] * LAYERS, [None] * LAYERS, batch, setup)
    for layer in range(LAYERS):
        ids = held[layer].ids  # [H, num_keep] logical ids, increasing, protected text kept
        assert torch.equal(held[layer].candidates, video_mask(ids, spans))  # each keeps what it is
        if granularity == "frame":
            assert torch.equal(held[layer].labels, labels[ids])
        assert ids.shape == (HEADS, batch.num_keep)
        assert bool((ids[:, 1:] > ids[:, :-1]).all()) and ids[:, :TEXT].tolist() == [list(range(TEXT))] * HEADS
        assert int((~video_mask(ids, spans)).sum(-1).max()) == TEXT  # only video tokens were evicted
        assert torch.equal(ids, held[anchor_of[layer]].ids)  # followers keep their anchor's tokens
        if not per_head:
            assert torch.equal(ids[0], ids[1])
        # the kept tokens now sit in the first blocks, read straight from the pre-compression cache
        k_now, v_now = accessor.read(caches[layer], batch.dst_slots)
        src = slots_of(blocks, BS)[ids.T]  # [num_keep, H] source slot of each kept token and head
        k_ref, v_ref = accessor.read(before[layer], src.reshape(-1))
        head = torch.arange(HEADS)
        assert torch.equal(k_now, k_ref.view(-1, HEADS, HEADS, D)[:, head, head])
        assert torch.equal(v_now, v_ref.view(-1, HEADS, HEADS, D)[:, head, head])


def test_a_second_compression_continues_from_the_held_ids():
    caches, blocks, labels, spans, _, region = _request(frames=20)
    accessor = PagedAccessor.of(caches[0], D)
    setup = SelectionSetup(get_selector("cords"), "frame", False, (0,) * LAYERS)
    first_blocks = blocks[:10]
    first = _batch(first_blocks, labels, spans, 10 * BS - TEXT, 4, "frame")
    held = compress_region(caches, [accessor] * LAYERS, [None] * LAYERS, first, setup)
    # next: the 4 kept blocks, then blocks 10.. of the row (logical tokens 80 ..)
    src = torch.cat([blocks[:4], blocks[10:region]])
    second = RegionBatch(src_slots=slots_of(src, BS), dst_slots=slots_of(src[:5], BS),
                         new_ids=torch.arange(10 * BS, region * BS), spans=spans,
                         new_labels=labels[10 * BS: region * BS],
                         num_keep=5 * BS, num_keep_candidates=5 * BS - TEXT,
                         num_candidates=4 * BS - TEXT + (region - 10) * BS, group_size=FRAME)
    again = compress_region(caches, [accessor] * LAYERS, held, second, setup)
    assert again[0].ids.shape == (HEADS, 5 * BS)
    assert set(again[0].ids[0].tolist()) <= set(held[0].ids[0].tolist()) | set(range(10 * BS, region * BS))
    # held tokens carry their attributes: the second compression never looks at the first one's inputs
    assert torch.equal(again[0].labels, labels[again[0].ids]) and torch.equal(again[0].candidates,
                                                                              video_mask(again[0].ids, spans))


@pytest.mark.parametrize("policy", available_selectors())
@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
def test_no_tensor_is_created_off_the_cache_device(policy, granularity):
    """On CUDA a device-less ``arange``/``zeros`` is a CPU tensor next to GPU keys: find every such call."""
    caches, blocks, labels, spans, n_cand, _ = _request()
    setup = SelectionSetup(get_selector(policy), granularity, False, (0, 0, 2, 2))
    batch = with_observation(setup, replace(_batch(blocks, labels, spans, n_cand, 5, granularity), frame_budget=10),
                             HEADS, D)
    with DeviceAudit() as audit:
        compress_region(caches, [PagedAccessor.of(caches[0], D)] * LAYERS, [None] * LAYERS, batch, setup)
    assert audit.undeviced == []
    # host reads happen only inside the selectors' own checks and loops, never in the step's glue
    assert all(site.startswith("/selection/") for site in audit.syncs), audit.syncs


class _DeviceOnlyNewest(Selector):
    """Keeps the newest ``budget`` candidates with device ops only (a stand-in policy for the ``meta`` run)."""

    name = "device_only_newest"

    def select_steps(self, keys, values, budget, *, candidates=None, granularity="token", group_size=None,
                     group_index=None, per_head=False, generator=None, counts=None, observation=None):
        rank_from_end = candidates.flip(-1).cumsum(-1).flip(-1)
        keep = ~candidates | (candidates & (rank_from_end <= budget))
        return SelectionResult(keep=keep, order=torch.empty(keep.shape[0], 0, dtype=torch.long, device=keep.device),
                               granularity=granularity, group_size=group_size, per_head=per_head)
        yield  # a generator (see Selector.select_steps) that asks for no order

    def _order_units(self, units):  # pragma: no cover - select_steps is overridden
        raise NotImplementedError


def test_the_step_glue_runs_on_the_meta_device():
    """Every tensor of the step on ``meta``: any host read or CPU tensor in the glue would raise here."""
    caches, blocks, labels, spans, n_cand, _ = _request(device="meta")
    setup = SelectionSetup(_DeviceOnlyNewest(), "token", False, (0, 0, 2, 2))
    batch = _batch(blocks, labels, spans, n_cand, 5, "token")
    held = compress_region(caches, [PagedAccessor.of(caches[0], D)] * LAYERS, [None] * LAYERS, batch, setup)
    assert all(h.ids.device.type == "meta" and h.ids.shape == (HEADS, 5 * BS) for h in held)


@pytest.mark.parametrize("policy", ["cords", "infinipot_v", "recency"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_kv_is_read_as_zero_copied_as_is_and_counted(policy, bad):
    """An overflowed or corrupted entry never stops a compression: selection reads it as 0 (the same choice as a
    cache holding 0 there), the entries are copied as they are, and a device counter (no host read) counts it."""
    setup = SelectionSetup(get_selector(policy), "token", False, (0, 0, 2, 2))
    caches, blocks, labels, spans, n_cand, _ = _request()
    zeroed = [c.clone() for c in caches]
    slot = int(slots_of(blocks, BS)[TEXT + 30])  # a video token
    for layer in (0, 2):  # the anchors
        caches[layer].view(-1, HEADS, 2 * D)[slot, 1, 3] = bad
        zeroed[layer].view(-1, HEADS, 2 * D)[slot, 1, 3] = 0.0
    accessor = PagedAccessor.of(caches[0], D)
    batch = _batch(blocks, labels, spans, n_cand, 5, "token")
    counter = torch.zeros((), dtype=torch.long)
    with DeviceAudit() as audit:
        held = compress_region(caches, [accessor] * LAYERS, [None] * LAYERS, batch, setup, nonfinite=counter)
    reference = compress_region(zeroed, [accessor] * LAYERS, [None] * LAYERS, batch, setup)
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(held, reference, strict=True))
    assert int(counter) == 1
    assert not any("/compress/step.py" in site for site in audit.syncs)  # counted without a host read
    kept = held[0].ids[0].tolist()
    if TEXT + 30 in kept:  # the entry itself was copied unchanged
        row = caches[0].view(-1, HEADS, 2 * D)[int(slots_of(blocks, BS)[kept.index(TEXT + 30)]), 1, 3]
        assert torch.equal(row, torch.tensor(bad)) or (row.isnan() and bad != bad)
    compress_region(zeroed, [accessor] * LAYERS, [None] * LAYERS, batch, setup, nonfinite=counter)
    assert int(counter) == 1  # a finite cache does not count
