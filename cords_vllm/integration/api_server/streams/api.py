"""The stream API's HTTP surface: ``/v1/streams`` on vLLM's OpenAI-compatible server.

===========================================  ==========================================================
``POST   /v1/streams``                        open a stream (optional ``kv_policy`` overrides, ``metadata``)
``GET    /v1/streams``                        list open streams, with the KV each holds
``GET    /v1/streams/{stream_id}``            one stream
``POST   /v1/streams/{stream_id}/frames``     append frames: JSON (``frames``: image data URLs, or ``video``:
                                              a clip's data URL) or ``multipart/form-data`` (``frames`` files
                                              or one ``video`` file); answers once the engine has them
``POST   /v1/streams/{stream_id}/ask``        ask about everything streamed so far: a ``chat.completion``, or
                                              with ``"stream": true`` server-sent ``chat.completion.chunk``\\ s
``DELETE /v1/streams/{stream_id}``            close: the engine frees every block of the stream
===========================================  ==========================================================

Errors use vLLM's error body (``{"error": {"message", "type", "param", "code"}}``) with ``param`` naming the
offending field. Routes live under ``/v1``, so vLLM's ``--api-key`` middleware guards them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from cords_vllm.conversation.text_budget import TextRoomExceeded
from cords_vllm.integration.api_server.streams.frames import (
    FrameError,
    FrameLimits,
    PushMedia,
    decode_push,
    read_push,
    vllm_max_image_pixels,
)
from cords_vllm.integration.api_server.streams.live import LiveStream, StreamEnded, TurnTooLong
from cords_vllm.integration.api_server.streams.registry import StreamNotFound, StreamRegistry, TooManyStreams
from cords_vllm.integration.api_server.streams.schemas import (
    AppendFramesRequest,
    AppendFramesResponse,
    AskRequest,
    Capacity,
    KVHeld,
    OpenStreamRequest,
    StreamDeleted,
    StreamList,
    StreamObject,
)
from cords_vllm.integration.api_server.streams.siblings import LINK_KEY, SiblingLink, is_forwarded
from cords_vllm.integration.handoff.published import HeldKV, read_published

logger = logging.getLogger(__name__)

STATE_KEY = "cords_vllm_streams"


class StreamRoute(APIRoute):
    """A stream route: a body that fails validation is answered 400 with vLLM's error body, ``param`` naming the
    field, in text that can always be encoded (a lone surrogate in a key or value is shown escaped)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return validation_error(exc).response()
            except HTTPException as exc:  # FastAPI's own refusal of a body it cannot parse (e.g. not UTF-8)
                return APIError(exc.status_code, _safe(str(exc.detail), 300), "body").response()
            except RecursionError:  # JSON nested deeper than the parser (or the validation) recurses
                return APIError(400, "the body is nested too deep to be parsed", "body").response()

        return route


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 of a body that fails validation: the first error, its field as ``param``."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body", "body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = _safe(".".join(loc), 80) if loc else "body"
    return APIError(400, f"invalid field {field!r}: {_safe(str(first.get('msg', 'invalid')), 300)}", field)


router = APIRouter(prefix="/v1/streams", tags=["streams (cords-vllm)"], route_class=StreamRoute)


class APIError(Exception):
    """An error answered with vLLM's error body; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             408: "RequestTimeoutError", 409: "ConflictError", 410: "GoneError",
                             413: "RequestTooLargeError",
                             415: "UnsupportedMediaTypeError", 429: "RateLimitError"}.get(status, "Error")

    def response(self) -> Response:
        # ASCII JSON: any text a client sent (a lone surrogate included) is escaped, never an encoding error
        return Response(status_code=self.status, media_type="application/json", content=json.dumps({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.status}}))


def _registry(request: Request) -> StreamRegistry:
    registry = getattr(request.app.state, STATE_KEY, None)
    if registry is None:
        raise APIError(503, "the stream API has no engine on this server", kind="ServiceUnavailableError")
    return registry


def owner_key(request: Request) -> str | None:
    """The API key a request carries (``Authorization: Bearer <key>``), hashed: the owner of the streams it opens.
    ``None`` without one, and on a server without keys, whatever the request carries: every stream has one owner
    there (vLLM checks no key, so a header would be any client's free choice)."""
    registry = getattr(request.app.state, STATE_KEY, None)
    auth = request.headers.get("authorization")
    if not auth or registry is None or not registry.keyed:
        return None
    token = auth[7:] if auth[:7].lower() == "bearer " else auth
    return hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).hexdigest()


