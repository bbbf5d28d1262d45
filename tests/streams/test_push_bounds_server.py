"""A push is held to what the model and its engine take, from its headers, on a real ``vllm serve`` at the stream
API's default limits (the shipped tiny model, encoder cache 2,048 tokens).

Each refusal comes before a frame is decoded and leaves the stream exactly as it was: a frame shape the model's
processor refuses (one lone odd frame included, which used to be held back and break the next turns), a clip
larger than the engine's encoder cache (which used to end the stream), decoded bytes past the push budget, too many
multipart files, a body nested too deep. The largest count a refusal names is then pushed and taken. The API
server's peak memory under the worst legal push stays within twice the decoded-bytes budget (the frames, and the
one copy vLLM's video processor makes of them).
"""

from __future__ import annotations

import base64
import json
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cords_vllm.client import StreamAPIError, StreamClient, frame_data_url
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.vqa import shipped_checkpoint

pytestmark = pytest.mark.server

PUSH_MB = 256  # the default --kv-stream-max-push-mb
ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--kv-policy", "cords",
        "--kv-policy-config", json.dumps({"budget": 256}), "--kv-stream-max-body-mb", "96"]


@pytest.fixture(scope="module")
def server():
    with VLLMServer(shipped_checkpoint(), ARGS, startup_timeout=600) as srv:
        yield srv


@pytest.fixture
def client(server) -> StreamClient:
    return StreamClient(server.base_url, timeout=300)


def frames(count: int, width: int, height: int, value: int = 0) -> dict:
    return {"frames": [frame_data_url(np.full((height, width, 3), value, np.uint8), "jpeg")] * count}


def push(client: StreamClient, stream, body: dict) -> dict:
    return client.request("POST", f"/v1/streams/{stream.id}/frames", body)


def refused(call) -> StreamAPIError:
    with pytest.raises(StreamAPIError) as error:
        call()
    return error.value


def state(stream) -> tuple:
    info = stream.refresh()
    return info["status"], info["frames"], info["clips"], info["questions"], info["pending_frames"]


def test_a_frame_shape_the_processor_refuses_is_refused_before_it_is_held(client):
    with client.open() as stream:
        push(client, stream, frames(3, 64, 64))  # one frame held back
        before = state(stream)
        for count in (2, 1):  # a pair, and a lone odd frame that would be held back
            error = refused(lambda count=count: push(client, stream, frames(count, 5880, 28)))
            assert (error.status, error.param) == (400, "frames[0]"), error
            assert "aspect ratio" in error.message
            assert state(stream) == before
        assert push(client, stream, frames(2, 64, 64))["frames_sent"] == 2
        assert isinstance(stream.ask("What color was the square?", max_tokens=2), str)
        assert stream.refresh()["status"] == "idle"


def test_a_clip_past_the_engines_encoder_cache_is_refused_and_the_named_count_fits(client):
    with client.open() as stream:
        error = refused(lambda: push(client, stream, frames(256, 448, 448)))
        assert (error.status, error.param) == (413, "frames"), error
        largest = int(re.search(r"at most (\d+) frames of this size", error.message).group(1))
        assert 2 <= largest < 256 and "encoder cache" in error.message
        assert state(stream)[1:3] == (0, 0)
        error = refused(lambda: push(client, stream, frames(largest + 2, 448, 448)))
        assert error.status == 413
        taken = push(client, stream, frames(largest, 448, 448))  # the engine takes it (an odd last frame waits)
        assert taken["frames_sent"] == largest - largest % 2 and taken["stream"]["pending_frames"] == largest % 2
        assert isinstance(stream.ask("What color was the square?", max_tokens=2), str)
        assert stream.refresh()["status"] == "idle"


def test_decoded_bytes_are_bounded_per_push_and_the_worst_legal_push_fits_the_budget(server, client):
    pid = server.proc.pid  # one API server: the serve process itself
    with client.open() as stream:
        error = refused(lambda: push(client, stream, frames(256, 1920, 1080)))
        assert (error.status, error.param) == (413, "frames") and "--kv-stream-max-push-mb" in error.message
        largest = int(re.search(r"at most (\d+) frames of this size", error.message).group(1))
        assert largest == (PUSH_MB << 20) // (1920 * 1080 * 3)
        body = frames(largest, 1920, 1080, value=90)
        before = _status_mb(pid, "VmHWM")
        assert push(client, stream, body)["frames_sent"] == largest - largest % 2
        grew = _status_mb(pid, "VmHWM") - before
        print(f"API server peak grew {grew:.0f} MB for the worst legal push ({largest} frames of 1920x1080, "
              f"{largest * 1920 * 1080 * 3 / 2**20:.0f} MB decoded)")
        # the decoded frames, and one copy of them vLLM's video processor makes before it resizes them
        assert grew < 2 * PUSH_MB + 64, f"the peak grew {grew:.0f} MB, past twice the {PUSH_MB} MB push budget"
        assert isinstance(stream.ask("What color was the square?", max_tokens=2), str)


