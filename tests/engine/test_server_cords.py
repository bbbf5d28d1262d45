"""A real `vllm serve --kv-policy cords` over HTTP: concurrent video chats, compression counters on /metrics."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess

import pytest

from cords_vllm.integration.handoff.published import await_published
from cords_vllm.lab.bench.http import run_http, scrape
from cords_vllm.lab.bench.workload import VideoWorkload
from cords_vllm.lab.serving.process import VLLMServer, server_env, vllm_executable
from cords_vllm.lab.synthetic import make_video, mp4_data_url

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
        # the scheduler and the worker publish their counters up to PUBLISH_INTERVAL_S after a change
        metrics = await_published(lambda: scrape(server.base_url),
                                  lambda m: m["cords_vllm_compressions_total"] >= 3
                                  and m["cords_vllm_selection_seconds_total"] > 0)
        assert metrics["cords_vllm_evicted_tokens_total"] > 0
        assert metrics["cords_vllm_kept_tokens_total"] > 0

        # the README's `vllm bench serve` command (random videos, OpenAI chat API) runs against it
        before = metrics["cords_vllm_compressions_total"]
        bench = subprocess.run(bench_serve_command(server.base_url, model, tiny_model, num_prompts=3),
                               env=server_env(), capture_output=True, text=True, timeout=600, check=False)
        assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
        assert "Successful requests:                     3" in bench.stdout
        await_published(lambda: scrape(server.base_url), lambda m: m["cords_vllm_compressions_total"] > before)

        # this server keeps vLLM's default of 32 frames per video: the HTTP benchmark refuses to measure
        # 40-frame videos it would silently shorten, and names the flag that keeps every frame
        with pytest.raises(RuntimeError, match="num_frames"):
            run_http(server.base_url, "cords", VideoWorkload(num_requests=1, frames=40, size=224, max_tokens=1))


def bench_serve_command(base_url: str, model: str, tokenizer: str, num_prompts: int) -> list[str]:
    """``vllm bench serve`` with random 512-frame videos (the README documents the same command)."""
    return [vllm_executable(), "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", base_url, "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random-mm",
            "--random-mm-bucket-config", "{(224, 224, 512): 1.0}", "--random-mm-base-items-per-request", "1",
            "--random-mm-limit-mm-per-prompt", '{"image": 0, "video": 1}', "--random-mm-num-mm-items-range-ratio",
            "0", "--num-prompts", str(num_prompts), "--random-input-len", "16", "--random-output-len", "8",
            "--ignore-eos", "--seed", "0"]
