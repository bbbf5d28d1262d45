"""Several API servers, one stream API: every stream request reaches the API server that holds the stream.

With ``--api-server-count N`` (vLLM's default under ``--data-parallel-size N``) N API-server processes accept on
one port and the kernel hands each connection to any of them. A stream is an engine session owned by the
process that opened it (its turns are an async generator there), so a push, question, listing or delete that
reaches another process must go to the owner. The stream id names its owner
(:func:`~cords_vllm.integration.api_server.streams.registry.stream_id`).

:class:`SiblingLink` gives each API server a private Unix socket in the server's shared publication directory
(``CORDS_VLLM_METRICS_DIR``, private to one ``vllm serve`` and removed with it) on which it serves the same app,
without lifespan or signal handling (the public server owns those). :class:`StreamForwarding`, an ASGI
middleware, relays a request for another API server's stream there unchanged (method, path, headers with the
API key, body) and streams the answer back as it comes, server-sent events included; the forwarded request
carries :data:`FORWARDED_HEADER`, so it is never relayed twice. ``GET /v1/streams`` gathers every API server's
streams (:meth:`SiblingLink.gather`).

The header's value is a secret drawn once per server start (:func:`relay_secret`, a file in the shared directory,
which only the server's user can read): only the server's own processes can mark a request as relayed. A client's
copy of the header is taken off the request and has no effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cords_vllm.integration.api_server.streams.registry import owner_of

logger = logging.getLogger(__name__)

#: Set on a relayed request (the server's relay secret): the receiver answers it itself.
FORWARDED_HEADER = "x-cords-vllm-forwarded"
#: The ASGI scope key that marks a request relayed by a sibling (the header checked and taken off).
FORWARDED_SCOPE_KEY = "cords_vllm_forwarded"
SECRET_FILE = "stream-relay-secret"
#: ``app.state`` attribute holding this API server's :class:`SiblingLink` (absent: one API server).
LINK_KEY = "cords_vllm_stream_siblings"
PREFIX = "/v1/streams"
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection", "host",
               "content-length"}


class SiblingLink:
    """This API server's place among ``count`` API servers: its own socket and its siblings'.

    ``directory`` is shared by every process of the server; API server ``i`` listens on
    ``directory/streams-api-<i>.sock``.
    """

    def __init__(self, index: int, count: int, directory: Path) -> None:
        if not 0 <= index < count:
            raise ValueError(f"API server index {index} is outside 0..{count - 1}")
        self.index, self.count, self.directory = index, count, directory
        self.secret = relay_secret(directory)
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._clients: dict[int, Any] = {}

    def socket_path(self, index: int) -> Path:
        return self.directory / f"streams-api-{index}.sock"

    @property
    def siblings(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    # ------------------------------------------------------------------------------------------------
    async def start(self, app: Any) -> None:
        """Serve ``app`` on this API server's private socket (a task on the running loop)."""
        import uvicorn

        class _Inner(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # the public server handles signals
                yield

        path = self.socket_path(self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        config = uvicorn.Config(app, uds=str(path), lifespan="off", log_level="warning", access_log=False)
        self._server = _Inner(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(), name="cords-vllm sibling socket")
        for _ in range(200):  # up within a second or two; requests wait for it otherwise
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if self._task.done() and self._task.exception() is not None:
            raise RuntimeError(f"cannot serve the stream API on {path.name}: {self._task.exception()}")
        logger.info("cords-vllm: API server %d of %d relays streams it does not hold to their owner",
                    self.index, self.count)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    def _client(self, index: int) -> Any:
        import httpx

        client = self._clients.get(index)
        if client is None:
            transport = httpx.AsyncHTTPTransport(uds=str(self.socket_path(index)))
            client = httpx.AsyncClient(transport=transport, base_url="http://api-server", timeout=None)
            self._clients[index] = client
        return client

    # ------------------------------------------------------------------------------------------------
    async def relay(self, owner: int, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Send the ASGI request to API server ``owner`` and its answer back, chunk by chunk."""
        import httpx

        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ())
                   if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        headers.append((FORWARDED_HEADER, self.secret))  # a client's copy was taken off (StreamForwarding)
        target = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        client = self._client(owner)
        try:
            response = await client.send(client.build_request(scope["method"], target, headers=headers,
                                                              content=bytes(body)), stream=True)
        except httpx.TransportError as exc:
            await _send_error(send, 503, f"the API server holding this stream (index {owner}) cannot be reached: "
                                         f"{type(exc).__name__}")
            return
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                    for k, v in response.headers.multi_items() if k.lower() not in _HOP_BY_HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def gather(self, headers: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Every sibling's own streams (``GET /v1/streams`` answered locally there), as JSON objects."""
        import httpx

        sent = [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP] + [(FORWARDED_HEADER, self.secret)]

        async def one(index: int) -> list[dict[str, Any]]:
            try:
                response = await self._client(index).get(PREFIX, headers=sent)
            except httpx.TransportError:
                logger.warning("cords-vllm: API server %d did not answer for its streams", index)
                return []
            return list(response.json().get("data", [])) if response.status_code == 200 else []

        found = await asyncio.gather(*(one(i) for i in self.siblings))
        return [item for part in found for item in part]


class StreamForwarding:
    """ASGI middleware: a request for a stream another API server holds is relayed there."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (scope["path"] == PREFIX or scope["path"].startswith(PREFIX + "/")):
            link: SiblingLink | None = getattr(getattr(scope.get("app"), "state", None), LINK_KEY, None)
            scope = _take_forwarded_mark(scope, link)
            if link is not None and not is_forwarded(scope) and scope["path"] != PREFIX:
                owner = owner_of(scope["path"][len(PREFIX) + 1:].split("/", 1)[0])
                if owner is not None and owner != link.index and owner < link.count:
                    await link.relay(owner, scope, receive, send)
                    return
        await self.app(scope, receive, send)


def relay_secret(directory: Path) -> str:
    """The relay secret of this server start, shared by its API servers through ``directory`` (the first to ask
    draws it; the file appears whole, by a hard link, or not at all)."""
    path = directory / SECRET_FILE
    if not path.exists():
        draft = directory / f".{SECRET_FILE}-{os.getpid()}"
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
        draft.unlink()
    return path.read_text()


def is_forwarded(scope: dict[str, Any]) -> bool:
    """Whether a sibling relayed this request (marked by :class:`StreamForwarding`)."""
    return bool(scope.get(FORWARDED_SCOPE_KEY))


def _take_forwarded_mark(scope: dict[str, Any], link: SiblingLink | None) -> dict[str, Any]:
    """``scope`` without :data:`FORWARDED_HEADER`, marked as relayed when the header held this server's secret."""
    key = FORWARDED_HEADER.encode()
    marks = [v for k, v in scope.get("headers", ()) if k.lower() == key]
    if not marks:
        return scope
    genuine = link is not None and len(marks) == 1 and hmac.compare_digest(marks[0], link.secret.encode())
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != key]
    return {**scope, "headers": headers, FORWARDED_SCOPE_KEY: genuine}


async def _send_error(send: Any, status: int, message: str) -> None:
    import json

    body = json.dumps({"error": {"message": message, "type": "ServiceUnavailableError", "param": "stream_id",
                                 "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
