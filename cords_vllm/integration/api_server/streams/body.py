"""The stream API's request bodies: a size limit answered before the body is read, and a read timeout.

What a trusted front end (nginx's ``client_max_body_size`` and ``client_body_timeout``) does, for the routes under
``/v1/streams`` alone: a body whose ``Content-Length`` is over ``--kv-stream-max-body-mb`` is refused with 413
before a byte of it is read; a body sent without a length (chunked) is counted as it arrives and refused the
moment it passes the limit; a body that takes longer than ``--kv-stream-body-timeout`` to arrive is refused with
408. The limits are the stream registry's (:class:`~.registry.StreamLimits`), read per request, so the
middleware is in place from the app's start and acts once the stream API has its engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from cords_vllm.integration.api_server.streams.api import STATE_KEY, APIError

PREFIX = "/v1/streams"


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


async def send_error(send: Any, error: APIError) -> None:
    """Answer ``error`` with vLLM's error body and close the connection (the unread body is not wanted)."""
    body = json.dumps({"error": {"message": error.message, "type": error.kind, "param": error.param,
                                 "code": error.status}}).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyLimits:
    """ASGI middleware: the stream API's body size limit (413) and body read timeout (408)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        registry = None
        if scope["type"] == "http" and (scope["path"] == PREFIX or scope["path"].startswith(PREFIX + "/")):
            registry = getattr(getattr(scope.get("app"), "state", None), STATE_KEY, None)
        if registry is None or scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit, timeout = registry.limits.max_body_bytes, registry.limits.body_timeout_s
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await send_error(send, APIError(400, f"Content-Length {declared!r} is not a number", "body"))
                return
            if length > limit:
                await send_error(send, _too_large(limit, f"the body is {length} bytes"))
                return
        limited = _LimitedReceive(receive, limit, timeout)
        state = {"answered": False}

        async def guarded_send(message: dict[str, Any]) -> None:
            # the body broke a limit: whatever the app made of the error raised in its receive (FastAPI turns a
            # body-parsing failure into a 400), the answer is the limit's
            if limited.error is not None:
                if not state["answered"]:
                    state["answered"] = True
                    await send_error(send, limited.error)
                return
            await send(message)

        try:
            await self.app(scope, limited, guarded_send)
        except Exception:
            if limited.error is None:
                raise
        if limited.error is not None and not state["answered"]:
            state["answered"] = True
            await send_error(send, limited.error)


def _too_large(limit: int, what: str) -> APIError:
    return APIError(413, f"{what}; a stream request's body may be at most {limit} bytes (--kv-stream-max-body-mb)",
                    "body")


class _LimitedReceive:
    """``receive`` that counts the body's bytes against the limit and gives it ``timeout`` seconds to arrive;
    past either it raises :class:`APIError` (413 / 408), which the stream API's handler answers. After the body's
    last part, messages pass through untouched (a streamed answer waits on ``receive`` for a disconnect)."""

    def __init__(self, receive: Any, limit: int, timeout: float) -> None:
        self.receive, self.limit = receive, limit
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.received = 0
        self.done = False
        #: The limit the body broke, once it has.
        self.error: APIError | None = None

    async def __call__(self) -> dict[str, Any]:
        if self.done:
            return await self.receive()
        remaining = self.deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(self.receive(), timeout=max(remaining, 0.0))
        except TimeoutError:
            self.error = APIError(408, f"the body did not arrive within {self.timeout:g} s (--kv-stream-body-timeout);"
                                       " send it at once", "body", kind="RequestTimeoutError")
            raise self.error from None
        if message.get("type") == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.error = _too_large(self.limit, f"the body passed {self.limit} bytes")
                raise self.error
            if not message.get("more_body", False):
                self.done = True
        else:
            self.done = True
        return message
