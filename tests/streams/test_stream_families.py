"""Every supported family over HTTP: ``vllm serve <Qwen2.5-VL | Qwen3-VL | LLaVA-NeXT-Video> --kv-policy cords``.

A real server per family (tiny fp32 checkpoint of the real architecture) takes a live stream through
``/v1/streams`` (the camera's ``fps`` gives every frame its time: Qwen2.5-VL's temporal positions and Qwen3-VL's
timestamp text follow it), compresses it as it arrives and answers; a one-shot ``video_url`` request and frames
sent as ``image_url`` parts are answered too, and every block comes back. LLaVA-NeXT-Video's stream is written
in its own chat markup (``USER: <video>\n... ASSISTANT:``) and re-based at every push like the others (1-D
positions continue from the stream's largest), its protected text counted as the engine counts it.
"""

from __future__ import annotations

import base64
import json

import pytest

from cords_vllm.client import StreamClient, frame_data_url
from cords_vllm.lab.bench.http import scrape
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_model, encode_mp4, make_video
from cords_vllm.lab.synthetic.tiny_llava import build_tiny_llava_next_video
from tests.streams.test_stream_api import wait_until

pytestmark = pytest.mark.server

BUDGET, RECENT, SLACK, BLOCK = 128, 32, 32, 32
ARGS = ["--kv-policy", "cords", "--kv-policy-config",
        json.dumps({"budget": BUDGET, "recent": RECENT, "slack": SLACK, "max_text_tokens": 512}),
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "8192",
        "--kv-cache-memory-bytes", str(48 << 20), "--limit-mm-per-prompt", '{"image": 8, "video": 1}']


# The families' live streams over HTTP in -m slow (make test-slow; their engine sessions are checked in the default
# suite by tests/engine/test_families.py, and the HTTP stream itself by tests/streams/test_stream_api.py on Qwen2-VL):
# keeps the default suite under 20 minutes
@pytest.fixture(scope="module", params=[pytest.param("qwen2_5_vl", marks=pytest.mark.slow),
                                        pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def server(request):
    path = build_tiny_model(TinyModelSpec(family=request.param, dtype="float32"))
    with VLLMServer(str(path), ARGS) as srv:
        yield srv


def _frames(n: int, seed: int, size: int = 112):
    return make_video(n, size, size, seed=seed).frames


def test_a_live_stream_is_compressed_and_answered(server):
    client = StreamClient(server.base_url, timeout=120)
    with client.open(fps=4.0) as stream:
        assert stream.info["fps"] == 4.0
        for i in range(10):
            stream.append(_frames(4, seed=i), fmt="png")
        answer = client.request("POST", f"/v1/streams/{stream.id}/ask",
                                {"question": "What color was the square?", "max_tokens": 3})
        assert answer["usage"]["completion_tokens"] >= 1  # a random tiny model may answer <|im_end|> at once

        def listed():
            return next(s for s in client.list() if s["id"] == stream.id)

        assert wait_until(lambda: listed()["kv"] is not None and listed()["questions"] == 1)
        kv = listed()["kv"]
        assert kv["tokens"] < kv["stream_tokens"], "the stream was compressed"
        assert kv["blocks"] * BLOCK <= BUDGET + RECENT + SLACK + 2 * BLOCK + 200  # budget, slack, text, partial blocks
        assert listed()["frames"] == 40
    assert wait_until(lambda: scrape(server.base_url).get("vllm:kv_cache_usage_perc", 1.0) == 0.0)


@pytest.mark.slow  # in -m slow (make test-slow): keeps the default suite under 20 minutes
def test_one_shot_video_and_frames_as_images_are_answered(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300)
    model = client.models.list().data[0].id
    mp4 = base64.b64encode(encode_mp4(_frames(32, seed=7, size=224), fps=4)).decode()
    images = [{"type": "image_url", "image_url": {"url": frame_data_url(f, "png")}}
              for f in _frames(8, seed=8, size=224)]
    for content in ([{"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{mp4}"}}], images):
        reply = client.chat.completions.create(
            model=model, max_tokens=3, temperature=0.0,
            messages=[{"role": "user", "content": [*content, {"type": "text", "text": "What color was the square?"}]}])
        assert reply.usage.completion_tokens >= 1
        assert reply.usage.prompt_tokens > BUDGET + RECENT + SLACK, "the prompt was long enough to compress"
    metrics = scrape(server.base_url)
    assert metrics["cords_vllm_compressions_total"] >= 2
    assert wait_until(lambda: scrape(server.base_url).get("vllm:kv_cache_usage_perc", 1.0) == 0.0)


@pytest.mark.slow  # in -m slow: its engine session stays (tests/engine/test_llava_next_video.py)
def test_a_llava_next_video_live_stream_and_one_shot_video_are_compressed_and_answered():
    """LLaVA-NeXT-Video (1-D rotary positions) streams over HTTP: each push is re-based (its request holds what
    the policy kept, not what was pushed), the protected text the server counts is the markup's (``USER: `` and
    each clip's ``\\n``, never its ``<video>`` tokens), the question is answered; a one-shot ``video_url``
    request is compressed and answered too, and every block comes back. (About a minute on 2 cores.)"""
    from openai import OpenAI
    from transformers import AutoTokenizer

    path = str(build_tiny_llava_next_video())
    tokenizer = AutoTokenizer.from_pretrained(path)

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    with VLLMServer(path, ARGS) as server:
        client = StreamClient(server.base_url, timeout=120)
        with client.open() as stream:
            for i in range(10):
                stream.append(_frames(4, seed=i, size=80), fmt="png")
            assert stream.refresh()["text_tokens"] == tokens("USER: ") + 10 * tokens("\n")
            answer = client.request("POST", f"/v1/streams/{stream.id}/ask",
                                    {"question": "What color was the square?", "max_tokens": 3})
            assert answer["usage"]["completion_tokens"] >= 1  # a random tiny model may end its answer at once

            def listed():
                return next(s for s in client.list() if s["id"] == stream.id)

            # every pushed frame's 25 tokens reached the engine (its publication lags up to ~0.5 s)
            assert wait_until(lambda: (listed()["kv"] or {}).get("stream_tokens", 0) >= 10 * 4 * 25)
            kv = listed()["kv"]
            assert kv["tokens"] < kv["stream_tokens"], "the stream was compressed"
            assert kv["blocks"] * BLOCK <= BUDGET + RECENT + SLACK + 2 * BLOCK + 200
            assert stream.refresh()["frames"] == 40
        openai = OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300)
        mp4 = base64.b64encode(encode_mp4(_frames(32, seed=7, size=80), fps=4)).decode()
        compressions = scrape(server.base_url)["cords_vllm_compressions_total"]
        reply = openai.chat.completions.create(
            model=openai.models.list().data[0].id, max_tokens=3, temperature=0.0,
            messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{mp4}"}},
                {"type": "text", "text": "What color was the square?"}]}])
        assert reply.usage.completion_tokens >= 1
        assert reply.usage.prompt_tokens > BUDGET + RECENT + SLACK, "the video was long enough to compress"
        assert wait_until(lambda: scrape(server.base_url)["cords_vllm_compressions_total"] > compressions)
        assert wait_until(lambda: scrape(server.base_url).get("vllm:kv_cache_usage_perc", 1.0) == 0.0)
