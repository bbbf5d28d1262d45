"""The README's main job, ``python -m cords_vllm.lab.demo`` (``make demo``): live cameras over real HTTP, small."""

from __future__ import annotations

import pytest

from cords_vllm import demo

pytestmark = [pytest.mark.server, pytest.mark.serial]  # its streams keep pace with a wall clock


def test_demo_streams_live_cameras_and_answers_right_under_cords(tmp_path, capsys):
    args = demo.parse_args(["--cameras", "2", "--frames", "48", "--fps", "8", "--policies", "cords",
                            "--out", str(tmp_path)])
    (run,) = demo.run_demo(args)
    out = capsys.readouterr().out
    assert run.sustained == 2 and not any(c.ended for c in run.cameras)
    assert len(run.answers) == 2 and all(a.text is not None for a in run.answers)
    assert sum(a.correct for a in run.answers) >= 1, run.answers
    # compressed: no stream ever held more than its bounded footprint, far below its uncompressed size
    assert 0 < run.peak_blocks_per_stream() < demo.stream_tokens(args) // demo.BLOCK
    assert "questions asked mid-stream" in out and "KV blocks held per stream" in out and "server stopped" in out
    assert (tmp_path / "kv_per_stream.png").stat().st_size > 10_000
    assert (tmp_path / "live_streams.json").is_file()
