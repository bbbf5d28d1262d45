"""A request's frames, found from its M-RoPE temporal positions or its placeholders' layout (pure torch).

In the Qwen2-VL family every temporal patch of a video (and every image) has its own M-RoPE temporal
position, so the frames of a request's candidates are the runs of equal temporal positions inside its
candidate spans (:data:`~cords_vllm.model_facts.FRAMES_FROM_MROPE`), and a token's frame label is its temporal
position. A family with 1-D positions whose input is laid out frame after frame, a fixed count of contiguous
tokens each (LLaVA-NeXT-Video, :data:`~cords_vllm.model_facts.FRAMES_FROM_LAYOUT`), gets labels from that
layout (:func:`layout_labels`). Either way labels never decrease along a request, and a frame is a run of equal
labels. A compression reads the labels of the tokens entering its region only (a held token keeps the label
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


def layout_labels(begin: int, end: int, inputs: Sequence[tuple[int, int]], tokens_per_frame: int) -> torch.Tensor:
    """Frame labels of tokens ``[begin, end)`` of a request whose inputs are laid out frame after frame.

    ``inputs``: each multimodal input's ``(offset, length)`` in the request (its placeholder range), every frame
    ``tokens_per_frame`` contiguous tokens with nothing between frames. Token ``i`` of the input at ``offset``
    gets ``offset + (i - offset) // tokens_per_frame``; a token outside every input gets ``i``. Labels so never
    decrease along the request (an input's labels stay below its end, where the next token starts), each
    frame is one run of equal labels, and no two frames of a request share a label.

    Returns ``long [end - begin]`` (host).
    """
    if tokens_per_frame <= 0:
        raise ValueError(f"tokens_per_frame must be positive, got {tokens_per_frame}")
    labels = torch.arange(begin, max(begin, end), dtype=torch.long)
    for offset, length in inputs:
        lo, hi = max(offset, begin), min(offset + length, end)
        if lo < hi:
            labels[lo - begin: hi - begin] = offset + torch.div(labels[lo - begin: hi - begin] - offset,
                                                                tokens_per_frame, rounding_mode="floor")
    return labels


def label_runs(labels: torch.Tensor, video: torch.Tensor) -> int:
    """Runs of equal labels among the video tokens of ``labels`` (``long [N]``, host; ``video``: ``bool [N]``): the
    video tokens whose label differs from the token before, or whose token before is not video (or is none). An
    upper bound on the frames among any subsequence of those tokens' video tokens (what a frame compression's host
    sizes it by, :attr:`~cords_vllm.compress.step.RegionBatch.new_label_runs`); text tokens, each at its own
    temporal position, add none."""
    if labels.shape[0] == 0:
        return 0
    starts = video.clone()
    starts[1:] &= (labels[1:] != labels[:-1]) | ~video[:-1]
    return int(torch.count_nonzero(starts))