def _stream(request: Request, stream_id: str, *, alive: bool = True) -> LiveStream:
    try:
        stream = _registry(request).get(stream_id)
        if stream.owner != owner_key(request):  # another key's stream does not exist for this one
            raise StreamNotFound(stream_id)
    except StreamNotFound as exc:
        raise APIError(404, str(exc), "stream_id") from None
    if alive and stream.ended:
        raise APIError(410, f"stream {stream_id!r} has ended: {stream.ended}; delete it and open a new one",
                       "stream_id")
    return stream


def describe(registry: StreamRegistry, stream: LiveStream, held: Mapping[str, HeldKV] | None = None
             ) -> StreamObject:
    """The API's view of one stream (``held``: what the engine published streams hold, by stream id)."""
    held = read_published().streams if held is None else held
    kv = held.get(stream.id)
    idle = stream.idle_seconds()
    status = "ended" if stream.ended else ("busy" if stream.busy else "idle")
    return StreamObject(
        id=stream.id, created=int(stream.created), model=registry.model_name, status=status,
        ended_reason=stream.ended, frames=stream.stats.frames, clips=stream.stats.clips,
        questions=stream.stats.questions,
        pending_frames=0 if stream.pending_frames is None else len(stream.pending_frames), fps=stream.fps,
        idle_seconds=round(idle, 3),
        expires_in_seconds=None if stream.busy else round(max(0.0, registry.limits.idle_timeout_s - idle), 3),
        kv_policy=registry.policy_of(stream), footprint_blocks=stream.footprint_blocks,
        text_tokens=stream.text.held, max_text_tokens=stream.text.limit,
        kv=None if kv is None or stream.ended else KVHeld(blocks=kv.blocks, tokens=kv.tokens,
                                                          stream_tokens=kv.stream_tokens,
                                                          block_size=registry.block_size),
        metadata=stream.metadata)


# ------------------------------------------------------------------------------------------------------
# Routes
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text} for code, text in (
        (400, "invalid input; `error.param` names the field"), (401, "missing or wrong API key"),
        (404, "no such stream"),
        (409, "the push or question could take the stream past its max_text_tokens: refused, the stream is "
              "unchanged"), (410, "the stream has ended (`error.message` says why)"),
        (413, "too many frames in one push, or a push or question longer than --max-model-len on its own: "
              "refused, the stream is unchanged"),
        (429, "the cap on open streams is reached, or the KV pool is committed to the open streams"),
        (501, "this server's model cannot be streamed (`error.message` says why)"))}


def _safe(text: str, most: int = 80) -> str:
    """``text`` as it can be shown in an error (no lone surrogates, cut to ``most`` characters)."""
    shown = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return shown if len(shown) <= most else shown[: most - 3] + "..."


