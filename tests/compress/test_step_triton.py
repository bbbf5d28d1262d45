"""The fused compress step (:mod:`cords_vllm.compress.step_triton`) keeps what the PyTorch path keeps.

Where no GPU is, on CPU under Triton's interpreter (with a GPU, compiled, on CUDA tensors): random streams of text and
videos (frames that straddle blocks, several videos, the recent window, budgets that cover every frame, a budget of
no video at all), compressed twice the way the worker does (the kept blocks, then the blocks that followed), on
every policy the fused path covers, every granularity, joint and per head, one anchor or several. Equal means the
same held tokens (ids, video flags, frame labels) per layer and the same caches, bit for bit, after each compression,
and the same non-finite count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import sys

import pytest
import torch

import cords_vllm.compress.step_kernels as step_kernels
import cords_vllm.compress.step_triton as step_triton
from cords_vllm.compress.frames import label_runs
from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.kv_codec import codec_for
from cords_vllm.compress.step import RegionBatch, SelectionSetup, compress_region, describe_path
from cords_vllm.selection import get_selector
from tests.support.regions import on_device

pytest.importorskip("triton")
tl = step_kernels.tl
triton = step_kernels.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, BS, D, LAYERS, NUM_BLOCKS = 2, 8, 8, 3, 48

#: The policies the fused path covers, with settings that switch each of the greedy kernel's terms off.
POLICIES = {
    "cords": {},
    "cords_d2": {"lam": 0.0},
    "cords_keys": {"alpha": 1.0, "eta": 1.0},
    "cords_values": {"alpha": 0.0, "eta": 0.0},
    "cords_exact": {"novelty": "exact"},
    "cords_normalized_exact": {"space": "normalized", "novelty": "exact", "alpha": 0.8, "eta": 0.0, "lam": 0.5},
    "k_only": None,
    "v_only": None,
}


#: More settings the fused path covers, tested on their own (not in :data:`MATRIX`).
SETTINGS = {
    "cords_normalized": {"space": "normalized"},
    "cords_exact_values": {"novelty": "exact", "alpha": 0.1, "eta": 0.0, "lam": 0.5},
}


def _selector(policy: str):
    params = {**SETTINGS, **POLICIES}[policy]
    return get_selector(policy) if params is None else get_selector("cords", **params)


@dataclasses.dataclass
class Stream:
    """A request's tokens: ids ``0..n-1``, which are video, and each token's frame label (non-decreasing)."""

    video: torch.Tensor  # bool [n]
    labels: torch.Tensor  # long [n]
    spans: torch.Tensor  # long [V, 2]
    frame: int  # tokens per frame (the largest)


def _stream(g: torch.Generator, frame: int) -> Stream:
    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    parts, spans, n = [], [], 0
    for _ in range(draw(1, 2)):
        text = draw(2, 9)
        frames = draw(5, 9)
        parts += [("text", text), ("video", frames * frame)]
        spans.append([n + text, n + text + frames * frame])
        n += text + frames * frame
    parts.append(("text", 40))
    n += 40
    video = torch.zeros(n, dtype=torch.bool)
    labels = torch.zeros(n, dtype=torch.long)
    at, label = 0, 0
    for kind, size in parts:
        if kind == "video":
            video[at:at + size] = True
            labels[at:at + size] = label + 1 + torch.arange(size) // frame
            label += size // frame + 1
        else:
            label += 1
            labels[at:at + size] = label
        at += size
    return Stream(video, labels, torch.tensor(spans), frame)


def _batch(stream: Stream, granularity: str, held_ids: torch.Tensor | None, held_video: int, first_new: int,
           new_blocks: int, block_ids: torch.Tensor, g: torch.Generator, fraction: float,
           runs: bool = True) -> RegionBatch | None:
    """The region of ``held`` (``held_ids``, ``held_video`` of them video) then ``new_blocks`` blocks of new tokens,
    kept down to ``fraction`` of its candidates, rounded to whole blocks; ``None`` where no whole block fits.
    ``runs``: with the entering labels' runs, as the worker gives them (the fused step then reads nothing back)."""
    new_ids = torch.arange(first_new, first_new + new_blocks * BS)
    n_held = 0 if held_ids is None else held_ids.numel()
    video_new = int(stream.video[new_ids].sum())
    n_video = held_video + video_new
    recent = int(torch.randint(0, 2 * stream.frame, (1,), generator=g)) if n_video > 3 * stream.frame else 0
    n_cand = n_video - recent
    protected = n_held + new_ids.numel() - n_cand
    keep_blocks = min(-(-protected // BS) + int(fraction * n_cand) // BS, (protected + n_cand - 1) // BS)
    need = keep_blocks * BS - protected
    if n_cand < 2 or not 0 <= need < n_cand:
        return None
    blocks = block_ids[: (n_held + new_ids.numel()) // BS]
    return RegionBatch(
        src_slots=slots_of(blocks, BS), dst_slots=slots_of(blocks[:keep_blocks], BS), new_ids=new_ids,
        spans=stream.spans, new_labels=stream.labels[new_ids] if granularity == "frame" else None,
        new_label_runs=label_runs(stream.labels[new_ids], stream.video[new_ids]) if granularity == "frame" and runs
        else None,
        num_keep=keep_blocks * BS, num_keep_candidates=need, num_candidates=n_cand,
        group_size={"frame": stream.frame, "block": BS, "runs": stream.frame}.get(granularity),
        frame_tokens=stream.frame,
        num_recent=recent)


#: fp8 caches: the element type and the bytes of NaN (e4m3fn has no inf; e5m2's inf is the one non-finite byte it
#: shares with an overflowing number).
FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 0x7F), "fp8_e5m2": (torch.float8_e5m2, 0x7E)}


def _caches(seed: int, nan_at: tuple[int, int] | None = None, kv_dtype: str = "bfloat16",
            key_scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(LAYERS, NUM_BLOCKS, BS, HEADS, 2 * D, generator=g)
    raw[..., :D] *= key_scale
    raw = raw.to(FP8[kv_dtype][0]).view(torch.uint8) if kv_dtype in FP8 else raw.to(torch.bfloat16)
    raw[:, :, ::3] = raw[:, :, 1::3][:, :, : raw[:, :, ::3].shape[2]]  # duplicated tokens: exact ties
    if nan_at is not None:
        block, offset = nan_at
        if kv_dtype in FP8:
            raw[:, block, offset, 0, 1] = FP8[kv_dtype][1]
        else:
            raw[:, block, offset, 0, 1] = float("nan")
    return [layer.to(DEVICE).permute(0, 2, 1, 3) for layer in raw]  # NBHC behind the logical view


def _codecs(kv_dtype: str) -> list | None:
    """Per layer: per-head tensor scales on layer 0, numbers on the others (both forms vLLM's layers hold)."""
    if kv_dtype not in FP8:
        return None
    scales = [(torch.tensor([0.5, 2.0], device=DEVICE), torch.tensor([0.25], device=DEVICE))] + [(1.5, 0.75)] * 2
    return [codec_for(kv_dtype, k, v) for k, v in scales]


def _compress_twice(kernels: str, seed: int, policy: str, granularity: str, per_head: bool,
                    anchors: tuple[int, ...], fraction: float, nan_at: tuple[int, int] | None = None,
                    kv_dtype: str = "bfloat16", then: str | None = None, key_scale: float = 1.0, gather_heads=None,
                    runs: bool = True, counter=None):
    """Both compressions of one random stream; per compression the held tokens, caches and non-finite count.
    ``then``: the second compression's ``kernels``, when it differs from the first's; ``key_scale``: the keys'
    scale against the values'; ``gather_heads``: the setup's head gather (tensor parallelism); ``runs``: the
    batches give their labels' runs (:func:`_batch`); ``counter``: a context entered around the second compression."""
    g = torch.Generator().manual_seed(seed)
    stream = _stream(g, frame=int(torch.randint(9, 14, (1,), generator=g)))
    block_ids = torch.randperm(NUM_BLOCKS, generator=g)
    caches = _caches(seed, None if nan_at is None else (int(block_ids[nan_at[0]]), nan_at[1]), kv_dtype, key_scale)
    codecs = _codecs(kv_dtype)
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    unit = "block" if granularity == "runs" else granularity  # runs: blocks of a frame's length, as auto picks
    setup = SelectionSetup(_selector(policy), unit, per_head, anchors, kernels=kernels, gather_heads=gather_heads)
    nonfinite = torch.zeros((), dtype=torch.long, device=DEVICE)
    region = int(stream.spans[0, 1]) // BS  # the first video's blocks, the last cut by the block edge
    first = _batch(stream, granularity, None, 0, 0, region, block_ids, g, fraction, runs)
    assert first is not None
    held = compress_region(caches, accessors, [None] * LAYERS, on_device(first, DEVICE), setup, nonfinite=nonfinite,
                           codecs=codecs)
    out = [([(h.ids.cpu(), h.candidates.cpu(), None if h.labels is None else h.labels.cpu()) for h in held],
            [c.cpu().clone() for c in caches], int(nonfinite))]
    kept = first.num_keep // BS
    block_ids = torch.cat([first.src_slots.view(-1, BS)[:kept, 0] // BS, block_ids[region:]])
    second = _batch(stream, granularity, held[0].ids[0].cpu(), int(held[0].candidates[0].sum()), region * BS, 4,
                    block_ids, g, fraction, runs)
    if second is not None:
        if then is not None:
            setup = dataclasses.replace(setup, kernels=then)
        second = on_device(second, DEVICE)
        with counter if counter is not None else contextlib.nullcontext():
            held = compress_region(caches, accessors, held, second, setup, nonfinite=nonfinite, codecs=codecs)
        out.append(([(h.ids.cpu(), h.candidates.cpu(), None if h.labels is None else h.labels.cpu()) for h in held],
                    [c.cpu().clone() for c in caches], int(nonfinite)))
    return out


def _assert_same(ref, got) -> None:
    assert len(ref) == len(got)
    for (ref_held, ref_caches, ref_bad), (held, caches, bad) in zip(ref, got, strict=True):
        for (a_ids, a_video, a_labels), (b_ids, b_video, b_labels) in zip(ref_held, held, strict=True):
            assert torch.equal(a_ids, b_ids), (a_ids, b_ids)
            assert torch.equal(a_video, b_video)
            assert (a_labels is None) == (b_labels is None)
            assert a_labels is None or torch.equal(a_labels, b_labels)
        for a, b in zip(ref_caches, caches, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert ref_bad == bad


#: ``cords`` at every granularity and scope; each setting that switches off some of the greedy kernel's terms at one
#: of them, rotating (the terms do not depend on the unit), so that every granularity and scope meets several.
MATRIX = [("cords", g, h) for g in ("token", "block", "frame") for h in (False, True)] + [
    (policy, ("token", "block", "frame")[i % 3], bool(i % 2))
    for i, policy in enumerate(p for p in POLICIES if p != "cords")]


@pytest.mark.parametrize(("policy", "granularity", "per_head"), MATRIX)
def test_the_fused_step_keeps_what_the_reference_keeps(policy, granularity, per_head):
    seed = 7 * len(policy) + 3 * per_head + {"token": 0, "block": 1, "frame": 2}[granularity]
    anchors = (0, 0, 2) if seed % 2 else (0, 0, 0)
    fraction = (0.125, 0.25, 0.5)[seed % 3]
    _assert_same(_compress_twice("torch", seed, policy, granularity, per_head, anchors, fraction),
                 _compress_twice("triton", seed, policy, granularity, per_head, anchors, fraction))


@pytest.mark.parametrize(("granularity", "per_head"), [("token", False), ("block", True), ("frame", True)])
def test_the_normalized_space_scales_each_problems_units_as_the_reference(granularity, per_head):
    """Keys 30 times the values' scale: the normalized space (one more launch, the units scaled in place) keeps what
    the reference keeps, and not what the paper's space keeps (so the scaling is seen)."""
    ref = _compress_twice("torch", 4, "cords_normalized", granularity, per_head, (0, 0, 2), 0.25, key_scale=30.0)
    got = _compress_twice("triton", 4, "cords_normalized", granularity, per_head, (0, 0, 2), 0.25, key_scale=30.0)
    _assert_same(ref, got)
    paper = _compress_twice("torch", 4, "cords", granularity, per_head, (0, 0, 2), 0.25, key_scale=30.0)
    with pytest.raises(AssertionError):
        _assert_same(ref, paper)


@pytest.mark.parametrize("granularity", ["token", "frame"])
def test_a_head_gather_of_one_rank_keeps_what_the_reference_keeps(granularity):
    """The fused step's tensor-parallel path (units gathered across ranks, copied into the greedy run's rows, their
    norms made again) with one rank's gather; the ranks proper: ``tests/compress/test_tensor_parallel_heads.py``."""
    ref = _compress_twice("torch", 6, "cords", granularity, False, (0, 0, 2), 0.25)
    got = _compress_twice("triton", 6, "cords", granularity, False, (0, 0, 2), 0.25, gather_heads=lambda x: x)
    _assert_same(ref, got)


@pytest.mark.parametrize(("seed", "per_head", "anchors", "fraction"),
                         [(5, False, (0, 0, 2), 0.25), (8, True, (0, 1, 2), 0.5), (11, False, (0, 0, 0), 0.9)])
def test_frames_sized_by_label_runs_read_nothing_back_and_keep_what_reading_keeps(monkeypatch, seed, per_head,
                                                                                    anchors, fraction):
    """Given the entering labels' runs (as the worker gives them), a frame compression sizes its units by the runs
    of the held and the entering labels, and reads nothing of the device: a later compression's one read is the
    counts the last one copied to the host (:class:`~cords_vllm.compress.late_read.LateRead`; on CUDA host memory,
    complete a step ago). It keeps what the PyTorch path keeps and what the fused step reading the plan's stats
    keeps (its control: without the runs, the stats are read)."""
    from cords_vllm.compress import copy_triton
    from cords_vllm.selection import cords_triton
    from tests.support.device_audit import HostSyncCounter

    ref = _compress_twice("torch", seed, "cords", "frame", per_head, anchors, fraction)
    assert len(ref) == 2
    if DEVICE == "cuda":  # compiled: any host sync in the second compression raises
        _assert_same(ref, _compress_twice("triton", seed, "cords", "frame", per_head, anchors, fraction,
                                          counter=_no_sync()))
        return
    if not step_triton.interpreting():
        pytest.skip("the fused step runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    counters = {}
    for runs in (True, False):
        counters[runs] = HostSyncCounter()
        counters[runs].watch_triton(monkeypatch, cords_triton, copy_triton, step_triton)
        _assert_same(ref, _compress_twice("triton", seed, "cords", "frame", per_head, anchors, fraction,
                                          runs=runs, counter=counters[runs]))
    assert len(counters[True].syncs) == 1 and "late_read.py" in counters[True].syncs[0], counters[True].syncs
    assert len(counters[False].syncs) == 1 and "step_triton.py" in counters[False].syncs[0], counters[False].syncs


@contextlib.contextmanager
def _no_sync():
    """CUDA: a host sync inside the block raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_frame_count_past_the_hosts_bound_keeps_exactly_the_budget_and_the_next_compression_raises(monkeypatch):
    """The safety net under the bound (which holds by construction): sized too short, a frame compression still
    keeps exactly its budget of rows, the oldest candidates (so the copy reads only the region), and the request's
    next compression raises instead of compressing on."""
    if DEVICE != "cuda" and not step_triton.interpreting():
        pytest.skip("the fused step runs on CUDA, or on CPU under TRITON_INTERPRET=1")
    real, calls = step_triton._frames_bound, []
    monkeypatch.setattr(step_triton, "_frames_bound", lambda *args: 1 if not calls.append(1) and len(calls) == 1
                        else real(*args))  # the first compression's bound too short
    g = torch.Generator().manual_seed(2)
    stream = _stream(g, frame=10)
    block_ids = torch.randperm(NUM_BLOCKS, generator=g)
    caches = _caches(2)
    setup = SelectionSetup(_selector("cords"), "frame", False, (0, 0, 2), kernels="triton")
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    region = int(stream.spans[0, 1]) // BS
    batch = _batch(stream, "frame", None, 0, 0, region, block_ids, g, 0.25)
    held = compress_region(caches, accessors, [None] * LAYERS, on_device(batch, DEVICE), setup)
    ids = held[0].ids[0].cpu()
    assert ids.shape[0] == batch.num_keep and bool((ids[1:] > ids[:-1]).all())
    video = stream.video[ids]
    chosen = ids[video & (stream.labels[ids] != stream.labels[ids[-1]])]  # the edge frame, cut short, is kept whole
    assert torch.equal(chosen, stream.video.nonzero().flatten()[: chosen.shape[0]])  # the oldest candidates
    assert set(held[0].label_runs.values()) == {-1}  # each anchor's problem
    kept = batch.num_keep // BS
    block_ids = torch.cat([batch.src_slots.view(-1, BS)[:kept, 0] // BS, block_ids[region:]])
    second = _batch(stream, "frame", ids, int(video.sum()), region * BS, 4, block_ids, g, 0.25)
    with pytest.raises(RuntimeError, match="more frames than the host's bound"):
        compress_region(caches, accessors, held, on_device(second, DEVICE), setup)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("granularity", ["runs", "frame"])
def test_budgets_from_none_to_nearly_every_candidate(seed, granularity):
    """Budgets of little video, and budgets that cover every frame or run (every unit kept, trimmed to the oldest
    candidates: runs longer than a block, as ``granularity: auto`` picks, and frames), on random streams."""
    fraction = (0.0, 0.9, 1.0)[seed % 3]
    _assert_same(_compress_twice("torch", seed, "cords", granularity, False, (0, 1, 2), fraction),
                 _compress_twice("triton", seed, "cords", granularity, False, (0, 1, 2), fraction))


@pytest.mark.parametrize(("nan_at", "kv_dtype"), [
    ((0, 0), "bfloat16"), ((5, 3), "bfloat16"), ((5, 3), "fp8_e4m3"), ((0, 0), "fp8_e5m2")])
def test_non_finite_entries_are_read_as_zero_and_counted_once(nan_at, kv_dtype):
    """A NaN in a protected token (the first, text) or in a candidate (the 44th), in a floating or an fp8 cache: the
    same kept tokens, and the counter raised once per compression that read it."""
    ref = _compress_twice("torch", 11, "cords", "token", False, (0, 0, 0), 0.25, nan_at, kv_dtype)
    got = _compress_twice("triton", 11, "cords", "token", False, (0, 0, 0), 0.25, nan_at, kv_dtype)
    _assert_same(ref, got)
    assert got[0][2] == 1 and got[-1][2] >= 1


@pytest.mark.parametrize("granularity", ["block", "frame"])
@pytest.mark.parametrize("per_head", [False, True])
def test_tokens_held_by_one_path_are_compressed_by_the_other(granularity, per_head):
    """A first compression on the PyTorch path (per-layer held tokens, which the fused step stacks) then one on the
    fused step, and the other way round (the fused step's views, which the reference reads per layer)."""
    ref = _compress_twice("torch", 5, "cords", granularity, per_head, (0, 0, 2), 0.25)
    assert len(ref) == 2
    for first, then in (("torch", "triton"), ("triton", "torch")):
        _assert_same(ref, _compress_twice(first, 5, "cords", granularity, per_head, (0, 0, 2), 0.25, then=then))


@pytest.mark.parametrize(("kv_dtype", "granularity", "per_head"), [
    ("fp8_e4m3", "token", False), ("fp8_e4m3", "frame", True), ("fp8_e5m2", "block", True),
    ("fp8_e5m2", "frame", False)])
def test_fp8_caches_are_decoded_with_their_scales(monkeypatch, kv_dtype, granularity, per_head):
    """fp8 caches: the kernel decodes the bytes with every anchor's scales (per head on layer 0, numbers on layer 2)
    as the codec does, and the copy moves the bytes."""
    ref = _compress_twice("torch", 4, "cords", granularity, per_head, (0, 0, 2), 0.25, kv_dtype=kv_dtype)
    calls = []
    fused = step_triton.compress_region_fused_steps
    monkeypatch.setattr(step_triton, "compress_region_fused_steps", lambda *a, **k: calls.append(1) or fused(*a, **k))
    got = _compress_twice("triton", 4, "cords", granularity, per_head, (0, 0, 2), 0.25, kv_dtype=kv_dtype)
    assert len(calls) == len(got)
    _assert_same(ref, got)


def test_the_fused_path_runs_and_hands_back_what_it_does_not_cover(monkeypatch):
    """Every cords setting runs the fused step; another policy, or an anchor layer that follows another anchor, runs
    the PyTorch path (the fused step is never entered), and keeps the same tokens under either choice."""
    calls = []
    fused = step_triton.compress_region_fused_steps
    monkeypatch.setattr(step_triton, "compress_region_fused_steps", lambda *a, **k: calls.append(1) or fused(*a, **k))
    for policy in ("cords", "cords_exact", "cords_normalized"):
        calls.clear()
        _compress_twice("triton", 1, policy, "token", False, (0, 0, 0), 0.25)
        assert calls
    for policy, anchors in (("value_norm", (0, 0, 0)), ("cords", (0, 0, 1))):
        calls.clear()
        POLICIES.setdefault("value_norm", None)
        try:
            ref = _compress_twice("torch", 1, policy, "token", False, anchors, 0.25)
            got = _compress_twice("triton", 1, policy, "token", False, anchors, 0.25)
        finally:
            POLICIES.pop("value_norm")
        assert not calls
        _assert_same(ref, got)


def test_a_region_past_the_fused_steps_rows_is_handed_back_and_said(monkeypatch, caplog):
    """A region wider than :data:`~cords_vllm.compress.step_triton.MAX_ROWS` runs the greedy kernel and the copy
    (the same tokens), and the log says why, once."""
    monkeypatch.setattr(step_triton, "MAX_ROWS", 64)
    step_triton._handed_back.cache_clear()
    ref = _compress_twice("torch", 1, "cords", "frame", False, (0, 0, 0), 0.25)
    with caplog.at_level(logging.INFO, logger=step_triton.__name__):
        got = _compress_twice("triton", 1, "cords", "frame", False, (0, 0, 0), 0.25)
    _assert_same(ref, got)
    said = [r.getMessage() for r in caplog.records if "not the fused step" in r.getMessage()]
    assert said == ["cords-vllm: a compression ran the greedy kernel and the copy, not the fused step: a region of "
                    "more than 64 rows"]
    step_triton._handed_back.cache_clear()


def test_a_trim_that_keeps_the_newest_tokens_of_a_frame_is_caught(monkeypatch, tmp_path):
    """Negative control: the same comparison fails for a fused step whose exact-count rule keeps a trimmed unit's
    newest tokens instead of its oldest (the reference's rule): the kernels' module, with that one line changed, loaded
    from a file (Triton reads a kernel's source)."""
    source = inspect.getsource(step_kernels)
    rule = "kept = has_unit & (rank - first < quota)"
    assert source.count(rule) == 1
    mutant = tmp_path / "newest_first_trim.py"
    mutant.write_text(source.replace(rule, "kept = has_unit & (tl.load(unit_size + row + mine, mask=has_unit, "
                                           "other=0) - 1 - (rank - first) < quota)"))
    spec = importlib.util.spec_from_file_location("newest_first_trim", mutant)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses resolve their module
    spec.loader.exec_module(module)
    refs = {seed: _compress_twice("torch", seed, "cords", "frame", False, (0, 0, 0), 0.25) for seed in range(2, 6)}
    for seed, ref in refs.items():
        _assert_same(ref, _compress_twice("triton", seed, "cords", "frame", False, (0, 0, 0), 0.25))
    monkeypatch.setattr(step_triton, "compiled", module.compiled)
    caught = 0
    for seed, ref in refs.items():
        try:
            _assert_same(ref, _compress_twice("triton", seed, "cords", "frame", False, (0, 0, 0), 0.25))
        except AssertionError:
            caught += 1
    assert caught >= 2, caught


def _decode_every_byte(byte_ptr, e4m3_ptr, e5m2_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    b = tl.load(byte_ptr + i)
    tl.store(e4m3_ptr + i, step_kernels._e4m3(b))
    tl.store(e5m2_ptr + i, step_kernels._e5m2(b))


def test_the_fp8_decoders_are_exact_for_every_byte():
    """The units kernel's decoders give torch's fp32 value of all 256 bytes of both fp8 types, bit for bit (NaN bytes
    aside: the kernel masks them by their bits)."""
    if torch.cuda.is_available():
        pytest.skip("the decoders' own check runs interpreted (with a GPU the step tests cover them compiled)")
    import triton

    stored = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e4m3, e5m2 = torch.empty(256), torch.empty(256)
    triton.jit(_decode_every_byte)[(1,)](stored, e4m3, e5m2, N=256)
    for got, element in ((e4m3, torch.float8_e4m3fn), (e5m2, torch.float8_e5m2)):
        want = stored.view(element).float()
        same = torch.isnan(want) | (got.view(torch.int32) == want.view(torch.int32))
        assert same.all(), stored[~same]


@pytest.mark.parametrize(("policy", "params", "anchor_of", "expected"), [
    ("cords", {}, (0, 0, 2), "fused step: yes"),
    ("k_only", {}, (0, 0, 0), "fused step: yes"),
    ("cords", {"novelty": "exact"}, (0, 0, 0), "fused step: yes"),
    ("cords", {"space": "normalized"}, (0, 0, 0), "fused step: yes"),
    ("random", {}, (0, 0, 0), "fused step: no, the greedy kernel and the copy (random is not"),
    ("cords", {}, (0, 0, 1), "(an anchor layer follows another anchor)"),
])
def test_the_start_up_line_says_whether_the_fused_step_runs(policy, params, anchor_of, expected):
    caches = _caches(0)
    setup = SelectionSetup(get_selector(policy, **params), "token", False, anchor_of, kernels="triton")
    line = describe_path(caches, [PagedAccessor.of(caches[0], D)] * LAYERS, None, setup)
    assert line.startswith("Triton kernels (kernels=triton, from kv_policy_config 'kernels'); ") and expected in line
    torch_setup = SelectionSetup(get_selector(policy, **params), "token", False, anchor_of, kernels="torch")
    assert "fused" not in describe_path(caches, [PagedAccessor.of(caches[0], D)] * LAYERS, None, torch_setup)


@pytest.mark.parametrize("seed", range(8))
def test_the_frame_budget_is_the_references_on_frames_of_every_size(seed):
    """The plan kernel's frame count and frame budget (a bisection over frame sizes) against
    :func:`~cords_vllm.selection.exact._frames_holding` (a sort), on frames of random sizes, budgets from none to
    more than the frames hold, with the edge frame kept whole or not."""
    if torch.cuda.is_available():
        pytest.skip("runs interpreted on CPU")
    from cords_vllm.selection.exact import _frames_holding
    from cords_vllm.selection.granularity import labelled_group_ids

    g = torch.Generator().manual_seed(seed)
    group = int(torch.randint(2, 40, (1,), generator=g))
    sizes = torch.randint(1, group + 1, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
    labels = torch.repeat_interleave(torch.arange(1, sizes.numel() + 1), sizes)
    n = labels.numel()
    for need in sorted({0, 1, int(torch.randint(0, n, (1,), generator=g)), n - 1}):
        if need >= n:
            continue
        edge = labels == labels.max()
        n_edge = int(edge.sum())
        if not (n_edge < group and n_edge < need):
            edge = torch.zeros_like(edge)
        rest = ~edge
        gid, count = labelled_group_ids(labels[None], rest[None], group)
        want = (int(count[0]), int(_frames_holding(gid, count, torch.tensor([need - int(edge.sum())]))))

        def buf(dtype):
            return torch.empty(1, n, dtype=dtype)

        stats, count_out, still = torch.empty(1, 2, dtype=torch.int32), torch.empty(1, dtype=torch.int32), \
            torch.empty(1, dtype=torch.int32)
        empty = torch.empty(1, dtype=torch.long)
        step_triton.compiled(True, "plan")[(1,)](
            empty, empty, empty, 0, 0, torch.arange(n), labels, torch.tensor([[0, n]]), 1,
            buf(torch.long), buf(torch.bool), buf(torch.long), buf(torch.int32), buf(torch.int32), buf(torch.int32),
            buf(torch.int32), buf(torch.int32), buf(torch.bool), count_out, still, stats,
            torch.empty(1, dtype=torch.int32), 0, n, 1, 0, need, group,
            MODE=step_triton.FRAME, LABELS=True, BLOCK_T=triton.next_power_of_2(max(n, 16)))
        assert tuple(stats[0].tolist()) == want, (sizes.tolist(), need)
