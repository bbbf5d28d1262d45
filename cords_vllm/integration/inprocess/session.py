"""A streaming-input session on an in-process ``LLMEngine``: push video and questions turn by turn.

vLLM 0.32 keeps a *resumable* request's KV cache between turns: each turn appends its prompt (video clips,
a question) to the request, generates ``max_tokens`` tokens, and waits for the next turn; the last token a
turn sampled is discarded, the others stay in the prompt. ``AsyncLLM.generate`` drives this from an async
generator of ``StreamingInput``; :class:`EngineSession` drives the same engine mechanism synchronously, one
turn at a time, on the in-process engine of :func:`cords_vllm.integration.inprocess.llm.make_llm` (tests and benchmarks,
where :mod:`cords_vllm.integration.inprocess.introspect` can watch the scheduler between turns).

Under a KV policy a session is compressed as its video arrives, at the request's own compression points
(:func:`cords_vllm.compress.plan.next_compression_point`), across turns: while it waits for its next turn
it holds at most its bounded footprint, and a turn that only adds video costs one discarded token.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind


class SessionClosed(RuntimeError):
    """A turn was pushed to a session that was closed or aborted."""


class EngineSession:
    """One resumable request of an in-process ``LLM``, driven turn by turn.

    Parameters
    ----------
    llm:
        An in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    request_id:
        The caller's id; the engine's internal id is :attr:`request_id` after the first turn.
    """

    def __init__(self, llm: Any, request_id: str) -> None:
        self.engine = llm.llm_engine
        self.external_id = request_id
        self.request_id: str | None = None
        self.closed = False
        self.turns = 0

    @staticmethod
    def params(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
        """Greedy sampling for one turn (delta outputs, no stop strings: what resumable requests allow), with the
        top ``logprobs`` log-probabilities of every generated token if asked."""
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                              output_kind=RequestOutputKind.DELTA)

    def _submit(self, prompt: Any, params: SamplingParams, resumable: bool) -> None:
        engine = self.engine
        request = engine.input_processor.process_inputs(
            self.request_id or self.external_id, prompt, params, supported_tasks=engine.get_supported_tasks(),
            resumable=resumable)
        if self.request_id is None:
            engine.input_processor.assign_request_id(request)
            self.request_id = request.request_id
        request.external_req_id = self.external_id
        engine.output_processor.add_request(request, None, None, 0)
        # In process, the engine core would share the token list the output processor extends with every
        # turn (across processes it gets its own copy): give it its own, as serialisation would.
        core_request = copy.copy(request)
        if request.prompt_token_ids is not None:
            core_request.prompt_token_ids = list(request.prompt_token_ids)
        engine.engine_core.add_request(core_request)

    def push(self, prompt: Any, max_tokens: int = 1, logprobs: int | None = None) -> list[int]:
        """Run one turn: append ``prompt`` (a prompt dict, e.g. text with a video) and generate.

        Returns the ``max_tokens`` tokens the turn generated (the last one is discarded from the session's
        context by vLLM, the others are kept); with ``logprobs``, :attr:`logprobs` holds each one's top
        log-probabilities.
        """
        self.start_turn(prompt, max_tokens, logprobs)
        return self.finish_turn()

    def start_turn(self, prompt: Any, max_tokens: int = 1, logprobs: int | None = None) -> None:
        """Submit a turn without running the engine (see :meth:`finish_turn`)."""
        if self.closed:
            raise SessionClosed(f"session {self.external_id} is closed")
        self._submit(prompt, self.params(max_tokens, logprobs), resumable=True)
        self.turns += 1
        self._tokens: list[int] = []
        #: The current turn's ``{token id: log-probability}`` per generated token (empty without ``logprobs``).
        self.logprobs: list[dict[int, float]] = []

    def step(self) -> bool:
        """Run one engine step; True once the current turn has finished."""
        for out in self.engine.step():
            if out.request_id not in (self.request_id, self.external_id):
                continue
            self._tokens.extend(out.outputs[0].token_ids)
            self.logprobs.extend({t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs or ())
            if out.outputs[0].finish_reason == "error":
                # The engine ended the session (its blocks are free); the output processor still waits for
                # the session's next input until it is told otherwise.
                self.abort()
                raise SessionClosed(f"the engine ended session {self.external_id} with an error (the log says why)")
            if out.outputs[0].finish_reason is not None or out.finished:
                return True
        if not self.engine.has_unfinished_requests():
            raise SessionClosed(f"session {self.external_id} ended during a turn (aborted?)")
        return False

    def finish_turn(self) -> list[int]:
        """Run the engine until the current turn has finished; returns its generated tokens."""
        while not self.step():
            pass
        return self._tokens

    def close(self) -> None:
        """End the session: the engine frees its KV blocks."""
        if self.closed or self.request_id is None:
            self.closed = True
            return
        self._submit(TokensPrompt(prompt_token_ids=[0]), self.params(1), resumable=False)
        self.closed = True
        while self.engine.has_unfinished_requests():  # until this session ends (others may stay open)
            if any(out.finished and out.request_id in (self.request_id, self.external_id)
                   for out in self.engine.step()):
                return

    def abort(self) -> None:
        """Abort the session wherever it is (mid-turn included): the engine frees its KV blocks."""
        if self.request_id is not None:
            self.engine.abort_request([self.request_id], internal=True)
        self.closed = True


def run_turns(engine: Any, turns: Sequence[tuple[EngineSession, Any]], max_tokens: int = 1) -> dict[str, list[int]]:
    """Run one turn of several sessions of one engine at once: start ``prompt`` on each ``(session, prompt)``,
    step ``engine`` (``llm.llm_engine``) until every turn ended; returns each turn's tokens by the session's
    external id. (:meth:`EngineSession.step` reads only its own session's outputs.)"""
    by_id: dict[str, EngineSession] = {}
    for session, prompt in turns:
        session.start_turn(prompt, max_tokens=max_tokens)
        by_id[session.request_id] = by_id[session.external_id] = session
    tokens: dict[str, list[int]] = {s.external_id: [] for s, _ in turns}
    waiting = set(tokens)
    while waiting:
        for out in engine.step():
            session = by_id.get(out.request_id)
            if session is None or session.external_id not in waiting:
                continue
            tokens[session.external_id].extend(out.outputs[0].token_ids)
            if out.outputs[0].finish_reason is not None or out.finished:
                waiting.discard(session.external_id)
        if waiting and not engine.has_unfinished_requests():
            raise SessionClosed(f"sessions {sorted(waiting)} ended during a turn")
    return tokens
