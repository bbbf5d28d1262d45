"""Ending a request the engine cannot serve, with a reason, before a step can schedule it (engine core).

A streaming session grows with every turn, and vLLM 0.32 checks a request's length only when it first arrives:
a session whose next turn takes it to ``--max-model-len`` tokens is scheduled anyway and the worker fails
copying it into its persistent batch (arrays sized by ``--max-model-len``), which ends the engine and every
request in it. :class:`RequestEnder` runs at the start of every ``Scheduler.schedule`` under every policy
(``none`` included) and ends such a request alone:

* it takes the request out of the waiting queues, so this step cannot schedule it;
* it hands the request to vLLM's own error channel (:func:`end_with_error`), which ends it with
  ``FINISHED_ERROR`` and tells its client when the step's output is processed, freeing its blocks;
* it publishes the reason under the request's external id
  (:meth:`~cords_vllm.integration.handoff.published.Publisher.end`), so the stream API answers ``410`` naming it.

Under a policy the compressor adds its own reasons (text past ``max_text_tokens``, invalid overrides).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cords_vllm.integration.engine_core.requests import external_request_id
from cords_vllm.integration.handoff.published import Publisher

logger = logging.getLogger(__name__)

#: ``reason(request) -> why it cannot be served, or None``.
ReasonCheck = Callable[[Any], str | None]


def end_with_error(scheduler: Any, req_id: str) -> None:
    """End a request with ``FINISHED_ERROR`` through vLLM's own error channel.

    vLLM 0.32's scheduler has no call that fails a request and reports it to its client; the requests it ends
    that way are the ids it collects in a few sets that ``update_from_output`` drains into ``FINISHED_ERROR``
    outputs. The plugin adds to the encoder-cache-mismatch set, which means exactly "end this request with an
    error"; the patch table checks that ``update_from_output`` still drains it.
    """
    scheduler.encoder_cache_mismatch_reqs.add(req_id)


def length_reason(request: Any, max_model_len: int) -> str | None:
    """Why a streaming session cannot run its next turn within ``max_model_len`` tokens (``None`` if it can, or
    if ``request`` is not a session: vLLM checked its length when it arrived).

    A turn must leave room for at least one generated token.
    """
    if not getattr(request, "resumable", False) or request.num_tokens < max_model_len:
        return None
    return (f"its next turn takes it to {request.num_tokens} tokens, and --max-model-len is {max_model_len} (a "
            "stream's length is what it holds plus the turn under a KV policy; every token it pushed without one)")


class RequestEnder:
    """The waiting requests one scheduler ends, and why."""

    def __init__(self, publisher: Publisher, max_model_len: int) -> None:
        self.publisher = publisher
        self.max_model_len = max_model_len
        #: Requests handed to the error channel, until they leave the scheduler (the reason is published).
        self.ending: set[str] = set()

    def end_unservable(self, scheduler: Any, check: ReasonCheck | None = None) -> None:
        """End every waiting request (new ones, and sessions whose next turn arrived) that is past
        ``--max-model-len`` or that ``check`` refuses."""
        self.ending.intersection_update(scheduler.requests)
        waiting = [*scheduler.waiting, *scheduler.kv_holding_waiting]
        if stale := [r for r in waiting if r.request_id in self.ending]:  # a preempted one the step put back
            scheduler.waiting.remove_requests(stale)
            scheduler.kv_holding_waiting.remove_requests(stale)
        for request in waiting:
            if request.request_id in self.ending:
                continue
            try:
                reason = length_reason(request, self.max_model_len) or (check(request) if check else None)
            except Exception as exc:  # the policy's check broke on this request: it alone ends, with the reason
                logger.exception("cords-vllm: checking request %s failed", request.request_id)
                reason = f"the KV policy could not check it ({type(exc).__name__}: {exc})"
            if reason is not None:
                self.end(scheduler, request, reason)

    def end(self, scheduler: Any, request: Any, reason: str) -> None:
        """End ``request`` (waiting) with an error: out of the queues now, ended with the step's output."""
        self.ending.add(request.request_id)
        scheduler.waiting.remove_requests((request,))
        scheduler.kv_holding_waiting.remove_requests((request,))
        end_with_error(scheduler, request.request_id)
        self.publisher.end(external_request_id(request.request_id), reason)
        logger.warning("cords-vllm: request %s is ended with an error: %s", request.request_id, reason)