def test_multipart_file_count_and_deep_nesting_are_4xx(server, client):
    with client.open() as stream:
        boundary = "cordsboundary"
        part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"frames\"; filename=\"f.jpg\"\r\n"
                "Content-Type: image/jpeg\r\n\r\nx\r\n")
        body = (part * 10_000 + f"--{boundary}--\r\n").encode()
        status, answer = _post(server, f"/v1/streams/{stream.id}/frames", body,
                               f"multipart/form-data; boundary={boundary}")
        assert (status, answer["error"]["param"]) == (413, "frames"), answer
        for path in ("/v1/streams", f"/v1/streams/{stream.id}/frames", f"/v1/streams/{stream.id}/ask"):
            for nested in ('{"frames": ' + "[" * 5000 + "]" * 5000 + "}", '{"video": ' + '{"a": ' * 1000 + "1"
                           + "}" * 1000 + "}", "[" * 100_000 + "]" * 100_000):
                status, answer = _post(server, path, nested.encode(), "application/json")
                assert 400 <= status < 500, (path, status, answer)
                assert answer["error"]["param"] in ("body", "frames", "video"), (path, answer)
        assert state(stream)[1] == 0
        push(client, stream, frames(2, 64, 64))
        assert isinstance(stream.ask("What color was the square?", max_tokens=2), str)


def _post(server: VLLMServer, path: str, body: bytes, content_type: str) -> tuple[int, dict]:
    request = urllib.request.Request(server.base_url + path, data=body, method="POST",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _status_mb(pid: int, field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def test_every_refusal_class_leaves_the_stream_exactly_as_it_was(server, client):
    """A stream holding a frame back goes through every class of refused push and question; after each its state
    (frames, clips, questions, the held-back frame) is what it was, and a valid push and question then answer."""
    png_bad = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    cases = [
        ({"frames": ["not a url"]}, 400, "frames[0]"),
        ({"frames": ["data:image/gif;base64,R0lGODlh"]}, 400, "frames[0]"),
        ({"frames": ["data:image/png;base64,@@@"]}, 400, "frames[0]"),
        ({"frames": [png_bad]}, 400, "frames[0]"),
        ({"frames": frames(1, 64, 64)["frames"] + frames(1, 56, 56)["frames"]}, 400, "frames[1]"),
        (frames(2, 64, 8), 400, "frames"),  # a side under 28
        (frames(2, 5880, 28), 400, "frames[0]"),  # the processor's aspect ratio
        (frames(1, 5880, 28), 400, "frames[0]"),  # the same, alone: never held back
        (frames(2, 4000, 4000), 413, "frames[0]"),  # past the frame size
        (frames(257, 64, 64), 413, "frames"),  # past --kv-stream-max-frames
        (frames(256, 448, 448), 413, "frames"),  # past the engine's clip bound
        (frames(60, 1920, 1080), 413, "frames"),  # past the push's decoded bytes
        ({"video": "data:video/mp4;base64," + base64.b64encode(b"garbage").decode()}, 400, "video"),
        ({"frames": frames(2, 64, 64)["frames"], "video": "data:video/mp4;base64,AAAA"}, 400, "video"),
        ({}, 400, "frames"),
    ]
    with client.open() as stream:
        push(client, stream, frames(3, 64, 64, value=10))  # one frame held back
        before = state(stream)
        assert before[4] == 1
        for body, status, param in cases:
            error = refused(lambda body=body: push(client, stream, body))
            assert (error.status, error.param) == (status, param), (param, error)
            assert state(stream) == before, (param, state(stream))
        for question, status in (("why " * 3000, 413), ("<|im_end|>", 400), ("", 400)):
            error = refused(lambda question=question: client.request(
                "POST", f"/v1/streams/{stream.id}/ask", {"question": question, "max_tokens": 1}))
            assert error.status == status and error.param.startswith("question"), error
            assert state(stream) == before
        for path, raw in ((f"/v1/streams/{stream.id}/frames", "[" * 50_000 + "]" * 50_000),
                          (f"/v1/streams/{stream.id}/ask", '{"question": ' + "[" * 5000 + "]" * 5000 + "}")):
            assert _post(server, path, raw.encode(), "application/json")[0] == 400
            assert state(stream) == before
        assert push(client, stream, frames(2, 64, 64))["frames_sent"] == 2  # with the held-back frame, one waits
        assert isinstance(stream.ask("What color was the square?", max_tokens=2), str)
        after = state(stream)
        assert after[1:4] == (before[1] + 2, before[2] + 2, before[3] + 1), (before, after)
