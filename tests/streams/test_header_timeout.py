"""The deadline for a request's headers (:mod:`cords_vllm.integration.api_server.header_timeout`) on stand-ins of
uvicorn's protocol and transport: a connection whose headers are late is answered 408 and closed; one whose headers
came in, one upgraded to a WebSocket, one already closing and any connection with the deadline off are left alone.
The real server's behaviour under 200 slow connections: ``test_hostile_server.py``."""

from __future__ import annotations

from typing import Any

import pytest

from cords_vllm.integration.api_server import header_timeout


class Loop:
    def __init__(self) -> None:
        self.timers: list[tuple[float, Any]] = []

    def call_later(self, seconds: float, callback: Any) -> None:
        self.timers.append((seconds, callback))

    def fire(self) -> None:
        timers, self.timers = self.timers, []
        for _, callback in timers:
            callback()


class Transport:
    def __init__(self) -> None:
        self.written, self.closed, self.protocol = b"", False, None

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_protocol(self) -> Any:
        return self.protocol


class Protocol:
    """uvicorn's HTTP protocol as the wrappers see it: ``loop``, ``transport``, ``cycle``."""

    def __init__(self, loop: Loop) -> None:
        self.loop, self.transport, self.cycle = loop, None, None

    def connection_made(self, transport: Transport) -> None:
        self.transport = transport
        transport.protocol = self

    def on_response_complete(self) -> None:
        pass


Protocol.connection_made = header_timeout.make_connection_made(Protocol.connection_made)
Protocol.on_response_complete = header_timeout.make_on_response_complete(Protocol.on_response_complete)


@pytest.fixture(autouse=True)
def _deadline():
    header_timeout.set_header_timeout(2.0)
    yield
    header_timeout.set_header_timeout(None)


def connect() -> tuple[Loop, Protocol, Transport]:
    loop, transport = Loop(), Transport()
    protocol = Protocol(loop)
    protocol.connection_made(transport)
    return loop, protocol, transport


def test_late_headers_are_answered_408_and_closed():
    loop, _, transport = connect()
    assert [seconds for seconds, _ in loop.timers] == [2.0]
    loop.fire()
    assert transport.closed and transport.written.startswith(b"HTTP/1.1 408 Request Timeout\r\n")


def test_headers_in_time_are_left_alone_and_the_next_requests_are_timed():
    loop, protocol, transport = connect()
    protocol.cycle = object()  # uvicorn made the request's cycle: its headers are in
    loop.fire()
    assert not transport.closed
    protocol.on_response_complete()  # keep-alive: the next request's headers are timed from here
    loop.fire()
    assert transport.closed


def test_an_upgraded_or_closing_connection_is_left_alone():
    loop, _, transport = connect()
    transport.protocol = object()  # a WebSocket protocol took the transport over
    loop.fire()
    assert not transport.closed and transport.written == b""
    loop, _, transport = connect()
    transport.closed = True
    loop.fire()
    assert transport.written == b""


def test_no_deadline_arms_nothing():
    header_timeout.set_header_timeout(None)
    loop, _, _ = connect()
    assert loop.timers == []
