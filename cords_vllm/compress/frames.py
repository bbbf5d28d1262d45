"""A request's frames, found from its M-RoPE temporal positions (pure torch).

In the Qwen2-VL family every temporal patch of a video (and every image) has its own M-RoPE temporal
position, so the frames of a request's candidates are the runs of equal temporal positions inside its
candidate spans (:data:`~cords_vllm.model_facts.FRAMES_FROM_MROPE`), and a token's frame label is its temporal
position. A compression reads the labels of the tokens entering its region only (a held token keeps the label
it had, see :class:`~cords_vllm.compress.step.HeldTokens`), so what it reads never grows with the stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def frame_sizes(temporal: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[int]:
    """Tokens of the largest frame of each candidate span.

    ``temporal``: ``long [L]`` (host), the temporal M-RoPE position of each token of the request; ``spans``:
    ``[start, end)`` ranges within it. A span may begin and end with a one-token marker (vision start / end),
    so a frame is its largest run of equal positions.
    """
    return [int(torch.unique_consecutive(temporal[start:end], return_counts=True)[1].max())
            for start, end in spans if end > start]
