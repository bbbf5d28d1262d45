"""A small Python client of the stream API (``/v1/streams``): push frames as they arrive, ask at any time.

Only the standard library, numpy and Pillow (both already vLLM dependencies)::

    from cords_vllm.client import StreamClient, camera, video_file_frames

    client = StreamClient("http://127.0.0.1:8000", api_key=None)
    with client.open(kv_policy={"budget": 1024}) as stream:      # DELETE on exit
        for clip in camera(video_file_frames("cam.mp4"), fps=2, push_every=8):   # paced in real time
            stream.append(clip)
        print(stream.ask("What happened at the door?"))
        for piece in stream.ask("And then?", stream_answer=True):   # server-sent events
            print(piece, end="", flush=True)

Errors come back as :class:`StreamAPIError` with the HTTP status, the server's message and the field it
names (``param``).

**Behind vLLM's router** (``vllm-router --policy sticky_least_loaded`` or ``consistent_hash`` in front of several
servers), pass ``router=True``: every request of a stream carries one session key (header ``X-Session-ID``, chosen
by the client at open) so the router sends it to the server that holds the stream; an open refused by a full
server (429) is retried under a fresh key, and the router's session is released (``POST /finish_session``) when
the stream closes. See the README's "Scaling out".
"""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: The header vLLM's router keys sessions on (``consistent_hash``, ``sticky_least_loaded``).
SESSION_HEADER = "X-Session-ID"


class StreamAPIError(RuntimeError):
    """An error answer of the stream API: ``status`` (HTTP), ``message`` and ``param`` (the field named)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" + (f" (field {param!r})" if param else ""))
        self.status, self.message, self.param = status, message, param


def encode_frame(frame: np.ndarray, fmt: str = "jpeg", quality: int = 90) -> bytes:
    """One ``[H, W, 3]`` uint8 RGB frame -> JPEG or PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(frame, dtype=np.uint8))
    if fmt == "png":
        image.save(buf, format="PNG")
    else:
        image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def frame_data_url(frame: np.ndarray, fmt: str = "jpeg", quality: int = 90) -> str:
    """``data:image/<fmt>;base64,...`` of one frame."""
    return f"data:image/{fmt};base64," + base64.b64encode(encode_frame(frame, fmt, quality)).decode()


