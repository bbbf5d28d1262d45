"""Joint selection under tensor parallelism, simulated with one thread per rank: the same as one rank with all heads.

Each simulated rank holds its share of the KV heads as vLLM lays them out (contiguous runs, or one replicated head
per rank when there are fewer heads than ranks) and runs the pure compress step with a head gather built on a
thread-barrier all-gather; its cache afterwards must equal TP=1's cache restricted to its heads.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.step import RegionBatch, SelectionSetup, compress_region
from cords_vllm.compress.tensor_parallel import (
    gathered_bytes,
    head_gatherer,
    kv_head_replicas,
    local_head_gatherer,
    local_kv_heads,
)
from cords_vllm.selection import get_selector

LAYERS, BS, D, BLOCKS = 3, 8, 16, 24
TEXT, FRAME, FRAMES = 5, 12, 10
KEEP_BLOCKS = 5


class ThreadGroup:
    """An all-gather across ``world`` threads (rank order), as vLLM's TP group gives across processes."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.parts: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world)
        self.calls = 0

    def all_gather_of(self, rank: int):
        def all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            out = torch.cat(self.parts, dim=dim)  # type: ignore[arg-type]
            self.barrier.wait()
            if rank == 0:
                self.calls += 1
            return out
        return all_gather


def _heads_of(rank: int, heads: int, world: int) -> list[int]:
    """vLLM's layout: contiguous runs of ``H / W`` heads, or head ``r // R`` replicated on ``R`` ranks."""
    replicas, local = kv_head_replicas(heads, world), local_kv_heads(heads, world)
    first = (rank // replicas) * local
    return list(range(first, first + local))


def _batch(blocks: torch.Tensor, granularity: str) -> RegionBatch:
    labels = torch.cat([torch.zeros(TEXT, dtype=torch.long), torch.arange(FRAMES).repeat_interleave(FRAME) + 1,
                        torch.full((64,), FRAMES + 1)])
    num_keep = KEEP_BLOCKS * BS
    return RegionBatch(
        src_slots=slots_of(blocks, BS), dst_slots=slots_of(blocks[:KEEP_BLOCKS], BS),
        new_ids=torch.arange(blocks.numel() * BS), spans=torch.tensor([[TEXT, TEXT + FRAMES * FRAME]]),
        new_labels=labels[: blocks.numel() * BS] if granularity == "frame" else None, num_keep=num_keep,
        num_keep_candidates=num_keep - TEXT, num_candidates=blocks.numel() * BS - TEXT,
        group_size={"frame": FRAME, "block": BS}.get(granularity), frame_tokens=FRAME)


def _compress(caches: list[torch.Tensor], granularity: str, per_head: bool, gather=None, kernels: str = "auto",
              policy: str = "cords", **params):
    blocks = torch.arange(3, 3 + (TEXT + FRAMES * FRAME) // BS)
    setup = SelectionSetup(get_selector(policy, **params), granularity, per_head, (0, 0, 2), gather_heads=gather,
                           kernels=kernels)
    accessor = PagedAccessor.of(caches[0], D)
    return compress_region(caches, [accessor] * LAYERS, [None] * LAYERS, _batch(blocks, granularity), setup)


def _tp(full: list[torch.Tensor], world: int, granularity: str, per_head: bool, exchange: bool = True,
        kernels: str = "auto", policy: str = "cords", **params):
    """Each simulated rank's caches and held tokens after compressing its shard of ``full``."""
    heads = full[0].shape[1]
    group = ThreadGroup(world)
    shards = [[c[:, _heads_of(r, heads, world)].clone() for c in full] for r in range(world)]

    def rank(r: int):
        gather = head_gatherer(group.all_gather_of(r), world, heads) if exchange and not per_head else None
        return _compress(shards[r], granularity, per_head, gather, kernels, policy, **params)

    with ThreadPoolExecutor(world) as pool:
        held = list(pool.map(rank, range(world)))
    return shards, held, group.calls


@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
@pytest.mark.parametrize(("heads", "world"), [(4, 2), (4, 4), (2, 4), (1, 2)])
@pytest.mark.parametrize("per_head", [False, True], ids=["joint", "per-head"])
def test_every_rank_keeps_what_one_rank_with_all_heads_keeps(granularity, heads, world, per_head):
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(BLOCKS, heads, BS, 2 * D, generator=g) for _ in range(LAYERS)]
    one = [c.clone() for c in full]
    held_one = _compress(one, granularity, per_head)
    shards, held, calls = _tp(full, world, granularity, per_head)
    assert calls == (0 if per_head else 1)  # one collective per compression, all anchors, keys and values together
    for r in range(world):
        index = _heads_of(r, heads, world)
        for layer in range(LAYERS):
            assert torch.equal(shards[r][layer], one[layer][:, index])
            assert torch.equal(held[r][layer].ids, held_one[layer].ids[index])


def test_without_the_exchange_joint_selection_depends_on_the_shard():
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(BLOCKS, 4, BS, 2 * D, generator=g) for _ in range(LAYERS)]
    held_one = _compress([c.clone() for c in full], "token", False)
    _, held, _ = _tp(full, 2, "token", False, exchange=False)
    assert not torch.equal(held[0][0].ids, held_one[0].ids[:2])


