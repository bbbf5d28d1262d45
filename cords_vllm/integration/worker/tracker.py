"""One tracker per compressed request on the worker side (worker processes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cords_vllm.compress.frames import RequestFrames


@dataclass
class WorkerRequest:
    """What a worker holds for one request it has compressed (created at its first plan).

    Attributes
    ----------
    ids:
        Per layer, ``long [H, n]`` on the cache's device: the logical ids its compacted region holds per KV head
        (to know which held tokens are candidates at the next compression); ``None`` before the first one.
    holes:
        ``(k, j)``: kept blocks and region blocks of its row (host integers, for the attention view).
    frames:
        Its frame structure, read from its M-RoPE positions when a plan needs it (re-read when its prompt grew).
    """

    ids: list[torch.Tensor | None]
    holes: tuple[int, int] = (0, 0)
    frames: RequestFrames | None = None
    compressions: int = 0
    selection_seconds: float = 0.0

    @property
    def compressed(self) -> bool:
        return self.compressions > 0
