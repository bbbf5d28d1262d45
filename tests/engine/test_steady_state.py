"""Steps without a compressed request in the batch leave vLLM's attention metadata alone."""

from __future__ import annotations

import pytest

import cords_vllm.integration.worker.attention_view as attention_view
from tests.engine.conftest import TEXT_PROMPT, VIDEO_PROMPT, run_engine, video

pytestmark = pytest.mark.engine


def test_the_view_is_built_only_while_a_compressed_request_is_in_the_batch(tiny_model, monkeypatch):
    calls: list[int] = []
    original = attention_view.compact_rows

    def counting(block_table, seq_lens, holes, block_size, *args):
        calls.append(len(holes))
        return original(block_table, seq_lens, holes, block_size, *args)

    monkeypatch.setattr(attention_view, "compact_rows", counting)
    text = run_engine(tiny_model, [{"prompt": TEXT_PROMPT}] * 2, "cords", max_tokens=4, budget=256, slack=64)
    assert text.compressions == 0 and calls == []  # policy on, nothing compressed: metadata untouched
    run = run_engine(tiny_model, [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(48)}}], "cords",
                     max_tokens=4, budget=256, slack=64)
    assert run.compressions >= 2 and calls and all(n == 1 for n in calls)
