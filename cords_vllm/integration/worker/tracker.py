"""One tracker per compressed request on the worker side (worker processes)."""

from __future__ import annotations

from dataclasses import dataclass

from cords_vllm.compress.step import HeldTokens


class WorkerPlanError(RuntimeError):
    """The worker's view of a request disagrees with the scheduler's plan (a bug, never expected)."""


@dataclass
class WorkerRequest:
    """What a worker holds for one request it has compressed (created at its first plan).

    Attributes
    ----------
    held:
        Per layer, the :class:`~cords_vllm.compress.step.HeldTokens` its compacted region holds (ids, which are
        candidates, frame labels), on the cache's device; ``None`` before the first compression.
    holes:
        ``(k, j)``: kept blocks and region blocks of its row (host integers, for the attention view).
    removed_tokens:
        Tokens re-basing removed from the request so far: a token's id in the stream is its index plus this.
    largest_frame, first_frame:
        Tokens of the largest frame seen, and per frame of its first input (``0``: not read yet).
    """

    held: list[HeldTokens | None]
    holes: tuple[int, int] = (0, 0)
    removed_tokens: int = 0
    largest_frame: int = 0
    first_frame: int = 0
    compressions: int = 0
    selection_seconds: float = 0.0

    @property
    def compressed(self) -> bool:
        return self.compressions > 0
