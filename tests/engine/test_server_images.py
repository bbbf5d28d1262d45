"""Frames sent as ``image_url`` parts by the OpenAI client, as evaluation harnesses send a video, are compressed.

A real ``vllm serve --kv-policy cords`` whose KV pool is smaller than one uncompressed request: 64 frames of a
held-out question arrive as 64 PNG ``image_url`` parts (1,179 prompt tokens; the pool holds 768). The server
must answer, compress, and hold at most the request's compressed footprint at every moment; the blocks come
back afterwards.
"""

from __future__ import annotations

import json
import threading

import pytest

from cords_vllm.bench.http import scrape
from cords_vllm.client import frame_data_url
from cords_vllm.compress.plan import BudgetSettings, compressed_footprint_blocks
from cords_vllm.serving.process import VLLMServer
from cords_vllm.vqa import VideoGeometry, make_split, shipped_checkpoint

pytestmark = pytest.mark.server

BUDGET, RECENT, SLACK, BLOCK, TEXT = 256, 64, 64, 32, 128
POOL_BLOCKS = 24  # 768 tokens: less than one request's 64 frames sent as images
BYTES_PER_BLOCK = BLOCK * 4 * 2 * 2 * 64 * 4  # tokens x layers x (K, V) x KV heads x head dim x fp32
ARGS = ["--kv-policy", "cords", "--kv-policy-config",
        json.dumps({"budget": BUDGET, "recent": RECENT, "slack": SLACK, "max_text_tokens": TEXT}),
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "2048",
        "--max-num-batched-tokens", "2048", "--max-num-scheduled-tokens", "128",
        "--long-prefill-token-threshold", "128", "--kv-cache-memory-bytes", str(POOL_BLOCKS * BYTES_PER_BLOCK),
        "--limit-mm-per-prompt", '{"image": 64, "video": 1}', "--no-kv-streams"]


class PeakUsage:
    """Polls ``vllm:kv_cache_usage_perc`` while a request runs; ``peak`` is the largest fraction seen.

    A scrape that fails (the API server busy decoding the request's images, say) is recorded in ``errors``
    and polling goes on, so one slow answer cannot end the sampling; ``samples`` says how many succeeded.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url, self.peak, self._stop = base_url, 0.0, threading.Event()
        self.samples, self.errors = 0, []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                usage = scrape(self.base_url).get("vllm:kv_cache_usage_perc", 0.0)
            except OSError as e:  # URLError, timeouts and resets are all OSErrors
                self.errors.append(repr(e))
                continue
            self.samples += 1
            self.peak = max(self.peak, usage)

    def __enter__(self) -> PeakUsage:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def __repr__(self) -> str:
        return f"PeakUsage(peak={self.peak}, samples={self.samples}, errors={self.errors[:3]})"


def test_openai_client_64_frames_as_images_stay_within_the_footprint():
    from openai import OpenAI

    examples = make_split(["colour", "static"], 2, "heldout", geometry=VideoGeometry(num_frames=64))
    with VLLMServer(shipped_checkpoint(), ARGS) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300)
        model = client.models.list().data[0].id
        before = scrape(server.base_url)
        for example in examples:
            content = [{"type": "image_url", "image_url": {"url": frame_data_url(f, "png")}} for f in example.frames]
            with PeakUsage(server.base_url) as usage:
                reply = client.chat.completions.create(
                    model=model, max_tokens=1, temperature=0.0,
                    messages=[{"role": "user", "content": [*content, {"type": "text", "text": example.question}]}])
            prompt_tokens = reply.usage.prompt_tokens
            assert prompt_tokens > POOL_BLOCKS * BLOCK, "the uncompressed request must not fit the pool"
            candidates = 64 * (example.geometry.tokens_per_patch + 2)  # each image with its two vision markers
            footprint = compressed_footprint_blocks(prompt_tokens, candidates,
                                                    BudgetSettings(BUDGET, RECENT, SLACK), BLOCK)
            assert footprint <= POOL_BLOCKS
            assert 0 < usage.peak * (POOL_BLOCKS - 1) <= footprint + 1e-6, usage  # excludes the null block
            assert reply.choices[0].message.content.strip() == example.answer
        after = scrape(server.base_url)
        # 1,152 image tokens against a budget of 256 + slack 64: several compressions per request
        assert after["cords_vllm_compressions_total"] - before["cords_vllm_compressions_total"] >= 3 * len(examples)
        assert after["vllm:kv_cache_usage_perc"] == 0.0
