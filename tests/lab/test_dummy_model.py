"""The weightless model directory at 7B shapes (:mod:`cords_vllm.lab.synthetic.dummy_model`): its config is the
published model's, its processor takes 448 x 448 frames whole, bad shapes are refused, and a scaled-down directory
from the same builder is served by ``vllm serve --load-format dummy`` under ``cords`` (the 7B path, on every run)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from cords_vllm.client import StreamClient
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic.dummy_model import SCALED_DOWN, SHAPES, DummyModelError, main, write_dummy_model

#: Scaled down for two CPU cores, the 7B vocabulary kept (sampled ids past the tokenizer's decode to nothing).
SMALL = SCALED_DOWN["qwen2-vl-7b"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_7b_directories_hold_the_published_shapes_and_no_weights(name, tmp_path):
    from transformers import AutoConfig, AutoProcessor

    out = write_dummy_model(tmp_path / name, name)
    assert not list(out.glob("*.safetensors")) and sum(p.stat().st_size for p in out.iterdir()) < 64 << 10
    config = AutoConfig.from_pretrained(out)
    text = config.text_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.vocab_size) == (3584, 18944, 28, 28, 4, 152064)
    assert config.vision_config.depth == 32 and config.dtype is not None
    grid = AutoProcessor.from_pretrained(out).video_processor(videos=[np.zeros((4, 448, 448, 3), np.uint8)],
                                                              return_tensors="pt")["video_grid_thw"]
    assert grid.tolist() == [[2, 32, 32]]
    assert json.loads((out / "dummy_model.json").read_text())["kv_bytes_per_token_bf16"] == 57344


@pytest.mark.parametrize(("overrides", "words"), [
    ({"num_attention_heads": 5}, "do not divide hidden size"),
    ({"num_key_value_heads": 3}, "KV heads do not divide"),
    ({"mrope_section": (8, 8, 8)}, "mrope_section"),
    ({"num_hidden_layers": 0}, "at least 1"),
    ({"vocab_size": 100}, "smaller than the tokenizer"),
])
def test_shapes_no_model_can_have_are_refused(overrides, words, tmp_path):
    with pytest.raises(DummyModelError, match=words):
        write_dummy_model(tmp_path / "m", "qwen2-vl-7b", **overrides)
    assert not (tmp_path / "m").exists()


def test_a_source_without_a_checkpoint_is_refused(tmp_path, capsys):
    with pytest.raises(DummyModelError, match="holds no checkpoint"):
        write_dummy_model(tmp_path / "m", source=tmp_path)
    assert main([str(tmp_path / "m"), "--source", str(tmp_path)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    with pytest.raises(DummyModelError, match="unknown shape"):
        write_dummy_model(tmp_path / "m", "llama-70b")


@pytest.mark.server
def test_a_scaled_down_directory_is_served_with_dummy_weights_under_cords(tmp_path):
    out = write_dummy_model(tmp_path / "small", "qwen2-vl-7b", **SMALL)
    args = ["--load-format", "dummy", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
            "--kv-cache-memory-bytes", str(32 << 20), "--kv-policy", "cords",
            "--kv-policy-config", json.dumps({"budget": 256, "recent": 64, "slack": 64, "max_text_tokens": 512})]
    with VLLMServer(out, args, startup_timeout=600) as server:
        client = StreamClient(server.base_url, timeout=300)
        with client.open() as stream:
            for seed in range(2):  # 448 x 448 frames: 256 video tokens a frame pair
                frames = np.random.default_rng(seed).integers(0, 255, (4, 448, 448, 3), np.uint8)
                assert stream.append(frames)["frames_sent"] == 4
            assert isinstance(stream.ask("What color was the square?", max_tokens=4), str)
            info = stream.refresh()
            assert info["kv_policy"]["policy"] == "cords" and info["status"] == "idle"
            kv, previous = info["kv"], None
            for _ in range(60):  # the engine publishes what a stream holds every half second: until it settles
                if kv is not None and kv == previous:
                    break
                previous = kv
                time.sleep(0.6)
                kv = stream.refresh()["kv"]
            assert kv["stream_tokens"] > 512 and kv["tokens"] < kv["stream_tokens"], kv  # compressed
            assert kv["tokens"] <= 256 + 64 + 64 + 64, kv  # budget + slack + the text of two pushes and a question
