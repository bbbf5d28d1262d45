"""The README's main job, ``python -m cords_vllm.demo`` (``make demo``), on a small workload."""

from __future__ import annotations

import pytest

from cords_vllm import demo

pytestmark = pytest.mark.server


def test_demo_serves_answers_and_compresses(tiny_model, capsys):
    args = demo.parse_args(["--requests", "2", "--frames", "16", "--budget", "128", "--max-tokens", "3",
                            "--policies", "cords"])
    (result,) = demo.run_demo(args)
    out = capsys.readouterr().out
    assert result.num_requests == 2 and len(result.answers) == 2
    assert result.output_tokens == 2 * 3  # the random tiny model's text may be empty; its tokens are not
    # 16 frames at 224x224 = 512 video tokens per request, budget 128: each request is compressed
    assert result.compressions >= 2
    assert result.peak_blocks_in_use < result.total_blocks
    assert "answers of the cords server" in out and "server stopped" in out
    assert "peak KV blocks" in out
