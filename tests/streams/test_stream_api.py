"""The stream API against a real ``vllm serve --kv-policy cords`` over HTTP: happy path, every error path,
expiry, the cap, the API key, a client vanishing mid-answer, and every block back."""

from __future__ import annotations

import base64
import json
import socket
import time
import urllib.request

import numpy as np
import pytest

from cords_vllm.client import StreamAPIError, StreamClient, frame_data_url
from cords_vllm.compress.plan import BudgetSettings, compressed_footprint_blocks
from cords_vllm.lab.bench.http import scrape
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import encode_mp4, make_video
from cords_vllm.lab.vqa import shipped_checkpoint

pytestmark = pytest.mark.server

KEY = "test-key"
BUDGET, RECENT, SLACK, BLOCK = 128, 32, 32, 32
IDLE_S, MAX_OPEN = 4, 3
ARGS = ["--kv-policy", "cords", "--kv-policy-config",
        json.dumps({"budget": BUDGET, "recent": RECENT, "slack": SLACK, "max_text_tokens": 256}),
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "65536",
        "--kv-cache-memory-bytes", str(48 << 20), "--limit-mm-per-prompt", '{"image": 0, "video": 1}',
        "--api-key", KEY, "--kv-stream-idle-timeout", str(IDLE_S), "--kv-stream-max-open", str(MAX_OPEN),
        "--kv-stream-max-frames", "32"]


@pytest.fixture(scope="module")
def server():
    with VLLMServer(shipped_checkpoint(), ARGS) as srv:
        yield srv


@pytest.fixture()
def client(server) -> StreamClient:
    return StreamClient(server.base_url, api_key=KEY, timeout=120)


def clip(frames: int = 8, seed: int = 0, size: int = 112) -> np.ndarray:
    return make_video(frames, size, size, seed=seed).frames


