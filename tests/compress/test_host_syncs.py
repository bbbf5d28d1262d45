"""Host synchronisations, blocking uploads and launches of one compression, counted on CPU against budgets.

On a GPU every host read of a tensor (``item``, ``bool``, data-sized ops such as ``nonzero`` or boolean-mask
indexing) waits for the stream, and under async scheduling for the forward in flight; every
``torch.tensor(v, device=...)`` is a blocking pageable copy; every op is a kernel launch, and the greedy
selectors launch a fixed list of ops per kept unit. :class:`~tests.support.device_audit.HostSyncCounter` counts
all three on CPU, where the same code runs (aten-level dispatch mode plus a function-level mode for host
data), so the budgets documented in :mod:`cords_vllm.compress.step` and :mod:`cords_vllm.selection.cords`
are enforced here.
"""

from __future__ import annotations

import pytest
import torch

import cords_vllm.compress.step as step
from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.step import (
    HOST_SYNCS_PER_COMPRESSION,
    HeldTokens,
    RegionBatch,
    SelectionSetup,
    compress_region,
)
from cords_vllm.selection import available_selectors, get_selector
from cords_vllm.selection.cords import OPS_PER_GREEDY_STEP
from cords_vllm.selection.exact import select_exact
from cords_vllm.selection.randomized import RandomSelector
from cords_vllm.selection.ranking import top_k_order
from tests.support.device_audit import HostSyncCounter
from tests.support.observed import with_observation

LAYERS, HEADS, BS, D = 3, 2, 16, 32
TEXT, FRAME, FRAMES = 5, 24, 12  # protected tokens, tokens per frame, frames
REGION = (TEXT + FRAMES * FRAME) // BS  # blocks
ANCHORS = (0, 0, 2)


def _caches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(40, HEADS, BS, 2 * D, generator=g) for _ in range(LAYERS)]


def _labels() -> torch.Tensor:
    """``long [>= REGION * BS]``: M-RoPE-like temporal positions (text 0, then one per frame)."""
    return torch.cat([torch.zeros(TEXT, dtype=torch.long), torch.arange(FRAMES).repeat_interleave(FRAME) + 1,
                      torch.full((64,), FRAMES + 1)])


def _batch(granularity: str, keep_blocks: int, region: int = REGION) -> RegionBatch:
    """The first compression of a request whose region is its first ``region`` blocks (2, 3, ...)."""
    blocks = torch.arange(2, 2 + region)
    n_video = min(region * BS, TEXT + FRAMES * FRAME) - TEXT
    return RegionBatch(
        src_slots=slots_of(blocks, BS), dst_slots=slots_of(blocks[:keep_blocks], BS),
        new_ids=torch.arange(region * BS), spans=torch.tensor([[TEXT, TEXT + FRAMES * FRAME]]),
        new_labels=_labels()[: region * BS] if granularity == "frame" else None, num_keep=keep_blocks * BS,
        num_keep_candidates=keep_blocks * BS - TEXT, num_candidates=n_video,
        group_size={"frame": FRAME, "block": BS}.get(granularity), frame_tokens=FRAME)


def _count(policy: str, granularity: str, keep_blocks: int = 6, per_head: bool = False,
           held: list[HeldTokens | None] | None = None, batch: RegionBatch | None = None,
           **params: object) -> tuple[HostSyncCounter, list[HeldTokens]]:
    caches = _caches()
    setup = SelectionSetup(get_selector(policy, **params), granularity, per_head, ANCHORS)
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    batch = with_observation(setup, batch or _batch(granularity, keep_blocks), HEADS, D)
    with HostSyncCounter() as count:
        kept = compress_region(caches, accessors, held or [None] * LAYERS, batch, setup)
    return count, kept


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
@pytest.mark.parametrize("policy", available_selectors())
def test_one_compression_stays_within_its_host_sync_budget_and_uploads_nothing(policy, granularity, per_head):
    count, _ = _count(policy, granularity, per_head=per_head)
    assert len(count.syncs) <= HOST_SYNCS_PER_COMPRESSION[granularity], count.syncs
    assert count.uploads == []
    if granularity == "frame":  # the one documented read: frame count and frame budget together
        assert all("/selection/exact.py" in site for site in count.syncs), count.syncs


@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
def test_a_compression_of_held_tokens_stays_within_the_budget(granularity):
    """The second compression of a request: its region holds the tokens the first one kept, then new ones."""
    _, held = _count("cords", granularity, keep_blocks=4, batch=_batch(granularity, 4, region=10))
    src = torch.cat([torch.arange(2, 6), torch.arange(2 + 10, 2 + REGION)])
    new_ids = torch.arange(10 * BS, REGION * BS)
    second = RegionBatch(
        src_slots=slots_of(src, BS), dst_slots=slots_of(src[:5], BS), new_ids=new_ids,
        spans=torch.tensor([[TEXT, TEXT + FRAMES * FRAME]]),
        new_labels=_labels()[10 * BS: REGION * BS] if granularity == "frame" else None, num_keep=5 * BS,
        num_keep_candidates=5 * BS - TEXT, num_candidates=4 * BS - TEXT + new_ids.numel(),
        group_size={"frame": FRAME, "block": BS}.get(granularity), frame_tokens=FRAME)
    count, kept = _count("cords", granularity, held=held, batch=second)
    assert kept[0].ids.shape == (HEADS, 5 * BS)
    assert len(count.syncs) <= HOST_SYNCS_PER_COMPRESSION[granularity], count.syncs
    assert count.uploads == []