def _valid_text(text: str, field: str) -> None:
    """Refuse (400) text that is not valid Unicode: a lone surrogate cannot be encoded, shown or tokenised."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{field} is not valid Unicode text (it holds a lone surrogate)", field) from None


def check_metadata(metadata: Mapping[str, str] | None, limits: Any) -> None:
    """Refuse metadata past its limits (413) or that is not valid text (400), naming the field."""
    if not metadata:
        return
    if len(metadata) > limits.max_metadata_items:
        raise APIError(413, f"{len(metadata)} metadata labels; at most {limits.max_metadata_items}", "metadata")
    for key, value in metadata.items():
        field = f"metadata.{_safe(key, 40)}"
        _valid_text(key, field)
        _valid_text(value, field)
        if not key or len(key) > limits.max_metadata_key_chars:
            raise APIError(413 if key else 400, f"a metadata key has 1 to {limits.max_metadata_key_chars} "
                                                 f"characters; this one has {len(key)}", field)
        if len(value) > limits.max_metadata_value_chars:
            raise APIError(413, f"a metadata value has at most {limits.max_metadata_value_chars} characters; this "
                                f"one has {len(value)}", field)


def check_question(question: str, registry: StreamRegistry) -> None:
    """Refuse a question too long (413), not valid text (400), or holding a control token's text (400): a
    client's text never becomes a control or placeholder token of the stream's transcript."""
    limit = registry.limits.max_question_chars
    if len(question) > limit:
        raise APIError(413, f"the question has {len(question)} characters; at most {limit} "
                            "(--kv-stream-max-question-chars)", "question")
    _valid_text(question, "question")
    if found := next((t for t in registry.control_texts if t in question), None):
        raise APIError(400, f"the question holds {found!r}, the text of one of the model's control tokens; a "
                            "question is plain text: leave it out", "question")


@router.post("", status_code=201, response_model=StreamObject, responses=_ERRORS,
             summary="Open a live video stream")
async def open_stream(request: Request, body: OpenStreamRequest | None = None) -> Any:
    registry = _registry(request)
    if registry.unsupported is not None:
        raise APIError(501, registry.unsupported, kind="NotImplementedError")
    body = body or OpenStreamRequest()
    check_metadata(body.metadata, registry.limits)  # before anything changes: a refused open leaves nothing
    overrides = body.kv_policy.model_dump(exclude_none=True) if body.kv_policy else {}
    if overrides:
        error = registry.check_overrides(overrides)
        if error is not None:
            raise APIError(400, error[1], f"kv_policy.{error[0]}")
    try:
        stream = registry.open(overrides=overrides or None, metadata=body.metadata, fps=body.fps,
                               owner=owner_key(request))
    except TooManyStreams as exc:
        raise APIError(429, str(exc)) from None
    return describe(registry, stream, {})


def _described(registry: StreamRegistry, streams: list[LiveStream], held: Mapping[str, HeldKV]) -> list[Any]:
    """Each stream's view; one that cannot be described is logged and left out, never failing the listing."""
    data = []
    for stream in streams:
        try:
            data.append(describe(registry, stream, held))
        except Exception:
            logger.exception("cords-vllm: stream %s cannot be listed", stream.id)
    return data


@router.get("", response_model=StreamList, responses=_ERRORS, summary="List open streams and the KV each holds")
async def list_streams(request: Request) -> Any:
    registry = _registry(request)
    held = read_published().streams
    data: list[Any] = _described(registry, registry.owned_by(owner_key(request)), held)
    link: SiblingLink | None = getattr(request.app.state, LINK_KEY, None)
    if link is not None and not is_forwarded(request.scope):  # every API server's streams
        data.extend(StreamObject.model_validate(item) for item in await link.gather(list(request.headers.items())))
    return StreamList(data=data, capacity=Capacity(**registry.capacity()))


@router.get("/{stream_id}", response_model=StreamObject, responses=_ERRORS, summary="One stream")
async def get_stream(request: Request, stream_id: str) -> Any:
    return describe(_registry(request), _stream(request, stream_id, alive=False))


@router.delete("/{stream_id}", response_model=StreamDeleted, responses=_ERRORS,
               summary="Close a stream and free its KV")
async def delete_stream(request: Request, stream_id: str) -> Any:
    registry = _registry(request)
    stream = _stream(request, stream_id, alive=False)
    await registry.close(stream_id)
    return StreamDeleted(id=stream_id, stream=describe(registry, stream, {}))


