"""CUDA checks of the pure core: the compress step and its kernels, the attention view, the compression timer.

Skipped without a GPU; they need torch (and Triton for the kernels) but no vLLM, so a GPU host with nothing else
runs them (``scripts/gpu-core-check.sh``). On CPU-only machines the same properties are covered by stand-ins:
``tests/compress`` runs the step's glue and the attention view on the ``meta`` device, counts host syncs and
launches, and runs the kernels under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from cords_vllm.compress.attention_view import RowHoles, compact_rows
from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.step import RegionBatch, SelectionSetup, compress_region
from cords_vllm.selection import available_selectors, get_selector
from tests.support.observed import with_observation

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("policy", available_selectors())
@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
def test_compress_region_on_cuda_equals_cpu(policy, granularity):
    layers, heads, bs, d, text, frame, frames = 3, 2, 16, 32, 5, 24, 12
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(40, heads, bs, 2 * d, generator=g) for _ in range(layers)]
    region = (text + frames * frame) // bs
    labels = torch.cat([torch.zeros(text, dtype=torch.long), torch.arange(frames).repeat_interleave(frame) + 1,
                        torch.full((64,), frames + 1)])
    results = []
    for device in ("cpu", "cuda"):
        blocks = torch.arange(2, 2 + region, device=device)
        batch = RegionBatch(
            src_slots=slots_of(blocks, bs), dst_slots=slots_of(blocks[:6], bs),
            new_ids=torch.arange(region * bs, device=device),
            spans=torch.tensor([[text, text + frames * frame]], device=device),
            new_labels=labels[: region * bs].to(device),
            num_keep=6 * bs, num_keep_candidates=6 * bs - text, num_candidates=region * bs - text,
            group_size={"frame": frame, "block": bs}.get(granularity), frame_budget=8, frame_tokens=frame)
        setup = SelectionSetup(get_selector(policy), granularity, False, (0, 0, 2))
        batch = with_observation(setup, batch, heads, d)
        on = [c.to(device, copy=True) for c in caches]  # each pass compacts its own copy
        held = compress_region(on, [PagedAccessor.of(on[0], d)] * layers, [None] * layers, batch, setup,
                               generator=torch.Generator(device=device).manual_seed(0))
        results.append(([h.ids.cpu() for h in held], [c.cpu() for c in on]))
    if get_selector(policy).stochastic:
        return  # a CUDA generator draws other numbers; running without a device error is the check
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert torch.equal(a, b)


def test_attention_view_never_synchronises():
    table = torch.arange(1, 61, dtype=torch.int32, device="cuda").view(5, 12)
    seq_lens = torch.full((5,), 40, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        compact_rows(table, seq_lens, [RowHoles(1, 2, 5), RowHoles(3, 0, 4)], 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_compression_timer_reads_cuda_events_without_waiting():
    from cords_vllm.integration.worker.timing import CompressionTimer

    timer = CompressionTimer.for_device(torch.device("cuda"))
    assert timer.on_device
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    mark = timer.start()
    for _ in range(50):
        x = x @ x / 4096
    timer.stop("a", mark)
    torch.cuda.set_sync_debug_mode("error")  # reading the events never waits for the device
    try:
        early = timer.completed()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    late = timer.completed()
    (timing,) = early + late
    assert timing.req_id == "a" and timing.seconds > 0 and timer.failure is None and timer.pending == 0
    # the same events read directly agree with the timer (record, query, elapsed_time of torch.cuda.Event)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    x = x @ x
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) > 0


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
def test_compress_step_on_cuda_keeps_the_cpu_reference_tokens_at_a_larger_size(kernels, granularity):
    """Both CUDA paths (the Triton kernels that ``auto`` picks, and the PyTorch path) keep the CPU reference's
    tokens and move the same elements, on a 1,536-token region of 8 layers in bf16."""
    layers, heads, bs, d, text, frame, frames = 8, 4, 16, 64, 16, 64, 24
    region = (text + frames * frame) // bs
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(region + 8, heads, bs, 2 * d, generator=g).bfloat16() for _ in range(layers)]
    labels = torch.cat([torch.zeros(text, dtype=torch.long), torch.arange(frames).repeat_interleave(frame) + 1])
    keep = region * 3 // 4
    out = []
    for device, choice in (("cpu", "torch"), ("cuda", kernels)):
        blocks = torch.randperm(region + 8, generator=torch.Generator().manual_seed(1))[:region].to(device)
        batch = RegionBatch(
            src_slots=slots_of(blocks, bs), dst_slots=slots_of(blocks[:keep], bs),
            new_ids=torch.arange(region * bs, device=device),
            spans=torch.tensor([[text, text + frames * frame]], device=device), new_labels=labels.to(device),
            num_keep=keep * bs, num_keep_candidates=keep * bs - text, num_candidates=frames * frame,
            group_size={"frame": frame, "block": bs}.get(granularity), frame_tokens=frame)
        setup = SelectionSetup(get_selector("cords"), granularity, False, (0, 0, 0, 0, 4, 4, 4, 4), kernels=choice)
        on = [c.to(device, copy=True) for c in caches]
        held = compress_region(on, [PagedAccessor.of(on[0], d)] * layers, [None] * layers, batch, setup)
        out.append(([h.ids.cpu() for h in held], [c.cpu() for c in on]))
    for a, b in zip(out[0][0], out[1][0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(out[0][1], out[1][1], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
