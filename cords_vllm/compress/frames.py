"""A request's frames, found from its M-RoPE temporal positions (pure torch).

In the Qwen2-VL family every temporal patch of a video (and every image) has its own M-RoPE temporal
position, so the frames of a request's candidates are the runs of equal temporal positions inside its
candidate spans (:data:`~cords_vllm.model_facts.FRAMES_FROM_MROPE`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RequestFrames:
    """A request's frame structure (host integers + device labels).

    ``labels``: ``long [L]`` on the cache device, the frame label of every logical token; ``largest``:
    tokens of the largest frame; ``first_input``: tokens per frame of the first candidate input.
    """

    labels: torch.Tensor
    largest: int
    first_input: int

    @property
    def num_tokens(self) -> int:
        """Logical tokens the labels cover (a streaming session's grow with every turn)."""
        return self.labels.shape[0]


def frames_from_mrope(mrope_positions: torch.Tensor, spans: Sequence[tuple[int, int]], device: torch.device
                      ) -> RequestFrames:
    """:class:`RequestFrames` of a request from its ``[3, L]`` M-RoPE positions (a host tensor) and its
    candidate ``spans``."""
    temporal = mrope_positions[0].cpu()
    sizes = [torch.unique_consecutive(temporal[start:end], return_counts=True)[1] for start, end in spans]
    labels = temporal.to(device=device, dtype=torch.long, non_blocking=True)
    # a span may begin and end with a one-token marker (vision start / end): a frame is its largest group
    return RequestFrames(labels=labels, largest=max(int(s.max()) for s in sizes), first_input=int(sizes[0].max()))