class StreamClient:
    """The stream API of one server (``base_url`` like ``http://127.0.0.1:8000``), or of several behind vLLM's
    router (``router=True``, ``base_url`` the router's).

    Every stream carries a session key (:data:`SESSION_HEADER`) on all its requests. With ``router=True`` an open
    refused with 429 (that server's pool or cap is full) is retried under a fresh key, ``open_attempts`` times in
    all (default 4), and each key is released at the router (``POST /finish_session``) once it is no longer used:
    the refused ones when the open is settled, the stream's own when it closes. The refused keys stay booked until
    then, so ``sticky_least_loaded`` counts them and turns to another server.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0, *,
                 router: bool = False, open_attempts: int | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.router = router
        self.open_attempts = open_attempts if open_attempts is not None else (4 if router else 1)
        if self.open_attempts < 1:
            raise ValueError(f"open_attempts must be at least 1, got {self.open_attempts}")

    # ----------------------------------------------------------------------------------------------
    def _headers(self, content_type: str | None = "application/json", session: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if session:
            headers[SESSION_HEADER] = session
        return headers

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                content_type: str | None = "application/json", session: str | None = None) -> Any:
        """One call (``session``: the stream's session key, sent as :data:`SESSION_HEADER`); returns the decoded
        JSON answer or raises :class:`StreamAPIError`."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers=self._headers(content_type if data is not None else None, session))
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise _api_error(exc) from None

    def open(self, *, kv_policy: dict[str, int] | None = None, metadata: dict[str, str] | None = None,
             fps: float | None = None) -> Stream:
        """Open a stream (``kv_policy``: per-stream overrides, each at most the server's value; ``fps``: the
        camera's frames per second, default 2 on the server). Behind a router, a 429 is retried under a fresh
        session key (``open_attempts`` in all); the stream's ``refusals`` counts the refused tries."""
        body: dict[str, Any] = {}
        if fps is not None:
            body["fps"] = fps
        if kv_policy:
            body["kv_policy"] = kv_policy
        if metadata:
            body["metadata"] = metadata
        refused: list[str] = []
        try:
            while True:
                session = uuid.uuid4().hex
                try:
                    info = self.request("POST", "/v1/streams", body, session=session)
                except StreamAPIError as error:
                    refused.append(session)
                    if error.status != 429 or len(refused) == self.open_attempts:
                        raise
                    continue
                return Stream(self, info, session=session, refusals=len(refused))
        finally:
            self.finish_sessions(refused)

    def finish_sessions(self, sessions: Sequence[str]) -> None:
        """Release session keys at the router (``POST /finish_session``); nothing without ``router``. Errors are
        ignored: the router forgets a session by itself after its expiry."""
        if not self.router:
            return
        for session in sessions:
            req = urllib.request.Request(f"{self.base_url}/finish_session?session_id={session}", data=b"",
                                         method="POST", headers=self._headers(None))
            try:
                with urllib.request.urlopen(req, timeout=self.timeout):
                    pass
            except OSError:  # URLError and HTTPError are OSErrors
                pass

    def one_shot(self, path: str, body: dict[str, Any]) -> Any:
        """A request that belongs to no stream (``/v1/chat/completions``, ``/v1/completions``): behind a router
        it goes under a fresh session key, released after the answer, so one-shot requests spread over the
        servers (without a key vLLM's router sends every one of them to the same server)."""
        session = uuid.uuid4().hex if self.router else None
        try:
            return self.request("POST", path, body, session=session)
        finally:
            if session:
                self.finish_sessions([session])

    def list(self) -> list[dict[str, Any]]:
        """Every open stream on the server, with the KV each holds (behind a router: one server's)."""
        return self.request("GET", "/v1/streams")["data"]

    def stream(self, stream_id: str, session: str | None = None) -> Stream:
        """A handle on a stream opened earlier (behind a router, with the ``session`` key it was opened with)."""
        return Stream(self, self.request("GET", f"/v1/streams/{stream_id}", session=session), session=session)


class Stream:
    """One open stream; use as a context manager to close it on exit.

    ``session`` is the key every request of the stream carries (a router keeps the stream on its server by it);
    ``refusals`` counts the opens refused (429) before this one was admitted.
    """

    def __init__(self, client: StreamClient, info: dict[str, Any], *, session: str | None = None,
                 refusals: int = 0) -> None:
        self.client = client
        self.info = info
        self.id: str = info["id"]
        self.session = session
        self.refusals = refusals

    def _call(self, method: str, path: str = "", body: Any = None, **kwargs: Any) -> Any:
        return self.client.request(method, f"/v1/streams/{self.id}{path}", body, session=self.session, **kwargs)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.close()
        except StreamAPIError as error:
            if error.status != 404:  # already gone (expired): nothing to free
                raise

    def refresh(self) -> dict[str, Any]:
        """The stream's current listing (frames, KV held, status)."""
        self.info = self._call("GET")
        return self.info

    def append(self, frames: np.ndarray | Sequence[np.ndarray], *, fmt: str = "jpeg",
               multipart: bool = False) -> dict[str, Any]:
        """Append frames (``[T, H, W, 3]`` uint8) as JPEG/PNG images; returns once the engine has them.
        ``multipart`` uploads files instead of JSON data URLs (not through vLLM's router, which forwards JSON
        bodies only)."""
        if multipart:
            if self.client.router:
                raise ValueError("vLLM's router forwards JSON bodies only: append without multipart=True")
            files = [("frames", f"frame{i}.{fmt}", f"image/{fmt}", encode_frame(f, fmt)) for i, f in enumerate(frames)]
            raw, content_type = _multipart(files)
            answer = self._call("POST", "/frames", raw=raw, content_type=content_type)
        else:
            answer = self._call("POST", "/frames", {"frames": [frame_data_url(f, fmt) for f in frames]})
        self.info = answer["stream"]
        return answer

    def append_video(self, path: str | Path, media_type: str = "video/mp4") -> dict[str, Any]:
        """Append a short clip file: uploaded as multipart ``video``, or behind a router (JSON bodies only) as a
        ``video`` data URL."""
        data = Path(path).read_bytes()
        if self.client.router:
            url = f"data:{media_type};base64," + base64.b64encode(data).decode()
            answer = self._call("POST", "/frames", {"video": url})
        else:
            raw, content_type = _multipart([("video", Path(path).name, media_type, data)])
            answer = self._call("POST", "/frames", raw=raw, content_type=content_type)
        self.info = answer["stream"]
        return answer

    def ask(self, question: str, *, max_tokens: int = 16, temperature: float = 0.0,
            stream_answer: bool = False) -> Any:
        """Ask about everything streamed so far: the answer text, or (``stream_answer``) an iterator of its
        pieces as the server streams them."""
        body = {"question": question, "max_tokens": max_tokens, "temperature": temperature}
        if not stream_answer:
            answer = self._call("POST", "/ask", body)
            return answer["choices"][0]["message"]["content"]
        return self._ask_streamed({**body, "stream": True})

    def _ask_streamed(self, body: dict[str, Any]) -> Iterator[str]:
        client = self.client
        req = urllib.request.Request(f"{client.base_url}/v1/streams/{self.id}/ask", data=json.dumps(body).encode(),
                                     method="POST", headers=client._headers(session=self.session))
        try:
            resp = urllib.request.urlopen(req, timeout=client.timeout)
        except urllib.error.HTTPError as exc:
            raise _api_error(exc) from None
        with resp:
            for event in sse_events(resp):
                if "error" in event:
                    err = event["error"]
                    raise StreamAPIError(err.get("code", 500), err.get("message", ""), err.get("param"))
                piece = event["choices"][0]["delta"].get("content")
                if piece:
                    yield piece

    def close(self) -> dict[str, Any]:
        """Close the stream: the server frees its KV (and a router releases its session)."""
        try:
            return self._call("DELETE")
        finally:
            if self.session:
                self.client.finish_sessions([self.session])


def sse_events(resp: Any) -> Iterator[dict[str, Any]]:
    """The JSON events of a ``text/event-stream`` response, up to ``data: [DONE]``."""
    for line in resp:
        line = line.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def camera(frames: Iterable[np.ndarray], *, fps: float, push_every: int) -> Iterator[np.ndarray]:
    """Group ``frames`` into pushes of ``push_every`` frames, released in real time at ``fps``.

    A push is yielded when its last frame "arrives" (``push_every / fps`` seconds after the previous one);
    if the caller is slower than real time the next push is yielded at once (the caller measures its lag).
    """
    start = time.monotonic()
    buf: list[np.ndarray] = []
    for count, frame in enumerate(frames, 1):
        buf.append(frame)
        if len(buf) == push_every:
            delay = start + count / fps - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            yield np.stack(buf)
            buf = []
    if buf:
        yield np.stack(buf)


def video_file_frames(path: str | Path) -> Iterator[np.ndarray]:
    """Every frame of a video file, ``[H, W, 3]`` uint8 RGB (decoded with OpenCV, a vLLM dependency)."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    if not cap.isOpened():
        raise FileNotFoundError(f"cannot open video {path}")
    try:
        while True:
            ok, frame = cap.read()
            if not ok:
                return
            yield frame[..., ::-1].copy()
    finally:
        cap.release()


def _multipart(files: list[tuple[str, str, str, bytes]]) -> tuple[bytes, str]:
    """``multipart/form-data`` body of ``(field, filename, media type, bytes)`` parts."""
    boundary = uuid.uuid4().hex
    out = io.BytesIO()
    for field, filename, media_type, data in files:
        out.write(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"{filename}\"\r\n"
                  f"Content-Type: {media_type}\r\n\r\n".encode())
        out.write(data)
        out.write(b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def _api_error(exc: urllib.error.HTTPError) -> StreamAPIError:
    text = exc.read().decode(errors="replace")
    try:
        err = json.loads(text).get("error", {})
    except (ValueError, AttributeError):
        err = {"message": text.strip()}  # a plain-text answer (a proxy's, e.g. vLLM's router)
    if isinstance(err, str):
        err = {"message": err}
    return StreamAPIError(exc.code, err.get("message") or str(exc), err.get("param"))
