"""The start-up warm-up compiles every kernel variant a server's compressions launch, and only the widths they take.

Two checks against references:

* the widths (:meth:`WarmupWidths.for_server`) against the planner: every compression the planner decides, over
  requests of many layouts and budgets, has its region's rows and, at token granularity, its units within them;
* the variants against real compressions, with Triton's own specialization function (``tests/compress/
  specialization.py``): every launch of compressions of many sizes within a server's limits, first and later ones,
  alone and a step's together, at every unit, is a variant the warm-up compiled. The negative control: a warm-up
  for a server of shorter requests misses the longer compressions' variants.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cords_vllm.compress import copy_triton, kernel_warmup, step_triton
from cords_vllm.compress.frames import label_runs
from cords_vllm.compress.kernel_warmup import WarmupWidths, warm_up
from cords_vllm.compress.kv_access import PagedAccessor
from cords_vllm.compress.plan import (
    BudgetSettings,
    CandidateSpans,
    RequestCompressionState,
    apply_plan,
    next_compression_point,
    plan_compression,
)
from cords_vllm.compress.step import RegionCompression, SelectionSetup, compress_region, compress_regions, video_mask
from cords_vllm.selection import cords_triton, get_selector
from tests.support.device_audit import watch_launches
from tests.support.regions import first_batches, later_batch, on_device
from tests.support.specialization import specialization

pytest.importorskip("triton")

LAYERS, HEADS, D, BS, FRAME, BLOCKS = 4, 2, 8, 4, 6, 160
#: The server of the variant checks: budget, slack, recent, and the most tokens a request holds.
BUDGET, SLACK, RECENT, MAX_ROWS = 24, 8, 4, 120
#: Requests within that server's limits, ``(text, frames, kept blocks)``, first and later compressions alike: regions
#: of 32 to 116 rows (more than budget + slack less a block), 25 to 34 candidates (at most budget + slack and two
#: blocks, more than that less the recent window), over three rows widths.
REQUESTS = ((2, 6, 8), (40, 6, 17), (82, 6, 27))
#: Each request's recent window in its regions (the newest video tokens, protected): 1, another and 0.
RECENTS = (1, 3, 0)


def _widths(granularity: str, max_rows: int = MAX_ROWS) -> WarmupWidths:
    return WarmupWidths.for_server(budget=BUDGET, slack=SLACK, block_size=BS, max_rows=max_rows,
                                   granularity=granularity, frames_known=True)


def _server(granularity: str, max_rows: int = 10784, frames_known: bool = True) -> WarmupWidths:
    """A 7B server's defaults: budget 2,048, slack 512, blocks of 16, requests of at most 10,784 tokens."""
    return WarmupWidths.for_server(budget=2048, slack=512, block_size=16, max_rows=max_rows, granularity=granularity,
                                   frames_known=frames_known)


def test_the_widths_of_a_server():
    token = _server("token")
    assert token.rows == (512, 1024, 2048, 4096, 8192, 16384)  # regions of 498 to 10,784 rows
    assert token.units == (512, 1024, 2048, 4096)  # 498 to 2,592 candidates
    assert token.modes == (step_triton.TOKEN,) and not token.labels
    auto = _server("auto")
    assert auto.units == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) and auto.labels
    assert set(auto.modes) == {step_triton.TOKEN, step_triton.BLOCK, step_triton.FRAME}
    unknown = _server("auto", frames_known=False)
    assert step_triton.FRAME not in unknown.modes and not unknown.labels
    assert _server("block").units == (32, 64, 128, 256, 512, 1024, 2048, 4096)  # runs of a block; the token fall-back
    assert _server("frame").modes == (step_triton.FRAME,) and _server("frame").labels
    assert _server("token", max_rows=400).rows == ()  # requests too short to reach a compression: nothing to compile


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(8, 200), narrowed=st.floats(0.0, 1.0), slack=st.integers(0, 64),
       recent_share=st.floats(0.0, 0.9), bs=st.sampled_from([4, 16]),
       layout=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 400)), min_size=1, max_size=3),
       tail=st.integers(0, 40))
