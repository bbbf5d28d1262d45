"""The worker gives each frame compression the entering labels' runs (``RegionBatch.new_label_runs``), the host half
of the bound the fused step sizes its units by instead of reading the device
(:func:`~cords_vllm.compress.step_triton._frames_bound`). On the real engine: each batch's runs are those of the
labels and video tokens the batch carries to the device, and bound the frames the PyTorch path finds among them."""

from __future__ import annotations

import pytest

import cords_vllm.integration.worker.compressor as compressor
from cords_vllm.compress.frames import label_runs
from cords_vllm.compress.step import video_mask
from tests.engine.conftest import VIDEO_PROMPT, run_engine, video

pytestmark = pytest.mark.engine


def test_each_frame_batch_carries_the_runs_of_its_entering_labels(tiny_model, monkeypatch):
    """At ``granularity: auto`` (the default: every batch carries labels, whatever unit it picks)."""
    batches = []
    real = compressor.compress_regions

    def seen(caches, accessors, compressions, *args, **kwargs):
        batches.extend(c.batch for c in compressions)
        return real(caches, accessors, compressions, *args, **kwargs)

    monkeypatch.setattr(compressor, "compress_regions", seen)
    prompts = [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(48)}}]
    run = run_engine(tiny_model, prompts, "cords", max_tokens=2, budget=256, slack=64, granularity="auto")
    assert run.compressions >= 2 and len(batches) == run.compressions
    for batch in batches:
        assert batch.new_labels is not None
        labels, ids = batch.new_labels.cpu(), batch.new_ids.cpu()
        is_video = video_mask(ids, batch.spans.cpu())
        assert batch.new_label_runs == label_runs(labels, is_video)
        frames = int((labels[is_video][1:] != labels[is_video][:-1]).sum()) + 1
        assert frames <= batch.new_label_runs < frames + len(batch.spans)  # text splits no frame
