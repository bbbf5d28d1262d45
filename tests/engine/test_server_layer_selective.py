"""`vllm serve --kv-policy cords` with layer-selective compression (``compressed_layers``) over HTTP: the engine core
and the worker run in their own processes, so the compressed layers' spec crosses a process boundary as vLLM
pickles it; a video chat is compressed and answered, and the stream API refuses streams, saying why."""

from __future__ import annotations

import pytest

from cords_vllm.integration.handoff.published import await_published
from cords_vllm.lab.bench.http import scrape
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import make_video, mp4_data_url

pytestmark = pytest.mark.server


@pytest.mark.slow  # in -m slow (make test-slow): keeps the default suite under 20 minutes
def test_serve_lower_layers_compressed_answers_videos_and_refuses_streams(tiny_model):
    config = '{"budget": 256, "slack": 64, "compressed_layers": 2}'
    args = ["--kv-policy", "cords", "--kv-policy-config", config, "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "4096", "--block-size", "32", "--max-num-scheduled-tokens", "1024",
            "--kv-cache-memory-bytes", str(64 << 20), "--limit-mm-per-prompt", '{"image": 0, "video": 1}']
    with VLLMServer(tiny_model, args) as server:
        model = server.model_id()
        url = mp4_data_url(make_video(32, 224, 224, seed=0).frames, fps=2.0)
        status, body = server.post_json("/v1/chat/completions", {
            "model": model, "max_tokens": 3, "temperature": 0.0,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "What happened?"}]}]})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > 1024 and body["usage"]["completion_tokens"] == 3
        metrics = await_published(lambda: scrape(server.base_url), lambda m: m["cords_vllm_compressions_total"] >= 2)
        # one request held its compressed row plus the whole layers' row of all its 1,000+ tokens (32 per block)
        assert metrics["cords_vllm_request_kv_blocks_peak"] > (body["usage"]["prompt_tokens"] // 32)
        status, refused = server.post_json("/v1/streams", {})
        assert status == 501, refused
        assert "compressed_layers" in refused["error"]["message"]