_FRAMES_BODY = {"requestBody": {"content": {
    "application/json": {"schema": AppendFramesRequest.model_json_schema()},
    "multipart/form-data": {"schema": {"type": "object", "properties": {
        "frames": {"type": "array", "items": {"type": "string", "format": "binary"},
                   "description": "JPEG or PNG frames, in time order"},
        "video": {"type": "string", "format": "binary", "description": "one short clip"}}}},
}, "required": True}}


@router.post("/{stream_id}/frames", response_model=AppendFramesResponse, responses=_ERRORS,
             openapi_extra=_FRAMES_BODY, summary="Append frames (images or a short clip) to a stream")
async def append_frames(request: Request, stream_id: str) -> Any:
    registry = _registry(request)
    stream = _stream(request, stream_id)
    t0 = time.perf_counter()
    media = await _read_push(request, registry, stream)
    try:
        async with registry.decode_budget.reserve(media.decoded_bytes):  # until the engine has the clip
            async with registry.decoding:  # pushes decoded at once on this API server are bounded
                frames = await asyncio.to_thread(decode_push, media, _max_pixels(registry.limits.max_frame_pixels))
            if stream.ended:
                raise APIError(410, f"stream {stream_id!r} has ended: {stream.ended}", "stream_id")
            sent = await stream.append(frames)
            del frames
    except FrameError as exc:
        raise APIError(exc.status, str(exc), exc.field) from None
    except StreamEnded as exc:
        raise APIError(410, f"stream {stream_id!r} has ended: {exc}", "stream_id") from None
    except TextRoomExceeded as exc:
        raise APIError(409, f"stream {stream_id!r}: {exc}. Nothing was appended; the stream can take no more "
                            f"frames after this answer: open a new stream", "stream_id") from None
    except TurnTooLong as exc:
        raise APIError(413, f"stream {stream_id!r}: {exc}. Nothing was appended; the stream is unchanged",
                       media.field) from None
    return AppendFramesResponse(stream=describe(registry, stream), frames_received=media.count, frames_sent=sent,
                                seconds=round(time.perf_counter() - t0, 4))


async def _read_push(request: Request, registry: StreamRegistry, stream: LiveStream) -> PushMedia:
    """The request's push read from its headers, with every rule that needs no decoded frame checked."""
    try:
        items, clip = await _body_media(request, registry.limits)
        limits = registry.limits
        frame_limits = FrameLimits(limits.max_frames_per_push, _max_pixels(limits.max_frame_pixels))
        media = await asyncio.to_thread(read_push, items, clip, frame_limits, limits.min_frame_side)
        registry.push_bounds.check(media, held=stream.held_frames(media.width, media.height))
        return media
    except FrameError as exc:
        raise APIError(exc.status, str(exc), exc.field) from None
    except ClientDisconnect:  # the client vanished mid-upload: nothing was appended, nobody to answer
        raise APIError(400, "the client disconnected before its frames arrived", "body") from None


