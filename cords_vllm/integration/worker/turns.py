"""Streaming sessions on the worker: each new turn's positions, and the tokens re-basing removed before it.

A streaming session's next turn reaches the worker as vLLM's ``_update_streaming_request`` (the whole request
again), with the scheduler's :class:`~cords_vllm.compress.plan.RebasePlan`, received a step ahead
(:meth:`SessionTurns.receive`). On an M-RoPE model the worker keeps the positions of the tokens that remain,
computes only the new turn's with the model's own rule from the session's next position (checked against the
scheduler's count), and drops the holes of its row (:meth:`SessionTurns.mrope_positions`). On a 1-D rotary model
the turn's positions are the request's indices shifted by the tokens removed so far (:meth:`SessionTurns.rebase`,
:meth:`SessionTurns.position_offsets`, :mod:`cords_vllm.integration.worker.positions`).

The turns share the compressor's per-request trackers (:class:`~cords_vllm.integration.worker.tracker.WorkerRequest`),
which count the tokens removed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cords_vllm.compress.plan import RebasePlan
from cords_vllm.integration.handoff.plans import plans_of
from cords_vllm.integration.worker.tracker import WorkerPlanError, WorkerRequest


class SessionTurns:
    """The re-base plans of sessions whose next turn has not reached the worker yet, and what each turn needs.

    ``requests``: the compressor's trackers by request id (shared, read and updated here); ``block_size``: the
    KV cache's.
    """

    def __init__(self, requests: dict[str, WorkerRequest], block_size: int) -> None:
        self.requests = requests
        self.block_size = block_size
        self.pending: dict[str, RebasePlan] = {}

    def waiting(self, req_id: str) -> bool:
        """Whether a re-base plan waits for this request's next turn."""
        return req_id in self.pending

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def removed_tokens(self, req_id: str) -> int:
        """Tokens re-basing removed from the request so far (0 for a request never compressed)."""
        tracker = self.requests.get(req_id)
        return tracker.removed_tokens if tracker is not None else 0

    def receive(self, scheduler_output: Any) -> None:
        """Keep this step's :class:`~cords_vllm.compress.plan.RebasePlan` until the session's turn arrives."""
        for plan in plans_of(scheduler_output):
            if isinstance(plan, RebasePlan):
                self.pending[plan.req_id] = plan

    def mrope_positions(self, runner: Any, req_state: Any) -> bool:
        """Set a session's M-RoPE positions for its new turn if the scheduler sent a plan for it (``False``: not
        a session turn, vLLM computes them).

        vLLM has already replaced the request's prompt, multimodal inputs, row and counts with the scheduler's
        (re-based) ones; ``req_state.mrope_positions`` still holds the previous turn's positions, ``[3, P]``.
        The remaining tokens keep theirs (held slots, whose keys are already rotated, keep what stood there:
        nothing reads them again); the turn's tokens get the model's own positions for the turn alone,
        moved to start at the session's next position.
        """
        plan = self.pending.get(req_state.req_id)
        old = getattr(req_state, "mrope_positions", None)
        if plan is None or old is None:
            return False
        del self.pending[req_state.req_id]
        held, removed = plan.held_tokens, plan.removed_tokens
        start = old.shape[1] - removed  # the turn's first token (the previous turn's kept answer tokens first)
        next_start = old.shape[1] + req_state.mrope_position_delta
        turn_features = [dataclasses.replace(f, mm_position=dataclasses.replace(
            f.mm_position, offset=f.mm_position.offset - start))
            for f in req_state.mm_features if f.mm_position.offset >= start and f.modality != "prompt_embeds"]
        turn, _ = runner.get_model().get_mrope_input_positions(req_state.prompt_token_ids[start:], turn_features)
        positions = torch.cat([old[:, :held], old[:, held + removed:], turn + next_start], dim=1)
        next_position = int(turn.max()) + 1 + next_start if turn.shape[1] else next_start
        if next_position != plan.next_position or positions.shape[1] != len(req_state.prompt_token_ids):
            raise WorkerPlanError(
                f"session {req_state.req_id}: the worker counts next position {next_position} over "
                f"{positions.shape[1]} tokens, the scheduler {plan.next_position} over "
                f"{len(req_state.prompt_token_ids)}")
        req_state.mrope_positions = positions
        req_state.mrope_position_delta = next_position - positions.shape[1]
        self.drop_holes(req_state.req_id, plan)
        return True

    def drop_holes(self, req_id: str, plan: RebasePlan) -> WorkerRequest | None:
        """The session's row lost its null entries (vLLM replaced it with the scheduler's): so does its tracker,
        which counts the tokens removed. Returns the tracker (``None``: never compressed)."""
        tracker = self.requests.get(req_id)
        held, removed = plan.held_tokens, plan.removed_tokens
        if removed:
            if tracker is None or tracker.holes[1] * self.block_size != held + removed:
                raise WorkerPlanError(f"session {req_id}: the worker's region ends at block "
                                      f"{tracker.holes[1] if tracker else 0}, the scheduler removes tokens "
                                      f"[{held}, {held + removed})")
            tracker.holes = (tracker.holes[0], tracker.holes[0])
            tracker.removed_tokens += removed
        return tracker

    def rebase(self, req_state: Any) -> None:
        """A 1-D session's turn arrived (``_update_states`` gave it the scheduler's re-based prompt and row): drop
        the holes, and from now on shift its positions by every token removed so far (:meth:`position_offsets`),
        checking that its next position then agrees with the scheduler's count."""
        plan = self.pending.pop(req_state.req_id)
        tracker = self.drop_holes(req_state.req_id, plan)
        removed = tracker.removed_tokens if tracker is not None else 0
        if len(req_state.prompt_token_ids) + removed != plan.next_position:
            raise WorkerPlanError(
                f"session {req_state.req_id}: the worker counts next position {len(req_state.prompt_token_ids)} + "
                f"{removed} removed, the scheduler {plan.next_position}")

    def position_offsets(self, input_batch: Any) -> list[tuple[int, int]]:
        """``(batch row, tokens removed)`` of every re-based request of the persistent batch: what its positions
        lack on a 1-D rotary model (:mod:`cords_vllm.integration.worker.positions`). Host data only."""
        index = input_batch.req_id_to_index
        return [(row, tracker.removed_tokens) for req_id, tracker in self.requests.items()
                if tracker.removed_tokens and (row := index.get(req_id)) is not None]
