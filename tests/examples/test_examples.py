"""Every example runs (small sizes), so none can rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import encode_mp4, make_video

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))


def _mp4(path: Path, frames: int, seed: int) -> Path:
    path.write_bytes(encode_mp4(make_video(frames, 224, 224, seed=seed).frames, fps=2.0))
    return path


@pytest.mark.engine
def test_offline_llm_video_runs():
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run([sys.executable, str(EXAMPLES / "offline_llm_video.py"), "--budget", "256",
                          "--max-tokens", "4"], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "answer:" in out.stdout and "prompt:" in out.stdout


#: Runs with ``-m slow`` (about 30 s; keeps the default suite under 20 minutes on 2 cores).
@pytest.mark.slow
@pytest.mark.engine
def test_budget_and_layers_runs_every_setting():
    import budget_and_layers

    rows = budget_and_layers.main(["--frames", "32"])
    assert len(rows) == 1 + len(budget_and_layers.SETTINGS)
    assert rows[0]["compressions"] == 0
    assert all(r["compressions"] >= 1 for r in rows[1:])
    assert all(r["peak_blocks"] < rows[0]["peak_blocks"] for r in rows[1:])


@pytest.mark.engine
def test_compare_policies_on_video_files(tmp_path):
    import compare_policies

    files = [str(_mp4(tmp_path / f"clip{i}.mp4", 32, i)) for i in range(2)]
    rows = compare_policies.main([*files, "--policies", "none", "cords", "--budget", "256"])
    assert [r["label"] for r in rows] == ["none", "cords"]
    assert rows[1]["compressions"] >= 2 and rows[0]["compressions"] == 0


@pytest.mark.server
@pytest.mark.slow  # the same client path: tests/engine/test_server_images.py, the demo
def test_openai_client_sends_data_url_and_file(tiny_model, tmp_path, capsys):
    import openai_client_video

    clip = _mp4(tmp_path / "clip.mp4", 32, 0)
    args = ["--kv-policy", "cords", "--kv-policy-config", '{"budget": 256}', "--enforce-eager", "--block-size", "32",
            "--max-model-len", "4096", "--kv-cache-memory-bytes", str(64 << 20), "--allowed-local-media-path",
            str(tmp_path), "--limit-mm-per-prompt", '{"image": 0, "video": 1}']
    with VLLMServer(tiny_model, args) as server:
        openai_client_video.main(["--url", server.base_url, "--video", str(clip), "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert "data URL :" in out and "file URL :" in out
