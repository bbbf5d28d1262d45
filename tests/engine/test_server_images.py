"""Frames sent as ``image_url`` parts by the OpenAI client, as evaluation harnesses send a video, are compressed.

A real ``vllm serve --kv-policy cords`` whose KV pool is smaller than one uncompressed request: 64 frames of a
held-out question arrive as 64 PNG ``image_url`` parts (1,179 prompt tokens; the pool holds 768). The server
must answer, compress, and hold at most the request's compressed footprint at every moment (the server's
``cords_vllm_request_kv_blocks_peak``, measured after every step's allocations); the blocks come back afterwards.
"""

from __future__ import annotations

import json
import time

import pytest

from cords_vllm.client import frame_data_url
from cords_vllm.compress.plan import BudgetSettings, compressed_footprint_blocks
from cords_vllm.integration.handoff.published import PUBLISH_INTERVAL_S, await_published
from cords_vllm.lab.bench.http import scrape
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.vqa import VideoGeometry, make_split, shipped_checkpoint

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


@pytest.mark.slow  # in -m slow (make test-slow): keeps the default suite under 20 minutes
def test_openai_client_64_frames_as_images_stay_within_the_footprint():
    from openai import OpenAI

    examples = make_split(["colour", "static"], 2, "heldout", geometry=VideoGeometry(num_frames=64))
    with VLLMServer(shipped_checkpoint(), ARGS) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300)
        model = client.models.list().data[0].id
        before = scrape(server.base_url)
        assert before["cords_vllm_request_kv_blocks_peak"] == 0
        footprints = []
        for example in examples:
            content = [{"type": "image_url", "image_url": {"url": frame_data_url(f, "png")}} for f in example.frames]
            reply = client.chat.completions.create(
                model=model, max_tokens=1, temperature=0.0,
                messages=[{"role": "user", "content": [*content, {"type": "text", "text": example.question}]}])
            prompt_tokens = reply.usage.prompt_tokens
            assert prompt_tokens > POOL_BLOCKS * BLOCK, "the uncompressed request must not fit the pool"
            candidates = 64 * (example.geometry.tokens_per_patch + 2)  # each image with its two vision markers
            footprints.append(compressed_footprint_blocks(prompt_tokens, candidates,
                                                          BudgetSettings(BUDGET, RECENT, SLACK), BLOCK))
            assert footprints[-1] <= POOL_BLOCKS
            assert reply.choices[0].message.content.strip() == example.answer
        # 1,152 image tokens against a budget of 256 + slack 64: several compressions per request
        after = await_published(lambda: scrape(server.base_url), lambda m: m["cords_vllm_compressions_total"]
                                - before["cords_vllm_compressions_total"] >= 3 * len(examples))
        time.sleep(2 * PUBLISH_INTERVAL_S)  # the high-water mark has its own publication timer
        after = scrape(server.base_url)
        # the most blocks any request held at once: past its kept budget and recent window, within its footprint
        peak = after["cords_vllm_request_kv_blocks_peak"]
        assert (BUDGET + RECENT) // BLOCK <= peak <= max(footprints), (peak, footprints)
        assert after["vllm:kv_cache_usage_perc"] == 0.0
