"""Accuracy of KV policies on live streams: video pushed into engine sessions, questions asked mid-stream.

Each held-out question (:mod:`cords_vllm.lab.vqa`) becomes a stream (:class:`StreamPlan`): its video is pushed
into one resumable request (:class:`~cords_vllm.integration.inprocess.session.EngineSession`) in clips of
``push_frames`` frames, and the question is asked right after the push holding the needle's last frame plus
``delay_pushes``
further pushes, so it is about an earlier event (OVO-Bench's backward tracing). Where the video ends before
that, the stream goes on with the example's own background played backwards, its needles blanked, so no
frame after the video shows a needle again. Questions without a localised needle (``static``: the dot is in
every frame; ``count`` with no flash) are asked after the whole video plus ``delay_pushes`` pushes. The
stream ends with the answer.

The stream's text is the one-shot prompt's (:data:`~cords_vllm.lab.vqa.prompt.PROMPT_TEMPLATE`) with one
``<|vision_start|><|video_pad|><|vision_end|>`` clip per push instead of one for the whole video: the model
sees each push as a separate video, with its own vision markers and M-RoPE positions (each clip's
temporal, height and width positions restart after the previous clip's largest one).

Many streams run on one engine at a time (:func:`run_streams`): every live stream starts its next turn,
then the engine steps until all of those turns ended; a stream that answered is aborted (its blocks return
to the pool) and the next one starts in its place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cords_vllm.lab.bench.accuracy import AccuracyRun, EngineShape, blank_needles, budget_cells, cell_llm, engine_args
from cords_vllm.lab.bench.workload import PolicySpec
from cords_vllm.lab.vqa import PROMPT_TEMPLATE, VQAExample, accuracy_report
from cords_vllm.lab.vqa.prompt import VIDEO_PLACEHOLDER
from cords_vllm.utils import cdiv

#: The one-shot prompt's text before the video (system prompt, user turn) and after the question.
OPENING = PROMPT_TEMPLATE.split(VIDEO_PLACEHOLDER)[0]
ANSWER_CUE = PROMPT_TEMPLATE.split("{question}")[1]


@dataclass(frozen=True)
class StreamPlan:
    """One example as a stream: its pushes and the question asked after the last of them.

    Attributes
    ----------
    example:
        The held-out question (answer, needles, the video as a one-shot request sees it).
    clips:
        ``uint8 [push_frames, S, S, 3]`` per push, in order; the question follows the last one.
    needle_push:
        Index into ``clips`` of the push holding the needle's last frame (for questions without a localised
        needle: the push holding the video's last frame).
    """

    example: VQAExample
    clips: tuple[np.ndarray, ...] = field(repr=False)
    needle_push: int

    @property
    def question_text(self) -> str:
        """The question turn: the question, the end of the user turn and the assistant cue."""
        return self.example.question + ANSWER_CUE

    def turns(self) -> list[dict[str, Any]]:
        """The stream's turns as prompt dicts: one per push (the first opens the conversation), the question."""
        pushes = [{"prompt": (OPENING if i == 0 else "") + VIDEO_PLACEHOLDER,
                   "multi_modal_data": {"video": np.array(clip)}} for i, clip in enumerate(self.clips)]
        return [*pushes, {"prompt": self.question_text}]

    def one_shot_request(self) -> dict[str, Any]:
        """The whole stream up to the answer as one request (every push a video of its own)."""
        text = OPENING + VIDEO_PLACEHOLDER * len(self.clips) + self.question_text
        return {"prompt": text, "multi_modal_data": {"video": [np.array(c) for c in self.clips]}}


def _needle_end_frame(example: VQAExample) -> int:
    """Last frame of the example's localised needles, else (no needle, or one in every frame) its last frame."""
    frames = example.needle_frames
    if not frames or len(frames) == len(example.frames):
        return len(example.frames) - 1
    return frames[-1]


def continuation(example: VQAExample, num_frames: int) -> np.ndarray:
    """``uint8 [num_frames, S, S, 3]`` frames that continue the example's video after its end: the video with
    its localised needles blanked, played backwards then forwards (ping-pong) from its last frame. A needle in
    every frame (``static``'s dot) is part of the scene and stays."""
    frames = example.frames
    if example.needles and len(example.needle_frames) < len(frames):
        frames = blank_needles(example).frames
    period = np.arange(num_frames) % (2 * len(frames))
    index = np.where(period < len(frames), len(frames) - 1 - period, period - len(frames))
    return np.array(frames[index])


def plan_stream(example: VQAExample, push_frames: int, delay_pushes: int) -> StreamPlan:
    """Split ``example``'s video into pushes of ``push_frames`` frames (even) and place its question
    ``delay_pushes`` pushes after the push holding the needle's last frame."""
    if push_frames <= 0 or push_frames % 2:
        raise ValueError(f"push_frames must be a positive even number, got {push_frames}")
    if delay_pushes < 0:
        raise ValueError(f"delay_pushes must be >= 0, got {delay_pushes}")
    needle_push = _needle_end_frame(example) // push_frames
    pushes = needle_push + 1 + delay_pushes
    extra = max(0, pushes * push_frames - len(example.frames))
    video = np.concatenate([example.frames, continuation(example, extra)]) if extra else example.frames
    clips = tuple(video[i * push_frames:(i + 1) * push_frames] for i in range(pushes))
    return StreamPlan(example=example, clips=clips, needle_push=needle_push)


