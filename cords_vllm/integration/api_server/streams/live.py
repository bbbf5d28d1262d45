"""One live stream: a resumable vLLM request that clips and questions are appended to, turn by turn.

vLLM 0.32's ``EngineClient.generate`` accepts an async generator of ``StreamingInput``: every item is one
turn (its prompt is appended to the request, then ``max_tokens`` tokens are generated); a turn ends with an
output whose ``finish_reason`` is set while the request is not finished; closing the generator ends the
request. :class:`LiveStream` owns that generator and one pump task that reads the request's outputs, so
turns run one at a time and each turn is read to its end even when the HTTP client that asked for it has
gone (the next turn must not read its leftovers).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cords_vllm.conversation.text_budget import TextBudget, TextRoomExceeded
from cords_vllm.conversation.transcript import CHATML, Markup, Transcript
from cords_vllm.integration.handoff.published import PUBLISH_INTERVAL_S, read_published


class StreamEnded(RuntimeError):
    """The stream's request ended (closed, expired, aborted, or ended by the engine); the message says why."""


class TurnTooLong(ValueError):
    """One turn alone is longer than ``--max-model-len``: refused before the engine sees it, the stream unchanged."""


@dataclass
class TurnOutput:
    """What one turn produced: generated text and token ids so far, and why it ended (``None``: running)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class Turn:
    """One turn's outputs as they arrive (deltas), for one reader."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, list[int], str | None] | BaseException] = asyncio.Queue()
        self.result = TurnOutput()
        self.done = asyncio.Event()

    def put(self, text: str, token_ids: list[int], finish_reason: str | None) -> None:
        self.result.text += text
        self.result.token_ids.extend(token_ids)
        self.result.finish_reason = finish_reason
        self.queue.put_nowait((text, token_ids, finish_reason))
        if finish_reason is not None:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.queue.put_nowait(error)
        self.done.set()

    async def deltas(self) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """``(text, token_ids, finish_reason)`` per engine output until the turn ends; raises if it failed."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[2] is not None:
                return

    async def wait(self) -> TurnOutput:
        async for _ in self.deltas():
            pass
        return self.result


@dataclass
class StreamStats:
    """Counters of one stream (what ``GET /v1/streams`` shows besides the KV held)."""

    frames: int = 0
    clips: int = 0
    questions: int = 0
    #: Frames sent to the engine (``frames`` less an odd one held back): the next clip's first frame index.
    frames_sent: int = 0


#: Frames per second a stream's camera is taken to run at unless its client says otherwise.
DEFAULT_FPS = 2.0


def clip_input(frames: np.ndarray, fps: float, first: int) -> tuple[np.ndarray, dict[str, Any]]:
    """A clip as the engine's video input: ``frames`` ``[T, H, W, 3]`` with their metadata.

    The frames are frames ``first .. first + T - 1`` of a camera at ``fps``: their times are what Qwen2.5-VL's
    temporal positions (``second_per_grid_t``) and Qwen3-VL's timestamp text follow, so Qwen3-VL reads each frame's
    time since the stream opened. ``do_sample_frames`` is off: every frame pushed is shown.
    """
    n = len(frames)
    return frames, {"fps": float(fps), "duration": (first + n) / fps, "total_num_frames": first + n,
                    "frames_indices": list(range(first, first + n)), "video_backend": "opencv",
                    "do_sample_frames": False}


class LiveStream:
    """A stream's engine request and its turns.

    Parameters
    ----------
    engine:
        vLLM's ``EngineClient`` (``AsyncLLM``).
    stream_id:
        The request id given to the engine (the engine's own id adds a suffix).
    extra_args:
        ``SamplingParams.extra_args`` of every turn (e.g. the stream's KV policy overrides).
    text, count_text:
        The stream's protected-token account and ``text -> protected tokens`` of a turn's prompt: a turn that
        would take the stream past ``text.limit`` is refused (:class:`~cords_vllm.conversation.text_budget.
        TextRoomExceeded`) before the engine sees it, leaving the stream unchanged. ``count_text=None``: no
        check (the engine still enforces its own limit).
    fps:
        The camera's frames per second (:data:`DEFAULT_FPS` if not given): the time of every frame pushed.
    turn_tokens, max_model_len:
        ``(prompt text, clip or None, clip metadata or None) -> (tokens, video tokens)`` of one turn as the engine
        will count them (its text with what the processor writes for the clip: video tokens, and Qwen3-VL's frame
        times; the clip is ``[T, H, W, 3]``), and the server's ``--max-model-len``: a
        turn longer than that on its own is refused (:class:`TurnTooLong`) before the engine sees it, which would
        otherwise end the stream.
        ``None``: no check.
    max_clip_tokens:
        The most video tokens of one clip the engine takes (its encoder cache; :mod:`.push_bounds`): a clip with
        more is refused (:class:`TurnTooLong`) before the engine, which would end the stream. ``None``: no check.
    temporal_patch:
        Frames per temporal patch of the served model's video encoder
        (:attr:`~cords_vllm.model_facts.ModelFacts.frames_per_patch`, through the registry's push bounds): a clip
        holds whole patches, and the frames of a push past the last whole one wait for the next push.
    engine_index:
        The data-parallel engine holding the stream's KV (every turn is sent there); ``None``: the only one.
    markup:
        The served model's chat markup, the stream's turns are written in (``None``: the Qwen-VL ChatML).
    """

    def __init__(self, engine: Any, stream_id: str | None = None, *, extra_args: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None, text: TextBudget | None = None,
                 count_text: Callable[[str], int] | None = None,
                 turn_tokens: Callable[[str, np.ndarray | None, dict[str, Any] | None], tuple[int, int]] | None = None,
                 max_model_len: int | None = None, max_clip_tokens: int | None = None, fps: float | None = None,
                 temporal_patch: int,
                 engine_index: int | None = None, markup: Markup | None = None) -> None:
        self.engine = engine
        self.engine_index = engine_index
        self.fps = float(fps or DEFAULT_FPS)
        self.id = stream_id or f"stream-{uuid.uuid4().hex[:16]}"
        self.extra_args = extra_args or None
        self.metadata = metadata or {}
        self.created = time.time()
        self.last_active = time.monotonic()
        self.stats = StreamStats()
        self.transcript = Transcript(markup or CHATML)
        self.text = text or TextBudget(None)
        self.count_text = count_text
        self.turn_tokens = turn_tokens
        self.max_model_len = max_model_len
        self.max_clip_tokens = max_clip_tokens
        self.temporal_patch = temporal_patch
        self.ended: str | None = None
        #: The most KV blocks the stream can hold (set by the registry when it admits the stream).
        self.footprint_blocks = 0
        #: The API key that opened it, hashed (set by the registry; ``None``: opened without a key).
        self.owner: str | None = None
        self.pending_frames: np.ndarray | None = None
        self._inputs: asyncio.Queue[Any] = asyncio.Queue()
        self._turn: Turn | None = None
        self._slot = asyncio.Lock()
        #: Pushes and questions, one at a time in arrival order (asyncio's lock is first come, first served): each
        #: push's frame times follow the previous push's.
        self._order = asyncio.Lock()
        self._pump: asyncio.Task | None = None

    # ----------------------------------------------------------------------------------------------
    def params(self, max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> Any:
        """Sampling parameters of one turn (deltas, no stop strings: what resumable requests allow)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                              output_kind=RequestOutputKind.DELTA, extra_args=self.extra_args)

    async def _input_stream(self) -> AsyncIterator[Any]:
        while True:
            item = await self._inputs.get()
            if item is None:
                return
            yield item

    def _start(self) -> None:
        placed = {} if self.engine_index is None else {"data_parallel_rank": self.engine_index}
        generator = self.engine.generate(self._input_stream(), self.params(1), self.id, **placed)
        self._pump = asyncio.create_task(self._read(generator), name=f"cords-vllm {self.id}")

    async def _read(self, generator: Any) -> None:
        try:
            async for output in generator:
                turn = self._turn
                completion = output.outputs[0] if output.outputs else None
                finish = completion.finish_reason if completion is not None else None
                if output.finished and finish is None:
                    finish = "stop"
                if finish == "error":
                    # The engine ended the request (vLLM then starts a fresh request for the next input under the
                    # same id, with none of the stream's history): the stream ends here, and its turn with it.
                    self.ended = self.ended or _engine_end_reason(finish, await published_end_reason(self.id))
                    break
                if turn is not None:
                    turn.put(completion.text if completion else "", list(completion.token_ids) if completion else [],
                             finish)
                    if finish is not None:
                        self.text.finish(len(turn.result.token_ids))
                        self._turn = None
                        self.last_active = time.monotonic()
                if output.finished:
                    self.ended = self.ended or _engine_end_reason(finish)
                    break
        except asyncio.CancelledError:
            self.ended = self.ended or "aborted"
            raise
        except Exception as exc:  # the engine ended the request with an error
            self.ended = self.ended or f"the engine ended the stream: {type(exc).__name__}: {exc}"
        finally:
            self.ended = self.ended or "closed"
            if self._turn is not None:
                self._turn.fail(StreamEnded(self.ended))
                self._turn = None
            self._inputs.put_nowait(None)  # no further input reaches the engine under this stream's id
            with contextlib.suppress(Exception):
                await generator.aclose()

    # ----------------------------------------------------------------------------------------------
    async def run_turn(self, build: Callable[[Transcript], dict[str, Any]], params: Any, what: str,
                       clip: np.ndarray | None = None, clip_metadata: dict[str, Any] | None = None) -> Turn:
        """Queue one turn once the previous one has ended; returns it (read it with :meth:`Turn.deltas`).

        ``build`` gives the turn's prompt (``{"prompt": text, ...}``) from the conversation as it stands then,
        advancing the transcript it is given; ``what`` names the turn in a refusal; ``clip`` is its video, if any,
        with its ``clip_metadata`` (:func:`clip_input`).
        Raises (nothing sent, the stream unchanged) :class:`~cords_vllm.conversation.text_budget.TextRoomExceeded`
        when the turn could take the stream past its text limit and :class:`TurnTooLong` when the turn alone is
        longer than ``--max-model-len``; :class:`StreamEnded` when the stream has ended.
        """
        async with self._slot:
            if self._turn is not None:
                await self._turn.done.wait()
            if self.ended:
                raise StreamEnded(self.ended)
            from vllm.engine.protocol import StreamingInput

            transcript = dataclasses.replace(self.transcript)
            prompt = build(transcript)
            if self.turn_tokens is not None and self.max_model_len is not None:
                tokens, video = self.turn_tokens(prompt["prompt"], clip, clip_metadata)
                if self.max_clip_tokens is not None and video > self.max_clip_tokens:
                    raise TurnTooLong(f"{what} makes one clip of {video} video tokens; the engine takes at most "
                                      f"{self.max_clip_tokens} in one clip (its encoder cache): push fewer or "
                                      "smaller frames")
                if tokens > self.max_model_len:
                    raise TurnTooLong(
                        f"{what} is {tokens} tokens on its own, longer than --max-model-len ({self.max_model_len})"
                        + (f": its {len(clip)} frames of {clip.shape[2]}x{clip.shape[1]} pixels make {video} video "
                           "tokens; push fewer or smaller frames" if clip is not None else ""))
            if self.count_text is not None:
                self.text.admit(self.count_text(prompt["prompt"]), params.max_tokens, what)
            self.transcript = transcript
            turn = self._turn = Turn()
            self.last_active = time.monotonic()
            if self._pump is None:
                self._start()
            await self._inputs.put(StreamingInput(prompt=prompt, sampling_params=params))
            return turn

    async def append(self, frames: np.ndarray) -> int:
        """Append ``frames`` (``[T, H, W, 3]`` uint8) and wait until the engine has prefilled them.

        An odd trailing frame waits for the next push (a clip holds whole temporal patches); returns the
        frames this push sent to the engine. A push refused for text room
        (:class:`~cords_vllm.conversation.text_budget.TextRoomExceeded`) leaves the stream as it was. Concurrent
        pushes (and questions) run one at a time, in arrival order.
        """
        async with self._order:
            return await self._append(frames)

    def _whole_patch(self, pending: np.ndarray) -> np.ndarray:
        """Held-back frames completed to one temporal patch by repeating the last (shown before a question, or
        before a push of another size)."""
        short = self.temporal_patch - len(pending)
        return np.concatenate([pending, *[pending[-1:]] * short]) if short > 0 else pending

    def held_frames(self, width: int, height: int) -> int:
        """Frames held back from the last push that would lead a next clip of ``width x height`` frames."""
        pending = self.pending_frames
        return len(pending) if pending is not None and pending.shape[1:3] == (height, width) else 0

    async def _append(self, frames: np.ndarray) -> int:
        received, pending = len(frames), self.pending_frames
        if pending is not None:
            if pending.shape[1:] == frames.shape[1:]:
                frames = np.concatenate([pending, frames])
            else:  # a new frame size: the held-back frame completes its own clip
                await self._append_clip(self._whole_patch(pending))
                pending = None
            self.pending_frames = None
        whole = len(frames) - len(frames) % self.temporal_patch
        if whole < len(frames):
            self.pending_frames = frames[whole:].copy()  # not a view that would keep the whole push alive
        if whole:
            try:
                await self._append_clip(frames[:whole])
            except (TextRoomExceeded, TurnTooLong):
                self.pending_frames = pending  # the push is refused whole: the stream is as it was
                raise
        self.stats.frames += received
        return whole

    async def _append_clip(self, clip: np.ndarray) -> None:
        video = clip_input(clip, self.fps, self.stats.frames_sent)
        turn = await self.run_turn(lambda t: {"prompt": t.clip(), "multi_modal_data": {"video": video}},
                                   self.params(1), "this push", clip, video[1])
        await turn.wait()
        self.stats.clips += 1
        self.stats.frames_sent += len(clip)

    async def ask(self, question: str, *, max_tokens: int, temperature: float = 0.0,
                  seed: int | None = None) -> Turn:
        """Ask ``question`` about everything streamed so far; returns the answering turn (queued after the pushes
        that arrived before it)."""
        async with self._order:
            return await self._ask(question, max_tokens, temperature, seed)

    async def _ask(self, question: str, max_tokens: int, temperature: float, seed: int | None) -> Turn:
        if self.pending_frames is not None:  # a held-back odd frame is shown before the question
            pending, self.pending_frames = self.pending_frames, None
            try:
                await self._append_clip(self._whole_patch(pending))
            except (TextRoomExceeded, TurnTooLong):
                self.pending_frames = pending
                raise
        turn = await self.run_turn(lambda t: {"prompt": t.question(question)},
                                   self.params(max_tokens, temperature, seed), "the question")
        self.stats.questions += 1
        return turn

    async def close(self, reason: str = "closed") -> None:
        """End the stream: the engine frees its KV blocks. A running turn is aborted with it."""
        if self._pump is None:
            self.ended = self.ended or reason
            return
        if not self.ended:
            self.ended = reason
        self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump

    @property
    def busy(self) -> bool:
        """A turn is running or queued."""
        return self._turn is not None or self._slot.locked() or self._order.locked()

    def idle_seconds(self) -> float:
        return 0.0 if self.busy else time.monotonic() - self.last_active


async def published_end_reason(stream_id: str, timeout: float = 4 * PUBLISH_INTERVAL_S) -> str | None:
    """Why the engine ended stream ``stream_id`` with an error, as it published it (``None`` if it has not within
    ``timeout`` seconds: an error the plugin did not raise itself)."""
    deadline = time.monotonic() + timeout
    while (reason := read_published().ended.get(stream_id)) is None and time.monotonic() < deadline:
        await asyncio.sleep(PUBLISH_INTERVAL_S / 5)
    return reason


def _engine_end_reason(finish_reason: str | None, published: str | None = None) -> str:
    if published is not None:
        return f"the engine ended the stream: {published}"
    if finish_reason == "length":
        return "the engine ended the stream: it reached --max-model-len tokens"
    if finish_reason == "error":
        return ("the engine ended the stream with an error; under a KV policy the usual cause is text past "
                "kv_policy_config 'max_text_tokens' (questions and kept answers are never evicted; the server "
                "log says which)")
    return f"the engine ended the stream (finish reason {finish_reason})"