def test_every_compression_the_planner_decides_is_within_the_widths(budget, narrowed, slack, recent_share, bs, layout,
                                                                    tail):
    """The planner's compressions of a request (text and videos, in chunks ending at its compression points, as the
    scheduler runs them), at the server's budget or one the request narrowed, have their regions' rows and token
    units among the server's widths."""
    mine = max(1, round(budget * narrowed))
    recent = min(int(mine * recent_share), mine - 1)
    spans, at = [], 0
    for text, frames in layout:
        spans.append((at + text, at + text + frames))
        at += text + frames
    prompt = at + tail
    video = CandidateSpans(tuple(spans))
    budget_settings = BudgetSettings(mine, recent, slack)
    widths = WarmupWidths.for_server(budget=budget, slack=slack, block_size=bs, max_rows=prompt, granularity="token",
                                     frames_known=True)
    state, computed, row = RequestCompressionState(), 0, list(range(1, prompt // bs + 2))
    while (point := next_compression_point(state, video, computed, prompt, budget_settings, bs)) is not None:
        plan = plan_compression("r", row, point, prompt, video, state, budget_settings, bs)
        assert plan is not None
        assert max(16, 1 << (plan.num_held - 1).bit_length()) in widths.rows, (plan.num_held, widths)
        units = plan.num_held_candidates
        assert max(16, 1 << (units - 1).bit_length()) in widths.units, (units, widths)
        state, computed = apply_plan(state, plan), point


def _keys(launches) -> set:
    return {(launch.name, *specialization(launch.kernel, launch.args, launch.kwargs)) for launch in launches}


def _compress_requests(caches, accessors, setup, granularity: str) -> None:
    """:data:`REQUESTS`' first and later compressions, alone and together, as the worker runs them (frame labels
    where the granularity reads frames, the non-finite count)."""
    device = caches[0].device
    batches = first_batches([(t, f, k, granularity) for t, f, k in REQUESTS], FRAME, BS, BLOCKS)
    batches = [replace(b, num_recent=r, num_candidates=b.num_candidates - r,
                       num_keep_candidates=b.num_keep_candidates - r)
               for b, r in zip(batches, RECENTS, strict=True)]
    if granularity != "frame":
        batches = [replace(b, new_labels=None) for b in batches]
    else:  # the entering labels' runs, as the worker gives them (the fused step then reads nothing back)
        batches = [replace(b, new_label_runs=label_runs(b.new_labels, video_mask(b.new_ids, b.spans)))
                   for b in batches]
    texts = [text for text, _, _ in REQUESTS]
    firsts = [on_device(b, device) for b in batches]
    laters = [later_batch(b, text, BS) for b, text in zip(firsts, texts, strict=True)]
    for c in (*firsts, *laters):
        assert BUDGET + SLACK - BS < c.src_slots.numel() <= MAX_ROWS
        assert BUDGET + SLACK - BS - RECENT < c.num_candidates <= BUDGET + SLACK + 2 * BS
    nonfinite = torch.zeros((), dtype=torch.long, device=device)
    for first, later in zip(firsts, laters, strict=True):
        held = compress_region(caches, accessors, [None] * LAYERS, first, setup, nonfinite=nonfinite)
        compress_region(caches, accessors, held, later, setup, nonfinite=nonfinite)
    held = compress_regions(caches, accessors, [RegionCompression([None] * LAYERS, b) for b in firsts], setup,
                            nonfinite=nonfinite)
    compress_regions(caches, accessors, [RegionCompression(h, b) for h, b in zip(held, laters, strict=True)], setup,
                     nonfinite=nonfinite)


def _real_launches(monkeypatch, caches, accessors, setup, granularity: str) -> set:
    """Triton's specialization of every launch of :func:`_compress_requests`."""
    seen: list = []

    def run(label, kernel, grid, args, kwargs):
        name = {"cords_triton": "greedy", "copy_triton": "copy"}.get(label, label.split(":")[-1])
        seen.append((name, *specialization(kernel, args, kwargs)))
        return kernel[grid](*args, **kwargs)

    with monkeypatch.context() as patch:
        watch_launches(patch, (step_triton, cords_triton, copy_triton), run)
        _compress_requests(caches, accessors, setup, granularity)
    return set(seen)


@pytest.mark.parametrize("granularity", ["token", "frame"])  # the units' two ends: every candidate, labelled frames
def test_the_warm_up_compiles_every_variant_the_servers_compressions_launch(monkeypatch, granularity):
    if not copy_triton.interpreting():
        pytest.skip("the launches are compared on CPU under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(BLOCKS, HEADS, BS, 2 * D, generator=g) for _ in range(LAYERS)]
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    setup = SelectionSetup(get_selector("cords"), granularity, False, (0, 0, 2, 2), kernels="triton")
    before = [c.clone() for c in caches]
    report = warm_up(caches, accessors, None, setup, _widths(granularity))
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))  # the template blocks put back
    assert {v.name for v in report.variants} == {"plan", "units", "greedy", "finish", "copy"}
    w = report.widths  # each variant once, the first and the later compressions' launches alike
    assert len(report.variants) == len(w.rows) * len(w.modes) + len(w.rows) + len(w.modes) + len(w.units) + 1
    assert "compiled" in report.describe()
    warmed = _keys(report.variants)

    real = _real_launches(monkeypatch, caches, accessors, setup, granularity)
    assert {name for name, *_ in real} == {"plan", "units", "greedy", "finish", "copy"}
    missed = real - warmed
    assert not missed, sorted((name, fixed) for name, fixed, _ in missed)
    rows = {dict(fixed).get("BLOCK_T") for name, fixed, _ in real if name == "plan"}
    assert len(rows) >= 3, rows  # the requests span several widths
    # The control: a warm-up for requests of at most 64 rows misses the longer compressions' variants.
    short = _keys(warm_up(caches, accessors, None, setup, _widths(granularity, max_rows=64)).variants)
    assert {name for name, *_ in real - short} >= {"plan", "finish"}


def test_a_launch_is_recorded_with_what_compiles_it():
    """The recorded launches keep Triton's jitted kernels (what the warm-up compiles), not a stand-in."""
    if not copy_triton.interpreting():
        pytest.skip("recorded on CPU under TRITON_INTERPRET=1")
    caches = [torch.zeros(8, HEADS, BS, 2 * D) for _ in range(2)]
    accessors = [PagedAccessor.of(caches[0], D)] * 2
    setup = SelectionSetup(get_selector("cords"), "token", False, (0, 0), kernels="triton")
    report = warm_up(caches, accessors, None, setup, _widths("token"))
    assert all(callable(getattr(v.kernel, "warmup", None)) for v in report.variants)
    assert kernel_warmup.TEMPLATE_BLOCKS < 8


@pytest.mark.parametrize("policy", ["snapkv", "infinipot_v"])
def test_the_copy_alone_is_warmed_for_a_policy_scoring_observed_queries(monkeypatch, policy):
    """A policy that scores a request's own queries has no start-up compression: the warm-up copies the template
    blocks' rows onto themselves (the caches unchanged), and a real compression of that policy launches that copy
    variant and no other kernel (its selection runs on the PyTorch path)."""
    if not copy_triton.interpreting():
        pytest.skip("the launches are compared on CPU under TRITON_INTERPRET=1")
    from tests.support.observed import with_observation

    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(BLOCKS, HEADS, BS, 2 * D, generator=g) for _ in range(LAYERS)]
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    before = [c.clone() for c in caches]
    report = kernel_warmup.warm_up_copy(caches, accessors)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
    assert [v.name for v in report.variants] == ["copy"]
    assert report.describe().startswith("compiled 1 kernel variants (copy) in ")

    setup = SelectionSetup(get_selector(policy), "token", False, (0, 0, 2, 2), kernels="triton")
    batch = with_observation(setup, on_device(first_batches([(40, 6, 17, "token")], FRAME, BS, BLOCKS)[0], "cpu"),
                             HEADS, D)
    seen: list = []

    def run(label, kernel, grid, args, kwargs):
        seen.append((label, *specialization(kernel, args, kwargs)))
        return kernel[grid](*args, **kwargs)

    with monkeypatch.context() as patch:
        watch_launches(patch, (step_triton, cords_triton, copy_triton), run)
        compress_region(caches, accessors, [None] * LAYERS, batch, setup,
                        nonfinite=torch.zeros((), dtype=torch.long))
    assert [label for label, *_ in seen] == ["copy_triton"]
    assert {tuple(key) for _, *key in seen} == {tuple(key) for _, *key in _keys(report.variants)}
    # caches the copy does not address in one launch (the CPU engine's tiles): nothing to compile, nothing written
    tiles = kernel_warmup.warm_up_copy(caches, [object()] * LAYERS)
    assert tiles.variants == () and tiles.describe() == "nothing to compile"


