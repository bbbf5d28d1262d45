"""A step's compressions carried out together (:func:`~cords_vllm.compress.step.compress_regions`): the caches and
held tokens of each request equal those of its compression alone, the greedy policies order every request in one
call, and a request that fails fails alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import cords_vllm.selection.cords as cords_module
import cords_vllm.selection.d2 as d2_module
from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.step import (
    RegionBatch,
    RegionCompression,
    SelectionSetup,
    compress_region,
    compress_regions,
)
from cords_vllm.selection import get_selector
from tests.support.regions import first_batches, later_batch

LAYERS, HEADS, BS, D, BLOCKS = 4, 2, 8, 16, 48
TEXT, FRAME = 5, 12
#: Per request: frames, kept blocks, unit (a step mixes requests of every unit).
REQUESTS = ((6, 4, "token"), (10, 6, "block"), (8, 5, "frame"), (5, 3, "frame"))


def _caches(seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BS, 2 * D, generator=g) for _ in range(LAYERS)]


def _batches() -> list[RegionBatch]:
    """One first compression per request, each in its own blocks (block 0 is null)."""
    return first_batches([(TEXT, frames, keep, unit) for frames, keep, unit in REQUESTS], FRAME, BS, BLOCKS)


def _alone(setup: SelectionSetup, batches: list[RegionBatch]) -> tuple[list[torch.Tensor], list]:
    caches = _caches()
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    held = [compress_region(caches, accessors, [None] * LAYERS, b, setup) for b in batches]
    return caches, held


@pytest.mark.parametrize("per_head", [False, True], ids=["joint", "per_head"])
@pytest.mark.parametrize("policy", ["cords", "k_only", "v_only", "uniform", "infinipot_v"])
def test_compressions_together_equal_each_alone(policy, per_head, monkeypatch):
    setup = SelectionSetup(get_selector(policy), "auto", per_head, (0, 0, 2, 2))
    batches = _batches()
    ref_caches, ref_held = _alone(setup, batches)
    greedy_runs = []
    original = cords_module.cords_greedy
    for module in (cords_module, d2_module):
        monkeypatch.setattr(module, "cords_greedy", lambda *a, **k: greedy_runs.append(a[0].shape[0]) or
                            original(*a, **k))
    caches = _caches()
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    held = compress_regions(caches, accessors, [RegionCompression([None] * LAYERS, b) for b in batches], setup)
    for got, ref in zip(held, ref_held, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(got[layer].ids, ref[layer].ids) and torch.equal(got[layer].candidates,
                                                                               ref[layer].candidates)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))
    if setup.selector.batches_problems:  # every request's problems (2 anchors, x heads per head) in one run
        assert greedy_runs == [len(batches) * 2 * (HEADS if per_head else 1)]
    else:
        assert greedy_runs == []


def test_second_compressions_together_continue_from_each_requests_held_tokens():
    """Requests compressed together twice (held tokens of the first feed the second) equal each compressed alone."""
    setup = SelectionSetup(get_selector("cords"), "auto", False, (0, 0, 2, 2))
    batches = _batches()

    def second(batch: RegionBatch) -> RegionBatch:  # the kept blocks only, to half of them
        kept = batch.dst_slots.view(-1, BS)[:, 0] // BS
        keep = max(1, kept.numel() // 2)
        n_cand = kept.numel() * BS - TEXT
        return replace(batch, src_slots=slots_of(kept, BS), dst_slots=slots_of(kept[:keep], BS),
                       new_ids=batch.new_ids[:0], new_labels=batch.new_labels[:0], num_keep=keep * BS,
                       num_keep_candidates=keep * BS - TEXT, num_candidates=n_cand)

    caches = _caches()
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    ref_caches = _caches()
    ref_held = [compress_region(ref_caches, accessors, [None] * LAYERS, b, setup) for b in batches]
    ref_held = [compress_region(ref_caches, accessors, h, second(b), setup) for h, b in zip(ref_held, batches,
                                                                                              strict=True)]
    held = compress_regions(caches, accessors, [RegionCompression([None] * LAYERS, b) for b in batches], setup)
    held = compress_regions(caches, accessors, [RegionCompression(h, second(b)) for h, b in zip(held, batches,
                                                                                                  strict=True)],
                            setup)
    assert all(torch.equal(a[0].ids, b[0].ids) for a, b in zip(held, ref_held, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))


def test_a_request_that_fails_leaves_its_blocks_and_the_others_compressed():
    setup = SelectionSetup(get_selector("cords"), "auto", False, (0, 0, 2, 2))
    batches = _batches()
    bad = replace(batches[1], num_keep_candidates=batches[1].num_candidates)  # keeps every candidate: refused
    ref_caches, ref_held = _alone(setup, [batches[0], batches[2], batches[3]])
    caches = _caches()
    before = [c.clone() for c in caches]
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    held = compress_regions(caches, accessors, [RegionCompression([None] * LAYERS, b)
                                                for b in (batches[0], bad, batches[2], batches[3])], setup)
    assert isinstance(held[1], ValueError) and "need" in str(held[1])
    for got, ref in zip((held[0], held[2], held[3]), ref_held, strict=True):
        assert torch.equal(got[0].ids, ref[0].ids)
    failed = slots_of(torch.arange(batches[1].src_slots[0] // BS, batches[1].src_slots[-1] // BS + 1), BS)
    for layer in range(LAYERS):
        flat, ref_flat, old = (c.permute(0, 2, 1, 3).reshape(-1, HEADS, 2 * D) for c in (caches[layer],
                                                                                        ref_caches[layer],
                                                                                        before[layer]))
        assert torch.equal(flat[failed], old[failed])  # the failed request's blocks are untouched
        others = torch.ones(flat.shape[0], dtype=torch.bool)
        others[failed] = False
        assert torch.equal(flat[others], ref_flat[others])


@pytest.mark.parametrize(("per_head", "gather"), [(False, False), (True, False), (False, True)],
                         ids=["joint", "per_head", "joint_head_gather"])
def test_fused_compressions_together_share_one_greedy_run_and_keep_each_ones_tokens(monkeypatch, per_head, gather):
    """Where the fused step runs (CUDA; here Triton's interpreter), a step's compressions share their units' buffers
    and one greedy run: ``4 N + 4`` launches for ``N`` (plan, units, finish and copy each; one zero-fill, the two
    Gram GEMMs and the greedy kernel once; one more, a concatenation, for the frame compressions' stats, read back in
    one host sync for the step; counted on CPU, as ``tests/compress/test_compress_kernels.py`` counts 7
    for one), and each keeps the PyTorch path's tokens and writes its caches. With a head gather (tensor
    parallelism, here one rank's), four more per compression: its gathered units copied into the shared rows (three)
    and their norms."""
    from cords_vllm.compress import copy_triton, step_triton
    from cords_vllm.selection import cords_triton
    from tests.support.device_audit import HostSyncCounter

    if not copy_triton.interpreting():
        pytest.skip("launches are counted on CPU under TRITON_INTERPRET=1")
    batches = _batches()
    ref_caches, ref_held = _alone(SelectionSetup(get_selector("cords"), "auto", per_head, (0, 0, 2, 2),
                                                 kernels="torch"), batches)
    setup = SelectionSetup(get_selector("cords"), "auto", per_head, (0, 0, 2, 2), kernels="triton",
                           gather_heads=(lambda x: x) if gather else None)
    caches = _caches()
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    assert step_triton.covers(setup.selector, accessors, caches, None, setup.anchor_of)
    counter = HostSyncCounter()
    counter.watch_triton(monkeypatch, cords_triton, copy_triton, step_triton)
    with counter:
        held = compress_regions(caches, accessors, [RegionCompression([None] * LAYERS, b) for b in batches], setup)
    for got, ref in zip(held, ref_held, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(got[layer].ids, ref[layer].ids)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))
    n = len(batches)
    frames = sum(b.granularity == "frame" for b in batches)
    assert frames >= 2  # their reads are made together
    assert counter.launches == (8 if gather else 4) * n + 5, counter.launch_names
    assert counter.launch_names.count("triton:cords_triton") == 1
    assert len(counter.syncs) == 1, counter.syncs  # the step's frame compressions' one read


def test_fused_frame_compressions_together_sized_by_label_runs_read_nothing_back(monkeypatch):
    """As the worker gives them (the entering labels' runs), a step's fused compressions read nothing back: frames
    are sized by the runs (:func:`~cords_vllm.compress.step_triton._frames_bound`), in the step's shared buffers and
    greedy run (``4 N + 4`` launches), and the requests' next compressions together read only the runs the first
    ones copied to the host; each keeps the PyTorch path's tokens and caches, both times."""
    from cords_vllm.compress import copy_triton, step_triton
    from cords_vllm.compress.frames import label_runs
    from cords_vllm.compress.step import video_mask
    from cords_vllm.selection import cords_triton
    from tests.support.device_audit import HostSyncCounter

    if not copy_triton.interpreting():
        pytest.skip("launches are counted on CPU under TRITON_INTERPRET=1")
    batches = [replace(b, new_label_runs=label_runs(b.new_labels, video_mask(b.new_ids, b.spans)))
               for b in _batches()]
    seconds = [later_batch(b, TEXT, BS) for b in batches]
    ref_setup = SelectionSetup(get_selector("cords"), "auto", False, (0, 0, 2, 2), kernels="torch")
    ref_caches = _caches()
    accessors = [PagedAccessor.of(ref_caches[0], D)] * LAYERS
    ref_held = [compress_region(ref_caches, accessors, [None] * LAYERS, b, ref_setup) for b in batches]
    ref_held = [compress_region(ref_caches, accessors, h, b, ref_setup) for h, b in zip(ref_held, seconds,
                                                                                          strict=True)]
    setup = replace(ref_setup, kernels="triton")
    caches = _caches()
    counters = [HostSyncCounter(), HostSyncCounter()]
    counters[0].watch_triton(monkeypatch, cords_triton, copy_triton, step_triton)
    with counters[0]:
        held = compress_regions(caches, accessors, [RegionCompression([None] * LAYERS, b) for b in batches], setup)
    counters[1].watch_triton(monkeypatch, cords_triton, copy_triton, step_triton)
    with counters[1]:
        held = compress_regions(caches, accessors, [RegionCompression(h, b) for h, b in zip(held, seconds,
                                                                                             strict=True)], setup)
    for got, ref in zip(held, ref_held, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(got[layer].ids, ref[layer].ids)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))
    frames = sum(b.granularity == "frame" for b in batches)
    assert frames >= 2
    assert counters[0].launches == 4 * len(batches) + 4, counters[0].launch_names
    assert counters[0].syncs == []
    assert len(counters[1].syncs) == frames and all("late_read.py" in s for s in counters[1].syncs), counters[1].syncs


def test_a_steps_greedy_run_is_split_to_keep_its_gram_matrices_under_the_limit(monkeypatch):
    """With the step's Gram limit below what its problems need together, the shared greedy run goes in groups of
    problems, each group's two Gram matrices under the limit (every allocation of the run watched), and every
    compression keeps the PyTorch path's tokens and writes its caches, as in one run."""
    from cords_vllm.compress import copy_triton, gram_budget, step_triton
    from cords_vllm.selection import cords_triton

    if not copy_triton.interpreting():
        pytest.skip("the kernels run under TRITON_INTERPRET=1 on CPU")
    batches = _batches()
    ref_caches, ref_held = _alone(SelectionSetup(get_selector("cords"), "auto", False, (0, 0, 2, 2),
                                                 kernels="torch"), batches)
    setup = SelectionSetup(get_selector("cords"), "auto", False, (0, 0, 2, 2), kernels="triton")
    caches = _caches()
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    runs: list[tuple[int, int]] = []  # (problems, units) of each greedy launch
    original = cords_triton.greedy_from_units

    def watched(feats, *args, **kwargs):
        runs.append((feats.shape[0], feats.shape[1]))
        return original(feats, *args, **kwargs)

    monkeypatch.setattr(step_triton, "greedy_from_units", watched)
    limit = gram_budget.gram_bytes(64) * 3  # three problems of 64 units at a time
    monkeypatch.setattr(gram_budget, "_limit", [limit])
    held = compress_regions(caches, accessors, [RegionCompression([None] * LAYERS, b) for b in batches], setup)
    assert len(runs) >= 2, runs  # split
    assert all(p * gram_budget.gram_bytes(m) <= limit or p == 1 for p, m in runs), runs
    for got, ref in zip(held, ref_held, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(got[layer].ids, ref[layer].ids)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True))


@pytest.mark.parametrize(("problems", "units", "limit", "chunks"), [
    (16, 7744, 4 << 30, 2),  # sixteen token-unit compressions of a 7B model: 7.7 GB in one run, 3.8 GB a group
    (4, 64, 1 << 30, 1), (5, 64, 2 * 2 * 4 * 64 * 64, 3), (3, 100, 1, 3), (0, 64, 1 << 30, 1),
])
def test_problem_chunks_cover_every_problem_once_under_the_limit(problems, units, limit, chunks):
    from cords_vllm.compress.gram_budget import gram_bytes, problem_chunks

    got = problem_chunks(problems, units, limit)
    assert len(got) == chunks
    covered = [p for start, stop in got for p in range(start, stop)]
    assert covered == list(range(problems))
    assert all((stop - start) * gram_bytes(units) <= limit or stop - start == 1 for start, stop in got)
