"""Every limit a stream can reach ends that stream alone, with a 410 naming it, while the engine and every other
stream keep serving (real ``vllm serve`` over HTTP).

* Without a policy a stream's length is every token it pushed: it ends at --max-model-len. vLLM 0.32 checks a
  request's length only when it arrives, and a streaming session grows with every turn: before the engine ended
  such a session itself, the worker failed copying it into its persistent batch and the engine core died,
  taking every stream with it.
* Under a policy a stream is re-based at every push, so its length is what it holds plus the push: it runs past
  --max-model-len (and past the model's rotary range) in tokens, and ends when its rotary positions would pass
  the model's range (``max_position_embeddings``), on a tiny model whose range is 1,024 positions.
* Its text is refused before the engine (409, the stream unchanged): ``test_text_budget.py``.
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

MAX_MODEL_LEN, SHORT_MAX_MODEL_LEN, BLOCK = 1024, 512, 32
CORDS_CONFIG = json.dumps({"budget": 128, "recent": 32, "slack": 32, "max_text_tokens": 256})
COMMON = ["--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN),
          "--limit-mm-per-prompt", '{"image": 0, "video": 1}', "--kv-stream-max-open", "4"]
POLICIES = {
    "cords": ["--kv-policy", "cords", "--kv-policy-config", CORDS_CONFIG, "--kv-cache-memory-bytes", str(24 << 20)],
    "none": ["--kv-policy", "none", "--kv-cache-memory-bytes", str(24 << 20)],
}


@pytest.fixture(scope="module")
def short_range_server(short_range_model):
    """``cords`` on the tiny model whose rotary range is 1,024 positions, at --max-model-len 512."""
    args = [*POLICIES["cords"], *COMMON[:COMMON.index("--max-model-len")], "--max-model-len", str(SHORT_MAX_MODEL_LEN),
            *COMMON[COMMON.index("--max-model-len") + 2:]]
    with VLLMServer(short_range_model, args) as srv:
        srv.policy, srv.max_model_len = "cords", SHORT_MAX_MODEL_LEN
        yield srv


@pytest.fixture(scope="module", params=sorted(POLICIES))
def server(request):
    """A server per policy: ``cords`` is the rotary-range test's server (one server start fewer; its streams pass
    --max-model-len in tokens long before their positions reach the range), ``none`` the shipped checkpoint."""
    if request.param == "cords":
        yield request.getfixturevalue("short_range_server")
        return
    with VLLMServer(shipped_checkpoint(), [*POLICIES[request.param], *COMMON]) as srv:
        srv.policy, srv.max_model_len = request.param, MAX_MODEL_LEN
        yield srv


def clip(seed: int) -> np.ndarray:
    return make_video(8, 112, 112, seed=seed).frames


def _push_until_ended(stream, pushes: int, frames: np.ndarray | None = None) -> StreamAPIError | None:
    for push in range(pushes):
        try:
            stream.append(clip(seed=push) if frames is None else frames)
        except StreamAPIError as err:
            return err
    return None


def _expect_ended(stream, err: StreamAPIError | None, *words: str) -> None:
    assert err is not None, "the stream never reached its limit"
    assert err.status == 410 and all(w in err.message for w in words), err
    info = stream.refresh()
    assert info["status"] == "ended" and all(w in info["ended_reason"] for w in words)
    with pytest.raises(StreamAPIError) as again:
        stream.ask("What color was the square?")
    assert again.value.status == 410


def _others_keep_serving(client: StreamClient, other, server) -> None:
    """The engine lives: the other stream pushes and answers, a new stream opens and answers; every block
    returns once they close."""
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


def test_a_stream_ends_alone_at_its_limit_and_the_others_keep_serving(server):
    """none: at --max-model-len tokens. cords: the stream passes --max-model-len in tokens and answers (its
    length is what it holds). Under both, a single push longer than --max-model-len is refused with a 413 and the
    stream serves on."""
    client = StreamClient(server.base_url, timeout=120)
    other = client.open()
    other.append(clip(seed=100))
    limit = server.max_model_len
    with client.open() as stream:
        _refused_too_long(stream, limit)
        if server.policy == "none":  # about 66 tokens a clip: past the limit well before the end
            _expect_ended(stream, _push_until_ended(stream, limit // 64 + 2), "--max-model-len", str(limit))
        else:
            assert _push_until_ended(stream, 2 * limit // 64) is None  # 2x --max-model-len in tokens
            assert isinstance(stream.ask("What color was the square?", max_tokens=2), str)
            _refused_too_long(stream, limit)
            assert _push_until_ended(stream, 2) is None
    _others_keep_serving(client, other, server)


def _refused_too_long(stream, limit: int) -> None:
    """One push of 2,048 video tokens, longer than --max-model-len (``limit``) on its own: refused with a 413 naming
    the limit and the clip's tokens before the engine sees it; the stream is unchanged and keeps serving."""
    before = stream.refresh()
    long_clip = make_video(64, 224, 224, seed=7).frames
    with pytest.raises(StreamAPIError) as err:
        stream.append(long_clip)
    assert err.value.status == 413, err.value
    assert "--max-model-len" in err.value.message and str(limit) in err.value.message
    assert "2048 video tokens" in err.value.message
    after = stream.refresh()
    unchanged = ("frames", "clips", "questions", "pending_frames", "text_tokens")
    assert after["status"] == "idle" and {k: after[k] for k in unchanged} == {k: before[k] for k in unchanged}
    stream.append(clip(seed=55))
    assert isinstance(stream.ask("What color was the square?", max_tokens=1), str)


def test_a_stream_ends_alone_at_its_rotary_range_and_the_others_keep_serving(short_range_server):
    """A 224x224 8-frame clip is 258 tokens but 10 positions: a stream passes the model's rotary range (1,024)
    in tokens, answers, and ends with a 410 naming its positions when its next push would pass the range."""
    client = StreamClient(short_range_server.base_url, timeout=120)
    other = client.open()
    other.append(clip(seed=100))
    frames = make_video(8, 224, 224, seed=3).frames
    with client.open() as stream:
        assert _push_until_ended(stream, 8, frames) is None  # 2,064 tokens: past the range in tokens
        assert isinstance(stream.ask("What color was the square?", max_tokens=2), str)
        _expect_ended(stream, _push_until_ended(stream, 120, frames), "rotary positions", "max_position_embeddings")
    _others_keep_serving(client, other, short_range_server)