def test_the_exact_novelty_reads_its_saturation_back_about_once():
    """``novelty="exact"`` (an ablation) reads one flag per step from step ``H * D`` until its residuals vanish:
    on random keys and values once, the step they span the feature space."""
    count, _ = _count("cords", "token", novelty="exact")
    assert len(count.syncs) == 1 and "/selection/cords_torch.py" in count.syncs[0], count.syncs
    assert count.uploads == []


def test_the_counter_catches_a_host_read_and_a_host_to_device_copy(monkeypatch):
    """The budgets can fail: a deliberate ``.item()`` and ``torch.tensor(1.0, device=...)`` inside the step are
    both counted, at their call site."""
    baseline, _ = _count("cords", "token")
    finite_features = step.finite_features

    def with_a_read_and_a_copy(x: torch.Tensor) -> torch.Tensor:
        x.sum().item()
        torch.tensor(1.0, device=x.device)
        return finite_features(x)

    monkeypatch.setattr(step, "finite_features", with_a_read_and_a_copy)
    count, _ = _count("cords", "token")
    assert len(count.syncs) == len(baseline.syncs) + 2  # one read per call: keys and values
    assert len(count.uploads) == 2
    assert all("/compress/step.py" in site for site in count.syncs + count.uploads), count.syncs + count.uploads
    assert len(count.syncs) > HOST_SYNCS_PER_COMPRESSION["token"]


def test_the_counter_catches_a_blocking_upload_of_a_host_draw(monkeypatch):
    """The random policy draws on the host; moving the draw without ``non_blocking`` (as it once did) is an
    upload that waits for the stream."""

    def blocking(self: RandomSelector, units):
        gen = torch.Generator(device="cpu")
        gen.manual_seed(self.seed)
        score = torch.rand(units.valid.shape, generator=gen, device=gen.device, dtype=torch.float64)
        return top_k_order(score.to(units.valid.device), units.valid, units.k, units.k_max)

    assert _count("random", "token")[0].uploads == []
    monkeypatch.setattr(RandomSelector, "_order_units", blocking)
    count, _ = _count("random", "token")
    assert len(count.uploads) == 1 and count.uploads[0].startswith("to at /selection/"), count.uploads


def test_a_data_sized_op_is_counted():
    x = torch.arange(6)
    with HostSyncCounter() as count:
        _ = x[x > 2], torch.nonzero(x), torch.equal(x, x), bool(x.any())
    assert len(count.syncs) == 4, count.syncs  # mask indexing, nonzero, equal, bool


@pytest.mark.parametrize(("policy", "params"), [("cords", {}), ("k_only", {}), ("v_only", {}),
                                                ("cords", {"lam": 0.0})])
@pytest.mark.parametrize("granularity", ["token", "block"])
def test_ops_per_greedy_step_stay_within_budget(policy, params, granularity):
    """Ops launched per extra kept unit: keep ``k`` and ``k + m`` units and divide the difference by ``m``."""
    small, _ = _count(policy, granularity, keep_blocks=4, **params)
    large, _ = _count(policy, granularity, keep_blocks=9, **params)
    extra_units = 5 * (BS if granularity == "token" else 1)
    per_step = (large.ops - small.ops) / extra_units
    variant = "d2" if policy != "cords" or params.get("lam") == 0.0 else "max_cosine"
    assert per_step <= OPS_PER_GREEDY_STEP[variant], (per_step, large.op_names[-60:])
    assert per_step == int(per_step)  # a fixed list of ops per step, whatever the number of units


@pytest.mark.parametrize("policy", ["cords", "uniform", "random", "infinipot_v"])
@pytest.mark.parametrize(("granularity", "labelled"), [("token", False), ("block", False), ("frame", True)])
def test_host_counts_only_replace_reads(policy, granularity, labelled):
    """With the candidate count on the host (the compress step's path) a selection keeps exactly what the
    checked path, which reads its counts back, keeps."""
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, HEADS, 150, D, generator=g), torch.randn(2, HEADS, 150, D, generator=g)
    labels = _labels()[:150].expand(2, -1)
    cand = (labels > 0) & (torch.arange(150) < TEXT + 5 * FRAME + 7)  # the newest frame cut by the region edge
    n_cand = int(cand[0].sum())
    kwargs = dict(candidates=cand, granularity=granularity, group_size={"token": None, "block": BS}.get(
        granularity, FRAME), group_index=labels if labelled else None, frame_tokens=FRAME)
    for need in (1, 30, 70, n_cand - 1):
        checked = select_exact(get_selector(policy), keys, values, need, **kwargs,
                               generator=torch.Generator().manual_seed(1))
        counted = select_exact(get_selector(policy), keys, values, need, num_candidates=n_cand, **kwargs,
                               generator=torch.Generator().manual_seed(1))
        assert torch.equal(checked, counted), need