def test_layout_rules_and_bytes():
    assert [kv_head_replicas(h, w) for h, w in [(8, 2), (2, 2), (2, 4), (1, 8)]] == [1, 1, 2, 8]
    assert [local_kv_heads(h, w) for h, w in [(8, 2), (2, 4)]] == [4, 1]
    with pytest.raises(ValueError, match="cannot be split"):
        kv_head_replicas(6, 4)
    with pytest.raises(ValueError, match="cannot be replicated"):
        kv_head_replicas(3, 4)
    assert head_gatherer(lambda x, dim: x, 1, 8) is None
    # Qwen2-VL-7B-like: 4 KV heads of 128 over 2 ranks, one anchor, a 2,048-token region in bf16
    assert gathered_bytes(1, 2048, 4, 128, 2, 2) == (2 * 2048 * 2 * 128 * 2, 2 * 2048 * 2 * 128 * 2)
    assert gathered_bytes(1, 2048, 4, 128, 2, 1) == (0, 0)


@pytest.mark.parametrize(("heads", "world"), [(4, 2), (2, 4), (8, 4)])
def test_the_warm_ups_stand_in_gathers_what_the_collective_gathers_without_it(heads, world):
    """The start-up warm-up's gather (no collective, so a rank whose warm-up fails alone leaves no other waiting in
    it) gives every rank a tensor of the shape, dtype and layout the group's all-gather gives: the kernels it
    compiles are the ones the real gather's compressions launch."""
    local = local_kv_heads(heads, world)
    parts = [torch.randn(2, 3, 2, local, 1, D) for _ in range(world)]  # the fused step's units: [P, M, 2, H, 1, D]
    group = ThreadGroup(world)
    with ThreadPoolExecutor(world) as pool:
        real = list(pool.map(lambda r: head_gatherer(group.all_gather_of(r), world, heads)(parts[r]), range(world)))
    stand_in = local_head_gatherer(world, heads)
    for r in range(world):
        alone = stand_in(parts[r])
        assert (alone.shape, alone.dtype, alone.stride()) == (real[r].shape, real[r].dtype, real[r].stride())
        assert alone.shape[3] == heads
    assert group.calls == 1 and local_head_gatherer(1, heads) is None


class _OneKernelAtATime:
    """A Triton kernel whose launches hold a lock: Triton's interpreter, which runs the kernels on CPU, patches its
    language module while a kernel runs, so the simulated ranks' threads take turns (never across a collective)."""

    lock = threading.Lock()

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def locked(*args, **kwargs):
            with self.lock:
                return launch(*args, **kwargs)
        return locked


@pytest.mark.parametrize(("granularity", "heads", "world", "policy", "params"), [
    ("token", 4, 2, "cords", {}), ("frame", 2, 4, "k_only", {}), ("block", 2, 2, "cords", {"space": "normalized"})])
def test_the_fused_step_gathers_every_ranks_units(monkeypatch, granularity, heads, world, policy, params):
    """Joint selection on the fused kernel path (on CPU under Triton's interpreter): each rank makes its heads' units,
    one all-gather gives every rank all heads' units, and every rank keeps what one rank with all heads keeps on the
    PyTorch path, bit for bit, caches included (in the normalized space too, where the greedy run's scaling makes the
    gathered units' norms, with keys at 30x the values' scale so that the scaling decides)."""
    import cords_vllm.compress.copy_triton as copy_triton
    import cords_vllm.compress.step_triton as step_triton
    import cords_vllm.selection.cords_triton as cords_triton

    if not copy_triton.interpreting():
        pytest.skip("the simulated ranks run the kernels under TRITON_INTERPRET=1")
    for module in (step_triton, cords_triton, copy_triton):
        compiled = module.compiled
        monkeypatch.setattr(module, "compiled", lambda *a, _c=compiled: _OneKernelAtATime(_c(*a)))
    fused = []
    original = step_triton.gathered_rows

    def spy(*args, **kwargs):
        fused.append(1)
        return (yield from original(*args, **kwargs))

    monkeypatch.setattr(step_triton, "gathered_rows", spy)
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(BLOCKS, heads, BS, 2 * D, generator=g) for _ in range(LAYERS)]
    if params.get("space") == "normalized":
        for c in full:
            c[..., :D] *= 30.0
    full = [c.bfloat16() for c in full]
    one = [c.clone() for c in full]
    held_one = _compress(one, granularity, False, kernels="torch", policy=policy, **params)
    shards, held, calls = _tp(full, world, granularity, False, kernels="triton", policy=policy, **params)
    assert len(fused) == world and calls == 1  # every rank on the fused step; one collective
    for r in range(world):
        index = _heads_of(r, heads, world)
        for layer in range(LAYERS):
            assert torch.equal(shards[r][layer], one[layer][:, index])
            assert torch.equal(held[r][layer].ids, held_one[layer].ids[index])
