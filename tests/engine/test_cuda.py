"""CUDA check of the engine's compress path (skipped without a GPU; ``scripts/gpu-check.sh`` runs it on one).

The pure core's CUDA checks (the compress step, its kernels, the attention view, the timer) are in
``tests/compress/test_cuda_core.py`` and need no vLLM.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