async def _body_media(request: Request, limits: Any) -> tuple[list[Any], Any]:
    """``(frames, video)`` of a push body: JSON (data URLs) or multipart (uploaded files)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        try:  # a file past the frame limit is not even spooled
            form = await request.form(max_files=limits.max_frames_per_push + 1, max_fields=8)
        except HTTPException as exc:
            if "Too many files" in str(exc.detail):
                raise APIError(413, f"more than {limits.max_frames_per_push} files in one push "
                                    "(--kv-stream-max-frames)", "frames") from None
            raise
        files = form.getlist("frames")
        video = form.get("video")
        if unknown := sorted(set(form.keys()) - {"frames", "video"}):
            raise APIError(400, f"unknown form field {unknown[0]!r}; send 'frames' files or one 'video' file",
                           unknown[0])
        items = [(await f.read(), f"frames[{i}]") for i, f in enumerate(files) if hasattr(f, "read")]
        if len(items) != len(files):
            raise APIError(400, "'frames' must be uploaded files", "frames")
        clip = (await video.read(), (getattr(video, "content_type", "") or "video/mp4").lower()) \
            if hasattr(video, "read") else None
        if video is not None and clip is None:
            raise APIError(400, "'video' must be an uploaded file", "video")
    elif content_type in ("application/json", ""):
        try:
            body = AppendFramesRequest.model_validate(await request.json())
        except json.JSONDecodeError:
            raise APIError(400, "the body is not valid JSON", "body") from None
        except RecursionError:
            raise APIError(400, "the body is nested too deep to be parsed", "body") from None
        except ValueError as exc:
            field = _safe(_first_loc(exc))
            raise APIError(400, _safe(f"invalid field {field!r}: {exc}".splitlines()[0], 300), field) from None
        items, clip = body.frames or [], body.video
    else:
        raise APIError(415, f"content type {content_type!r} is not supported; send application/json or "
                            f"multipart/form-data", "content-type")
    if bool(items) == (clip is not None):
        raise APIError(400, "send either 'frames' (one or more images) or 'video' (one clip)",
                       "frames" if not items else "video")
    return items, clip  # counted, with everything else read from the headers, by read_push


def _max_pixels(stream_limit: int) -> int:
    """The tighter of the stream's frame-size limit and vLLM's ``VLLM_MAX_IMAGE_PIXELS`` (0: no limit)."""
    vllm_limit = vllm_max_image_pixels()
    return min(stream_limit, vllm_limit) if vllm_limit > 0 else stream_limit


def _first_loc(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors) and errors():
        return ".".join(str(p) for p in errors()[0].get("loc", ())) or "body"
    return "body"


@router.post("/{stream_id}/ask", responses={**_ERRORS, 200: {
    "description": "a chat.completion, or with `stream: true` server-sent chat.completion.chunk events",
    "content": {"text/event-stream": {}}}}, summary="Ask a question about everything streamed so far")
async def ask(request: Request, stream_id: str, body: AskRequest) -> Any:
    registry = _registry(request)
    stream = _stream(request, stream_id)
    check_question(body.question, registry)
    if body.max_tokens > registry.limits.max_answer_tokens:
        raise APIError(400, f"max_tokens is {body.max_tokens}; at most {registry.limits.max_answer_tokens}",
                       "max_tokens")
    try:
        turn = await stream.ask(body.question, max_tokens=body.max_tokens, temperature=body.temperature,
                                seed=body.seed)
    except StreamEnded as exc:
        raise APIError(410, f"stream {stream_id!r} has ended: {exc}", "stream_id") from None
    except TextRoomExceeded as exc:
        raise APIError(409, f"stream {stream_id!r}: {exc}. Nothing was asked and the stream is unchanged: ask "
                            f"a shorter question, lower max_tokens, or open a new stream", "question") from None
    except TurnTooLong as exc:
        raise APIError(413, f"stream {stream_id!r}: {exc}. Nothing was asked and the stream is unchanged",
                       "question") from None
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if body.stream:
        return StreamingResponse(_sse(turn, completion_id, created, registry.model_name, stream_id),
                                 media_type="text/event-stream")
    try:
        result = await turn.wait()
    except StreamEnded as exc:
        raise APIError(410, f"stream {stream_id!r} has ended: {exc}", "stream_id") from None
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": registry.model_name,
            "stream_id": stream_id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "finish_reason": result.finish_reason}],
            "usage": {"completion_tokens": len(result.token_ids)}}


async def _sse(turn: Any, completion_id: str, created: int, model: str, stream_id: str) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None) -> str:
        return "data: " + json.dumps({
            "id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "stream_id": stream_id, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""}, None)
    try:
        async for text, _, finish in turn.deltas():
            if text:
                yield chunk({"content": text}, None)
            if finish is not None:
                yield chunk({}, finish)
    except StreamEnded as exc:
        yield "data: " + json.dumps({"error": {"message": f"stream {stream_id!r} has ended: {exc}",
                                               "type": "GoneError", "param": "stream_id", "code": 410}}) + "\n\n"
    yield "data: [DONE]\n\n"
