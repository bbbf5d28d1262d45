"""A real `vllm serve` of the tiny model over HTTP on 127.0.0.1, stopped by PID."""

import pytest

from cords_vllm.lab.serving.process import VLLMServer, group_alive
from cords_vllm.lab.synthetic import make_video, mp4_data_url

pytestmark = pytest.mark.server

SERVE_ARGS = ["--kv-policy", "none", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
              "--kv-cache-memory-bytes", str(128 << 20), "--limit-mm-per-prompt", '{"image": 0, "video": 1}']


def test_serve_none_answers_video_and_text_then_stops(tiny_model):
    server = VLLMServer(tiny_model, SERVE_ARGS)
    with server:
        model = server.model_id()
        video = make_video(8, 112, 112, seed=0)
        status, body = server.post_json("/v1/chat/completions", {
            "model": model, "max_tokens": 6, "temperature": 0.0,
            "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": mp4_data_url(video.frames, fps=4)}},
                {"type": "text", "text": "What color was the square?"}]}],
        })
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] is not None
        assert body["usage"]["completion_tokens"] > 0
        assert body["usage"]["prompt_tokens"] > 30  # the video's tokens are in the prompt
        status, text_body = server.post_json("/v1/chat/completions", {
            "model": model, "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Hello there"}],
        })
        assert status == 200, text_body
        assert text_body["usage"]["prompt_tokens"] < body["usage"]["prompt_tokens"]
        pid = server.proc.pid
    assert server.proc.returncode is not None
    assert not group_alive(pid)
