"""The one-shot requests demo, ``python -m cords_vllm.lab.demo_requests``, on small workloads over real HTTP."""

from __future__ import annotations

import pytest

from cords_vllm import demo_requests as demo

pytestmark = pytest.mark.server


# In -m slow (make test-slow): keeps the default suite under 20 minutes. The default suite serves concurrent
# videos under cords over HTTP (tests/engine/test_server_cords.py) and runs the README's main job
# (tests/examples/test_demo.py).
@pytest.mark.slow
def test_demo_trained_model_answers_right_under_cords(capsys):
    args = demo.parse_args(["--requests", "4", "--frames", "64", "--policies", "cords"])
    (result,) = demo.run_demo(args)
    out = capsys.readouterr().out
    requests = demo.build_workload(args)[1].requests()
    right = sum(result.answers[r.request_id].strip() == r.answer for r in requests)
    # 64 frames = 512 video tokens, budget 1/8: every request is compressed, and still answers
    assert result.compressions >= 4
    assert right >= 3, result.answers
    assert f"cords: {right}/4 right" in out
    assert "server stopped" in out and "peak KV blocks" in out


@pytest.mark.slow  # the trained model's run above serves and compresses too
def test_demo_random_model_serves_and_compresses(tiny_model, capsys):
    args = demo.parse_args(["--model", "random", "--requests", "2", "--frames", "16", "--budget", "128",
                            "--max-tokens", "3", "--policies", "cords"])
    (result,) = demo.run_demo(args)
    out = capsys.readouterr().out
    assert result.num_requests == 2 and len(result.answers) == 2
    assert result.output_tokens == 2 * 3  # the random model's text may be empty; its tokens are not
    # 16 frames at 224x224 = 512 video tokens per request, budget 128
    assert result.compressions >= 1
    assert result.peak_blocks_in_use < result.total_blocks
    assert "answers of the cords server" in out
