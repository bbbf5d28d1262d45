"""vLLM's router (``vllm-router``) in front of two stand-in stream servers, and the client behind it.

The stand-ins speak the stream API's routes and errors (open, push, ask, get, close; 404 for a stream they do
not hold, 429 when full) without an engine, so these checks run in seconds in the default suite; real servers
behind the router: ``tests/streams/test_router_servers.py``. What is checked here is what the
scale-out path relies on: the router forwards the stream routes (no OpenAI route among them) keyed on the
client's ``X-Session-ID``, passes 429s and server-sent events through, refuses non-JSON bodies, sends its own
``--api-key`` to the workers; the client keeps every request of a stream on the server that holds it, retries an
open a full server refused, releases its router sessions, and spreads one-shot requests.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from cords_vllm.client import StreamAPIError, StreamClient
from cords_vllm.lab.serving.router import VLLMRouter, router_executable

pytestmark = pytest.mark.skipif(router_executable() is None,
                                reason="vllm-router is not installed (from the checkout: pip install '.[router]')")

POLICIES = ["sticky_least_loaded", "consistent_hash"]
CAPACITY = 3
FRAMES = np.zeros((2, 16, 16, 3), dtype=np.uint8)


class FakeStreamServer:
    """A stream API without an engine: holds at most ``capacity`` streams, records every request it gets."""

    def __init__(self, name: str, capacity: int = CAPACITY) -> None:
        self.name, self.capacity = name, capacity
        self.streams: set[str] = set()
        self.log: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def reset(self) -> None:
        with self.lock:
            self.streams.clear()
            self.log.clear()

    def requests_for(self, stream_id: str) -> list[tuple[str, str, dict[str, str]]]:
        return [entry for entry in self.log if f"/v1/streams/{stream_id}" in entry[1]]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def error(self, status: int, message: str) -> None:
                self.reply(status, {"error": {"message": message, "type": "Error", "param": "stream_id",
                                              "code": status}})

            def handle_any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                with server.lock:
                    server.log.append((self.command, self.path, headers))
                if self.path == "/health":
                    return self.reply(200, {})
                if self.path == "/v1/chat/completions":
                    return self.reply(200, {"server": server.name, "choices": [{"message": {"content": "ok"}}]})
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] != ["v1", "streams"]:
                    return self.error(404, "not found")
                if len(parts) == 2 and self.command == "POST":
                    with server.lock:
                        if len(server.streams) >= server.capacity:
                            return self.error(429, f"{server.name} is full")
                        stream_id = f"{server.name}-{next(server.ids)}"
                        server.streams.add(stream_id)
                    return self.reply(201, {"id": stream_id, "server": server.name})
                if len(parts) == 2:
                    return self.reply(200, {"data": [{"id": s} for s in sorted(server.streams)]})
                stream_id = parts[2]
                if stream_id not in server.streams:
                    return self.error(404, f"stream {stream_id} is unknown to {server.name}")
                info = {"id": stream_id, "server": server.name}
                if len(parts) == 3 and self.command == "DELETE":
                    with server.lock:
                        server.streams.discard(stream_id)
                    return self.reply(200, {"id": stream_id, "deleted": True})
                if parts[3:] == ["frames"]:
                    json.loads(body)  # the stand-in, like the router, takes JSON here
                    return self.reply(200, {"frames_received": 2, "stream": info})
                if parts[3:] == ["ask"]:
                    if json.loads(body).get("stream"):
                        self.send_response(200)
                        self.send_header("Content-Type", "text/event-stream")
                        self.end_headers()
                        for piece in ("red", " square"):
                            event = {"choices": [{"delta": {"content": piece}}]}
                            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                            self.wfile.flush()
                        self.wfile.write(b"data: [DONE]\n\n")
                        return None
                    return self.reply(200, {"choices": [{"message": {"content": server.name}}]})
                return self.reply(200, info)

            do_GET = do_POST = do_DELETE = handle_any

        return Handler


@pytest.fixture(scope="module")
def servers() -> Iterator[list[FakeStreamServer]]:
    pair = [FakeStreamServer("a"), FakeStreamServer("b")]
    for server in pair:
        server.thread.start()
    yield pair
    for server in pair:
        server.httpd.shutdown()
        server.httpd.server_close()


@pytest.fixture(params=POLICIES)
def router(request, servers) -> Iterator[VLLMRouter]:
    for server in servers:
        server.reset()
    with VLLMRouter([s.base_url for s in servers], request.param) as r:
        yield r


def holder(servers: list[FakeStreamServer], stream_id: str) -> FakeStreamServer:
    (server,) = [s for s in servers if stream_id in s.streams]
    return server


# ----------------------------------------------------------------------------------------------------------
def test_every_request_of_a_stream_reaches_the_server_that_holds_it(router, servers):
    # Four streams on two servers of three: under consistent hashing random session keys put the first three on one
    # server a quarter of the time, and the fourth then meets that full server on each try with odds 1/2 (with the
    # client's default 4 tries, 1 run in 64 failed): 16 tries make it about 1 in 260,000.
    client = StreamClient(router.base_url, router=True, open_attempts=16)
    streams = [client.open(metadata={"camera": str(i)}) for i in range(4)]
    assert all(s.session for s in streams) and all(len(s.streams) <= CAPACITY for s in servers)
    if router.policy == "sticky_least_loaded":  # new sessions go where the fewest are
        assert sorted(len(s.streams) for s in servers) == [2, 2] and not any(s.refusals for s in streams)
    for _ in range(3):
        for stream in streams:
            assert stream.append(FRAMES)["stream"]["id"] == stream.id
            assert stream.ask("What color was the square?") == holder(servers, stream.id).name
            assert "".join(stream.ask("Again?", stream_answer=True)) == "red square"  # events pass through
            assert stream.refresh()["server"] == holder(servers, stream.id).name
    for stream in streams:
        server = holder(servers, stream.id)
        other = next(s for s in servers if s is not server)
        seen = server.requests_for(stream.id)
        assert len(seen) == 3 * 4 and not other.requests_for(stream.id)
    # negative control: the same routes without the stream's key are spread by the router, and miss
    missed = 0
    for stream, i in itertools.product(streams, range(8)):
        try:
            client.request("POST", f"/v1/streams/{stream.id}/ask", {"question": f"q{i}"})
        except StreamAPIError as error:
            assert error.status == 404 and "unknown" in error.message
            missed += 1
    assert missed > 0
    for stream in streams:
        stream.close()
    assert not any(s.streams for s in servers)
    if router.policy == "sticky_least_loaded":
        log = router.log_text()
        assert all(f"finished session '{s.session}'" in log for s in streams)


def test_an_open_refused_by_a_full_server_is_retried_on_the_other(router, servers):
    full, spare = servers
    direct = StreamClient(full.base_url)
    for _ in range(CAPACITY):
        direct.open()  # fill one server behind the router's back
    client = StreamClient(router.base_url, router=True, open_attempts=16)
    opened = [client.open() for _ in range(CAPACITY)]
    assert all(holder(servers, s.id) is spare for s in opened)
    refusals = sum(s.refusals for s in opened)
    assert refusals == sum(e[:2] == ("POST", "/v1/streams") for e in full.log) - CAPACITY  # the router's tries
    if router.policy == "sticky_least_loaded":
        # the refused keys stay booked while retrying, so the full server gets a refusal at most twice per
        # open, and at least once over the first two opens (the second goes to the emptier-looking server)
        assert 1 <= refusals <= 2 * CAPACITY
        log = router.log_text()
        placed = re.findall(rf"new session '(\w+)' -> replica '{full.base_url}'", log)
        assert len(placed) == refusals and all(f"finished session '{key}'" in log for key in placed)
    # both full: the open fails after its bounded tries, with the server's 429
    with pytest.raises(StreamAPIError) as error:
        client.open()
    assert error.value.status == 429 and "is full" in error.value.message
    # negative control: without retries a refusal reaches the caller (at the latest when the spare is full)
    spare.reset()
    once = StreamClient(router.base_url, router=True, open_attempts=1)
    with pytest.raises(StreamAPIError) as error:
        for _ in range(CAPACITY + 1):
            once.open()
    assert error.value.status == 429 and error.value.message in {"a is full", "b is full"}


def test_one_shot_requests_spread_over_both_servers(router, servers):
    def chat_counts(client: StreamClient) -> list[int]:
        for server in servers:
            server.reset()
        for i in range(16):
            body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 1}
            assert client.one_shot("/v1/chat/completions", body)["server"] in {"a", "b"}
        return [sum(path == "/v1/chat/completions" for _, path, _ in s.log) for s in servers]

    counts = chat_counts(StreamClient(router.base_url, router=True))  # a fresh key per request
    assert sum(counts) == 16 and min(counts) > 0
    if router.policy == "sticky_least_loaded":
        log = router.log_text()
        assert log.count("SLL: new session") == log.count("SLL: finished session") >= 16  # none left booked
    # negative control: without a key the router sends every one-shot request to the same server
    assert sorted(chat_counts(StreamClient(router.base_url))) == [0, 16]


def test_what_the_router_forwards_and_what_it_refuses(servers):
    """Bodies must be JSON; the client's own API key is not forwarded on these routes, the router's is."""
    for server in servers:
        server.reset()
    with VLLMRouter([s.base_url for s in servers], "consistent_hash", api_key="worker-key") as r:
        client = StreamClient(r.base_url, api_key="client-key", router=True)
        stream = client.open()
        _, _, headers = holder(servers, stream.id).log[-1]
        assert headers.get("authorization") == "Bearer worker-key"
        with pytest.raises(ValueError, match="JSON bodies only"):
            stream.append(FRAMES, multipart=True)
        # the reason: the router answers a multipart body with a 400 before any server sees it
        plain = StreamClient(r.base_url)
        with pytest.raises(StreamAPIError) as error:
            plain.stream(stream.id, session=stream.session).append(FRAMES, multipart=True)
        assert error.value.status == 400 and "JSON" in error.value.message
        assert len(holder(servers, stream.id).requests_for(stream.id)) == 1  # the GET of stream(); no push
        stream.close()