def stream_tokens(plan: StreamPlan) -> int:
    """Upper bound on the stream's prompt tokens: its clips' video tokens and markers, and the text."""
    geometry = plan.example.geometry
    per_clip = len(plan.clips[0]) // 2 * geometry.tokens_per_patch + 2
    return len(plan.clips) * per_clip + 64


@dataclass
class StreamResult:
    """One stream's outcome: the answer text, and the video tokens (vision markers included) it held when answering
    and had been pushed by then."""

    answer: str
    held_candidate_tokens: int
    video_tokens: int


@dataclass
class _Live:
    """A stream being pushed: its index among the plans, its session, its turns and the index of the next one."""

    index: int
    session: Any
    turns: list[dict[str, Any]]
    next_turn: int = 0


def run_streams(llm: Any, plans: Sequence[StreamPlan], batch: int) -> list[StreamResult]:
    """Push ``plans`` through ``llm`` (an in-process ``LLM``), ``batch`` streams at a time, in rounds: every live
    stream runs its next turn, then streams that answered are aborted and replaced by the next plans."""
    from cords_vllm.integration.inprocess.introspect import requests_of, scheduler_of
    from cords_vllm.integration.inprocess.session import EngineSession, run_turns

    engine, scheduler, tokenizer = llm.llm_engine, scheduler_of(llm), llm.get_tokenizer()
    results: dict[int, StreamResult] = {}
    queue = list(enumerate(plans))
    live: list[_Live] = []
    while queue or live:
        while queue and len(live) < batch:
            i, plan = queue.pop(0)
            live.append(_Live(i, EngineSession(llm, f"stream-{i}"), plan.turns()))
        tokens = run_turns(engine, [(s.session, s.turns[s.next_turn]) for s in live])
        for stream in live:
            stream.next_turn += 1
        held = requests_of(scheduler)
        for stream in [s for s in live if s.next_turn == len(s.turns)]:
            state = held[stream.session.request_id]
            results[stream.index] = StreamResult(tokenizer.decode(tokens[stream.session.external_id]),
                                                 state.held_candidate_tokens, state.sent_candidate_tokens)
            stream.session.abort()
            live.remove(stream)
    return [results[i] for i in range(len(plans))]


def stream_engine_args(checkpoint: str | Path, plans: Sequence[StreamPlan], shape: EngineShape) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for ``plans``: :func:`~cords_vllm.lab.bench.accuracy.engine_args` with room for
    the longest stream and one video per push."""
    kwargs = engine_args(checkpoint, [p.example for p in plans], shape)
    longest = max(stream_tokens(p) for p in plans)
    kwargs.update(max_model_len=cdiv(longest, 256) * 256, max_num_batched_tokens=shape.batch * longest,
                  limit_mm_per_prompt={"image": 0, "video": max(len(p.clips) for p in plans)})
    return kwargs


def run_stream_policy(checkpoint: str | Path, plans: Sequence[StreamPlan], spec: PolicySpec | str,
                      budget: int | None, shape: EngineShape) -> list[StreamResult]:
    """Every stream of ``plans`` under ``spec`` at ``budget`` (slack 0, as the one-shot cells), on a fresh engine."""
    from cords_vllm.integration.inprocess.heap import settle

    llm = cell_llm(stream_engine_args(checkpoint, plans, shape), spec, budget)
    try:
        return run_streams(llm, plans, shape.batch)
    finally:
        del llm
        settle()


def evaluate_streams(checkpoint: str | Path, plans: Sequence[StreamPlan], policies: Sequence[PolicySpec | str],
                     fractions: Sequence[float], shape: EngineShape,
                     on_cell: Callable[[AccuracyRun], None] | None = None) -> list[AccuracyRun]:
    """Full KV once, then every (policy, fraction) cell; budgets are fractions of the example video's tokens.

    Each run's ``effective_video_tokens`` is the mean of the video tokens (markers included) a stream held
    when it answered.
    """
    examples = [p.example for p in plans]
    runs = []
    for spec, fraction, budget in budget_cells(policies, fractions, examples[0].geometry.num_video_tokens,
                                               shape.block_size):
        t0 = time.perf_counter()
        results = run_stream_policy(checkpoint, plans, spec, budget, shape)
        answers = [r.answer for r in results]
        run = AccuracyRun(spec.label, spec.policy, spec.config, fraction, budget, accuracy_report(examples, answers),
                          float(np.mean([r.held_candidate_tokens for r in results])), time.perf_counter() - t0,
                          predictions=answers)
        runs.append(run)
        if on_cell:
            on_cell(run)
    return runs
