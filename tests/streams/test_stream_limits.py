"""A stream that reaches --max-model-len ends alone, with a 410 naming the limit; the engine and every other
stream keep serving (real ``vllm serve`` over HTTP, under a KV policy and under ``none``).

vLLM 0.32 checks a request's length only when it arrives, and a streaming session grows with every turn: before
the engine ended such a session itself, the worker failed copying it into its persistent batch and the engine
core died, taking every stream with it.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from cords_vllm.client import StreamAPIError, StreamClient
from cords_vllm.lab.bench.http import scrape
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import make_video
from cords_vllm.lab.vqa import shipped_checkpoint

pytestmark = pytest.mark.server

MAX_MODEL_LEN, BLOCK = 1024, 32
COMMON = ["--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN),
          "--limit-mm-per-prompt", '{"image": 0, "video": 1}', "--kv-stream-max-open", "4"]
POLICIES = {
    "cords": ["--kv-policy", "cords", "--kv-policy-config",
              json.dumps({"budget": 128, "recent": 32, "slack": 32, "max_text_tokens": 256}),
              "--kv-cache-memory-bytes", str(24 << 20)],
    "none": ["--kv-policy", "none", "--kv-cache-memory-bytes", str(24 << 20)],
}


@pytest.fixture(scope="module", params=sorted(POLICIES))
def server(request):
    with VLLMServer(shipped_checkpoint(), [*POLICIES[request.param], *COMMON]) as srv:
        yield srv


def clip(seed: int) -> np.ndarray:
    return make_video(8, 112, 112, seed=seed).frames


def test_a_stream_past_max_model_len_ends_alone_and_the_others_keep_serving(server):
    client = StreamClient(server.base_url, timeout=120)
    other = client.open()
    other.append(clip(seed=100))
    with client.open() as stream:
        for push in range(MAX_MODEL_LEN // 64 + 2):  # about 66 tokens a clip: past the limit well before the end
            try:
                stream.append(clip(seed=push))
            except StreamAPIError as err:
                assert err.status == 410, err
                assert "--max-model-len" in err.message and str(MAX_MODEL_LEN) in err.message, err.message
                break
        else:
            pytest.fail("the stream never reached --max-model-len")
        info = stream.refresh()
        assert info["status"] == "ended" and "--max-model-len" in info["ended_reason"]
        with pytest.raises(StreamAPIError) as err:
            stream.ask("What color was the square?")
        assert err.value.status == 410
    # the engine lives: the other stream pushes and answers, a new stream opens and answers
    other.append(clip(seed=101))
    answer = client.request("POST", f"/v1/streams/{other.id}/ask", {"question": "Which color?", "max_tokens": 2})
    assert answer["usage"]["completion_tokens"] == 2
    assert other.refresh()["status"] == "idle"
    with client.open() as fresh:
        fresh.append(clip(seed=102))
        assert isinstance(fresh.ask("What color was the square?", max_tokens=1), str)
    other.close()
    deadline = time.monotonic() + 20  # vLLM's usage gauge follows the engine's next stats
    while scrape(server.base_url).get("vllm:kv_cache_usage_perc", 1.0) != 0.0:
        assert time.monotonic() < deadline, "blocks were not returned to the pool"
        time.sleep(0.2)