@pytest.mark.slow
def test_every_variant_of_a_7b_servers_warm_up_compiles_for_sm90_without_spilling():
    """The warm-up of a Qwen2-VL-7B server at the defaults (4 KV heads x 128, bf16, blocks of 16, ``auto``, budget
    2,048, requests of at most 10,784 tokens): 37 variants, each compiled for sm_90 as Triton's JIT compiles it there
    (about a minute on two cores: what a fresh GPU machine's start-up adds, once). None spills more than 1 KB of
    registers per thread and the copy none, and the copy and the units kernel read the cache 16 bytes per access. On
    an H100 the plan program at 4 warps (2-3 KB spilled), the units kernel's non-finite scan of 64 rows (6.7 KB) and
    the copy without its alignment hint (one element per access) cost 2.5-3 ms of a 4.5 ms compression. In the slow
    suite."""
    pytest.importorskip("triton.backends.nvidia")
    if not copy_triton.interpreting():
        pytest.skip("recorded on CPU under TRITON_INTERPRET=1")
    from tests.support.cuda_compile import usage_as_launched

    caches = [torch.randn(16, 4, 16, 256).to(torch.bfloat16) for _ in range(2)]
    setup = SelectionSetup(get_selector("cords"), "auto", False, (0, 0), kernels="triton")
    widths = WarmupWidths.for_server(budget=2048, slack=512, block_size=16, max_rows=10784, granularity="auto",
                                     frames_known=True)
    report = warm_up(caches, [PagedAccessor.of(caches[0], 128)] * 2, None, setup, widths)
    assert len(report.variants) == 37
    usage = usage_as_launched([(v.kernel, v.args, v.kwargs) for v in report.variants])
    spills = {(v.name, v.kwargs.get("BLOCK_T") or v.kwargs.get("BLOCK")): u.stack_bytes
              for v, u in zip(report.variants, usage, strict=True) if u.stack_bytes}
    assert max(spills.values(), default=0) <= 1024, spills
    copy = [u for v, u in zip(report.variants, usage, strict=True) if v.name == "copy"]
    assert copy and all(u.stack_bytes == 0 and u.store_bits == (128,) for u in copy), copy
    units = [u for v, u in zip(report.variants, usage, strict=True) if v.name == "units"]
    assert units and all(max(u.load_bits) == 128 for u in units), units  # the cache read 16 bytes at a time


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
def test_after_the_warm_up_compressions_compile_nothing_on_cuda(granularity):
    """On a GPU: the warm-up compiles, and the compressions of many sizes within the server's limits that follow
    compile no kernel."""
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(BLOCKS, HEADS, BS, 2 * D, generator=g).cuda() for _ in range(LAYERS)]
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    setup = SelectionSetup(get_selector("cords"), granularity, False, (0, 0, 2, 2), kernels="triton")
    report = warm_up(caches, accessors, None, setup, _widths(granularity))
    assert report.variants
    before = kernel_warmup.compiled_variants()
    if before is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    _compress_requests(caches, accessors, setup, granularity)
    torch.cuda.synchronize()
    assert kernel_warmup.compiled_variants() == before
