"""A real `vllm serve --kv-policy cords` over HTTP: concurrent video chats, compression counters on /metrics."""

from __future__ import annotations

import concurrent.futures
import re

import pytest

from cords_vllm.testing import make_video, mp4_data_url
from cords_vllm.testing.server import VLLMServer

pytestmark = pytest.mark.server


def _counter(metrics: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", metrics, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_serve_cords_answers_concurrent_videos_and_exports_counters(tiny_model):
    args = ["--kv-policy", "cords", "--kv-policy-config", '{"budget": 256, "slack": 64}', "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "8192", "--block-size", "32", "--max-num-batched-tokens",
            "8192", "--max-num-scheduled-tokens", "1024", "--long-prefill-token-threshold", "256",
            "--kv-cache-memory-bytes", str(128 << 20), "--limit-mm-per-prompt", '{"image": 0, "video": 1}']
    with VLLMServer(tiny_model, args) as server:
        status, metrics = server.get("/metrics")
        assert status == 200
        assert _counter(metrics, "cords_vllm_compressions_total") == 0
        model = server.model_id()
        # 32 JPEG frames at 224x224 -> 1024 video tokens each
        urls = [mp4_data_url(make_video(32, 224, 224, seed=s).frames, fps=2.0) for s in range(3)]

        def ask(url):
            return server.post_json("/v1/chat/completions", {
                "model": model, "max_tokens": 4, "temperature": 0.0,
                "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                          {"type": "text", "text": "What happened?"}]}]})

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(ask, urls))
        for status, body in replies:
            assert status == 200, body
            assert body["usage"]["prompt_tokens"] > 1024
            assert body["usage"]["completion_tokens"] == 4
        status, metrics = server.get("/metrics")
        assert _counter(metrics, "cords_vllm_compressions_total") >= 3
        assert _counter(metrics, "cords_vllm_evicted_tokens_total") > 0
        assert _counter(metrics, "cords_vllm_kept_tokens_total") > 0
        assert _counter(metrics, "cords_vllm_selection_seconds_total") > 0
