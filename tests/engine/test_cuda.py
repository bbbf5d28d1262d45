"""CUDA checks of the compress path (skipped without a GPU; ``scripts/gpu-check.sh`` runs them on one).

On CPU-only machines the same properties are covered by stand-ins: ``tests/compress`` runs the step's glue and
the attention view on the ``meta`` device and audits every tensor factory for a missing device.
"""

from __future__ import annotations

import pytest
import torch

from cords_vllm.compress.attention_view import RowHoles, compact_rows
from cords_vllm.compress.kv_access import PagedAccessor, slots_of
from cords_vllm.compress.step import RegionBatch, SelectionSetup, compress_region
from cords_vllm.selection import available_selectors, get_selector

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


def test_engine_compresses_on_cuda_and_its_attention_view_never_synchronises(tiny_model, monkeypatch):
    import cords_vllm.integration.worker.attention_view as attention_view
    from tests.engine.conftest import VIDEO_PROMPT, run_engine, video

    original = attention_view.compact_rows
    calls = []

    def no_sync(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls.append(1)
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(attention_view, "compact_rows", no_sync)
    run = run_engine(tiny_model, [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(48)}}], "cords",
                     max_tokens=4, engine_kwargs={"enforce_eager": False}, budget=256, slack=64)
    assert run.compressions >= 2 and calls and len(run.token_ids[0]) == 4
    assert run.free_blocks_after == run.free_blocks_before


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