def wait_until(predicate, timeout: float = 20.0, period: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


def settled_kv(client, timeout: float = 20.0) -> dict[str, dict]:
    """Each open stream's ``kv`` once two readings a publication interval apart agree (the engine publishes what a
    stream holds every half second, so one reading may predate its last compression)."""
    end, previous = time.monotonic() + timeout, None
    while True:
        now = {s["id"]: s["kv"] for s in client.list()}
        if now == previous or time.monotonic() > end:
            return now
        previous = now
        time.sleep(0.6)


def pool_empty(server) -> bool:
    return scrape(server.base_url).get("vllm:kv_cache_usage_perc", 1.0) == 0.0


def raw_call(server, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(server.base_url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


# ----------------------------------------------------------------------------------------------------------
def test_happy_path_push_ask_list_close(server, client):
    with client.open(metadata={"camera": "door"}) as stream:
        assert stream.info["status"] == "idle" and stream.info["metadata"] == {"camera": "door"}
        answer = stream.append(clip(8, seed=1))  # JSON data URLs
        assert answer["frames_received"] == 8 and answer["frames_sent"] == 8
        answer = stream.append(clip(8, seed=2), fmt="png", multipart=True)  # multipart upload
        assert answer["frames_sent"] == 8
        data = base64.b64encode(encode_mp4(clip(8, seed=3), fps=4)).decode()
        answer = client.request("POST", f"/v1/streams/{stream.id}/frames", {"video": f"data:video/mp4;base64,{data}"})
        assert answer["frames_sent"] == 8  # a clip, decoded by vLLM's own video loader
        odd = stream.append(clip(8, seed=4)[:5])
        assert odd["frames_sent"] == 4 and odd["stream"]["pending_frames"] == 1  # an odd frame waits

        text = stream.ask("What color was the square?", max_tokens=3)
        assert isinstance(text, str) and text
        pieces = list(stream.ask("What color was the square?", max_tokens=3, stream_answer=True))
        assert len(pieces) >= 2 and all(pieces)  # streamed as chat.completion.chunk events, token by token

        # the listing shows the KV the stream holds: within its bounded footprint, far below what it streamed
        def listed():
            return next(s for s in client.list() if s["id"] == stream.id)

        assert wait_until(lambda: listed()["kv"] is not None and listed()["questions"] == 2)
        # the engine publishes within ~0.5 s of a step; on a loaded machine later: read once two listings
        # three publication intervals apart agree
        def settled() -> bool:
            kv = listed()["kv"]
            time.sleep(1.5)
            return listed()["kv"] == kv

        assert wait_until(settled, timeout=60)
        info = listed()
        assert info["frames"] == 29 and info["clips"] == 5 and info["status"] == "idle"
        kv = info["kv"]
        video = (4 + 4 + 4 + 2 + 1) * 16  # clips of 8, 8, 8, 4 and 2 frames; 16 tokens a temporal patch at 112 px
        footprint = compressed_footprint_blocks(kv["stream_tokens"], video, BudgetSettings(BUDGET, RECENT, SLACK),
                                                BLOCK)
        assert kv["blocks"] <= footprint < -(-kv["stream_tokens"] // BLOCK)
        assert kv["tokens"] < kv["stream_tokens"]
        assert info["kv_policy"] == {"policy": "cords", "budget": BUDGET, "recent": RECENT, "slack": SLACK}
        assert kv["blocks"] <= info["footprint_blocks"] == -(-(256 + BUDGET + SLACK + 2 * BLOCK) // BLOCK)
        capacity = client.request("GET", "/v1/streams")["capacity"]
        assert capacity["stream_footprint_blocks"] == info["footprint_blocks"]
        assert capacity["max_streams"] == min(MAX_OPEN, capacity["pool_blocks"] // info["footprint_blocks"])
    # closed by the context manager: the stream is gone and every block is back in the pool
    with pytest.raises(StreamAPIError) as err:
        client.stream(stream.id)
    assert err.value.status == 404 and err.value.param == "stream_id" and "closed" in err.value.message
    assert wait_until(lambda: pool_empty(server))


def test_per_stream_overrides_narrow_the_budget(server, client):
    with client.open(kv_policy={"budget": 64, "recent": 16}) as small, client.open() as default:
        for i in range(4):
            small.append(clip(8, seed=i))
            default.append(clip(8, seed=i))
        assert wait_until(lambda: all(s["kv"] for s in client.list()))
        held = settled_kv(client)  # what each holds once the engine has published its last compression
        assert small.refresh()["kv_policy"]["budget"] == 64
        assert held[small.id]["tokens"] < held[default.id]["tokens"]


def test_openapi_lists_the_routes(server):
    status, text = server.get("/openapi.json")
    assert status == 200
    paths = json.loads(text)["paths"]
    assert {"post", "get"} <= set(paths["/v1/streams"])
    assert "delete" in paths["/v1/streams/{stream_id}"] and "get" in paths["/v1/streams/{stream_id}"]
    frames = paths["/v1/streams/{stream_id}/frames"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(frames)
    assert "post" in paths["/v1/streams/{stream_id}/ask"]


def test_api_key_is_required(server):
    status, body = raw_call(server, "GET", "/v1/streams", None, {})
    assert status == 401
    status, body = raw_call(server, "POST", "/v1/streams", b"{}",
                            {"Content-Type": "application/json", "Authorization": "Bearer wrong"})
    assert status == 401
    status, body = raw_call(server, "GET", "/v1/streams", None, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["object"] == "list"


def _png(size: tuple[int, int]) -> str:
    return frame_data_url(np.zeros((*size, 3), np.uint8), "png")


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"frames": ["not a url"]}, 400, "frames[0]"),
    ({"frames": [_png((64, 64)), "data:image/png;base64,@@@"]}, 400, "frames[1]"),
    ({"frames": ["data:image/gif;base64,R0lGODlh"]}, 400, "frames[0]"),
    ({"frames": [_png((64, 64)), "data:image/png;base64," + base64.b64encode(b"not an image").decode()]},
     400, "frames[1]"),
    ({"frames": [_png((64, 64)), _png((56, 56))]}, 400, "frames[1]"),
    ({"frames": [_png((8, 64))]}, 400, "frames"),
    ({"frames": [_png((64, 64))] * 33}, 413, "frames"),
    ({}, 400, "frames"),
    ({"frames": [_png((64, 64))], "video": "data:video/mp4;base64,AAAA"}, 400, "video"),
    ({"video": "data:video/mp4;base64," + base64.b64encode(b"garbage").decode()}, 400, "video"),
    ({"frames": "one"}, 400, "frames"),
    ({"pictures": []}, 400, "pictures"),
])
def test_bad_frames_get_a_4xx_naming_the_field(client, body, status, param):
    with client.open() as stream:
        with pytest.raises(StreamAPIError) as err:
            client.request("POST", f"/v1/streams/{stream.id}/frames", body)
        assert (err.value.status, err.value.param) == (status, param), err.value
        assert stream.append(clip(2, seed=0))["frames_sent"] == 2  # the stream and the server keep serving


def test_other_bad_input_gets_a_4xx_naming_the_field(server, client):
    def error(method, path, body=None, **kw):
        with pytest.raises(StreamAPIError) as err:
            client.request(method, path, body, **kw)
        return err.value.status, err.value.param

    assert error("POST", "/v1/streams", {"kv_policy": {"budget": BUDGET * 2}}) == (400, "kv_policy.budget")
    assert error("POST", "/v1/streams", {"kv_policy": {"recent": 64}}) == (400, "kv_policy.recent")
    assert error("POST", "/v1/streams", {"kv_policy": {"alpha": 1}})[0] == 400
    assert error("POST", "/v1/streams", {"colour": "red"})[0] == 400
    assert error("GET", "/v1/streams/stream-nope") == (404, "stream_id")
    assert error("DELETE", "/v1/streams/stream-nope") == (404, "stream_id")
    assert error("POST", "/v1/streams/stream-nope/frames", {"frames": [_png((64, 64))]}) == (404, "stream_id")
    with client.open() as stream:
        ask = f"/v1/streams/{stream.id}/ask"
        status, param = error("POST", ask, {"question": ""})
        assert status == 400 and "question" in param
        status, param = error("POST", ask, {"question": "hi", "max_tokens": 0})
        assert status == 400 and "max_tokens" in param
        assert error("POST", ask, {"question": "hi", "max_tokens": 100000}) == (400, "max_tokens")
        assert error("POST", f"/v1/streams/{stream.id}/frames", raw=b"{nope") == (400, "body")
        assert error("POST", f"/v1/streams/{stream.id}/frames", raw=b"x", content_type="text/plain") == (
            415, "content-type")
        stream.append(clip(4))
        assert stream.ask("What color was the square?", max_tokens=2)  # still serving


def test_the_cap_on_open_streams(client):
    streams = [client.open() for _ in range(MAX_OPEN)]
    try:
        with pytest.raises(StreamAPIError) as err:
            client.open()
        assert err.value.status == 429 and "--kv-stream-max-open" in err.value.message
        streams.pop().close()
        streams.append(client.open())  # room again
    finally:
        for s in streams:
            s.close()


def test_idle_streams_expire_and_free_their_kv(server, client):
    stream = client.open()
    stream.append(clip(8, seed=5))
    assert not pool_empty(server)
    assert wait_until(lambda: stream.id not in {s["id"] for s in client.list()}, timeout=IDLE_S + 15)
    with pytest.raises(StreamAPIError) as err:
        stream.refresh()
    assert err.value.status == 404 and "expired" in err.value.message
    assert wait_until(lambda: pool_empty(server))


def test_client_vanishing_mid_answer_loses_nothing(server, client):
    """A client that disconnects mid-answer leaves the stream usable; closing it returns every block."""
    with client.open() as stream:
        stream.append(clip(8, seed=6))
        body = json.dumps({"question": "What color was the square?", "max_tokens": 200, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST /v1/streams/{stream.id}/ask HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            first = sock.recv(4096)
            assert b"200 OK" in first
        # the vanished client's turn runs to its end in the background; the next turn queues behind it
        stream.append(clip(8, seed=7))
        assert stream.ask("What color was the square?", max_tokens=2)
        assert stream.refresh()["questions"] == 2
    assert wait_until(lambda: pool_empty(server))


def test_a_turn_past_max_text_tokens_is_refused_and_the_stream_lives(server, client):
    """Questions and answers are never evicted: a question or push that could pass the server's
    max_text_tokens (256) gets a 409 and leaves the stream as it was; one that fills it exactly is served.
    The API server's count must equal the engine's: one token short and the engine would end the stream."""
    from transformers import AutoTokenizer

    from cords_vllm.conversation.transcript import ASSISTANT, END, SYSTEM, USER

    tokenizer = AutoTokenizer.from_pretrained(shipped_checkpoint())

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    with client.open() as stream:
        stream.append(clip(8, seed=1))
        info = stream.refresh()
        held = tokens(SYSTEM + USER)
        assert (info["text_tokens"], info["max_text_tokens"]) == (held, 256)

        with pytest.raises(StreamAPIError) as err:
            stream.ask("Which color came first?" + " red" * 300, max_tokens=2)
        assert (err.value.status, err.value.param) == (409, "question")
        assert "max_text_tokens" in err.value.message and f"{256 - held} left" in err.value.message
        with pytest.raises(StreamAPIError) as err:  # short, but its answer might not fit
            stream.ask("What color was the square?", max_tokens=256 - held)
        assert err.value.status == 409
        info = stream.refresh()
        assert (info["status"], info["questions"], info["text_tokens"]) == ("idle", 0, held)

        question = "What color was the square?"
        answer = client.request("POST", f"/v1/streams/{stream.id}/ask", {"question": question, "max_tokens": 3})
        held += tokens(question + END + ASSISTANT) + answer["usage"]["completion_tokens"] - 1
        assert stream.refresh()["text_tokens"] == held

        # a question of exactly the room left (one token generated, none kept) is served, and fills the stream
        room = 256 - held
        filler = next(q for k in range(400) if tokens(END + USER + (q := question + " red" * k) + END + ASSISTANT)
                      == room)
        answer = client.request("POST", f"/v1/streams/{stream.id}/ask", {"question": filler, "max_tokens": 1})
        assert answer["choices"][0]["finish_reason"] == "length"
        info = stream.refresh()
        assert (info["status"], info["questions"], info["text_tokens"]) == ("idle", 2, 256)

        with pytest.raises(StreamAPIError) as err:  # a push after an answer opens a user message: no room
            stream.append(clip(4, seed=2)[:3])
        assert (err.value.status, err.value.param) == (409, "stream_id")
        info = stream.refresh()
        assert (info["status"], info["frames"], info["pending_frames"]) == ("idle", 8, 0)
        assert info["ended_reason"] is None
        assert wait_until(lambda: stream.refresh()["kv"] is not None)  # the engine still holds the stream's KV


def test_a_closed_stream_says_so(client):
    with client.open() as stream:
        stream.append(clip(4, seed=1))
    with pytest.raises(StreamAPIError) as err:
        stream.append(clip(4, seed=2))
    assert err.value.status == 404 and "closed" in err.value.message


def test_the_live_stream_example_runs(server):
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "live_stream.py"
    out = subprocess.run([sys.executable, str(example), "--url", server.base_url, "--api-key", KEY, "--seconds", "4",
                          "--fps", "8", "--ask-every", "2", "--max-tokens", "2", "--budget", "64"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("Q: ") == 2 and "closed" in out.stdout and "KV held" in out.stdout
