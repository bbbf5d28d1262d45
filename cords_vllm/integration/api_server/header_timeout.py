"""A deadline for a request's headers on the API server (``--kv-stream-header-timeout``).

uvicorn, which serves vLLM's API, bounds a body only through the application and an idle keep-alive connection
(``--timeout-keep-alive``, armed only after a response), but nothing bounds the time a client takes to send a
request's *headers*: a connection that trickles them holds a socket and a protocol object for as long as the client
likes, and a few hundred of them starve the server. The stream API's body timeout starts only once the headers
are in.

The patch table wraps ``connection_made`` and ``on_response_complete`` of both of uvicorn's HTTP/1.1 protocols
(``httptools`` and ``h11``): each arms one timer, and when it fires with no new request's headers complete since
(uvicorn creates a request's ``cycle`` once its headers are parsed), the connection is answered ``408`` and closed.
A request in progress, a streamed answer, a connection upgraded to a WebSocket (its transport now another
protocol's) and a connection that already completed its headers are never touched.
Off (``None``) until the stream API sets it; a reverse proxy's own header timeout (nginx's
``client_header_timeout``) does the same in front of any server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_TIMEOUT: list[float | None] = [None]
_REFUSAL = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def set_header_timeout(seconds: float | None) -> None:
    """Seconds a connection may take to send a request's headers (``None``: no limit)."""
    _TIMEOUT[0] = seconds


def _arm(protocol: Any) -> None:
    seconds = _TIMEOUT[0]
    if seconds is None:
        return
    seen = protocol.cycle

    def expire() -> None:
        transport = protocol.transport
        if transport is None or transport.is_closing() or protocol.cycle is not seen:
            return
        if getattr(transport, "get_protocol", lambda: protocol)() is not protocol:  # upgraded (a WebSocket)
            return
        logger.debug("cords-vllm: a connection sent no complete request headers within %g s: closed", seconds)
        try:
            transport.write(_REFUSAL)
        finally:
            transport.close()

    protocol.loop.call_later(seconds, expire)


def make_connection_made(original: Callable) -> Callable:
    def connection_made(self, transport):
        original(self, transport)
        _arm(self)
    return connection_made


def make_on_response_complete(original: Callable) -> Callable:
    def on_response_complete(self):
        original(self)
        if self.transport is not None and not self.transport.is_closing():
            _arm(self)  # the next request's headers on this keep-alive connection
    return on_response_complete
