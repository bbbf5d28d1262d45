"""A model the stream API cannot write turns for (LLaVA-NeXT-Video: no Qwen-VL chat markup) is served under
``--kv-policy cords`` for one-shot requests, while ``POST /v1/streams`` answers 501 saying why."""

from __future__ import annotations

import base64
import json

import pytest

from cords_vllm.client import StreamAPIError, StreamClient
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import encode_mp4, make_video
from cords_vllm.lab.synthetic.tiny_llava import build_tiny_llava_next_video

pytestmark = pytest.mark.server

ARGS = ["--kv-policy", "cords", "--kv-policy-config", json.dumps({"budget": 128, "slack": 32}),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
        "--kv-cache-memory-bytes", str(32 << 20), "--limit-mm-per-prompt", '{"image": 0, "video": 1}']


def test_streams_are_refused_with_501_and_one_shot_videos_are_compressed():
    from openai import OpenAI

    with VLLMServer(str(build_tiny_llava_next_video()), ARGS) as server:
        with pytest.raises(StreamAPIError) as refused:
            StreamClient(server.base_url, timeout=60).open()
        assert refused.value.status == 501
        assert "chat markup" in str(refused.value) and "/v1/chat/completions" in str(refused.value)
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300)
        mp4 = base64.b64encode(encode_mp4(make_video(32, 80, 80, seed=1).frames, fps=4)).decode()
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=3, temperature=0.0,
            messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{mp4}"}},
                {"type": "text", "text": "What color was the square?"}]}])
        assert reply.usage.completion_tokens >= 1
        assert reply.usage.prompt_tokens > 128 + 32, "the video was long enough to compress"
