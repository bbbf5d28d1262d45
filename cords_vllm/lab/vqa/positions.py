"""Qwen2-VL M-RoPE position ids computed the way vLLM computes them.

vLLM's ``Qwen2VLForConditionalGeneration.get_mrope_input_positions`` gives text tokens the same position on
all three axes (temporal, height, width), counting on from the previous segment's maximum plus one, and
gives video tokens ``(t, h, w)`` grid coordinates offset by the position of the first video token. For a
prompt ``text | video | text`` (one video, Qwen2-VL's time factor 1) that is what :func:`mrope_positions`
returns; training HF with these ids makes the HF model and the vLLM engine see the same positions.
"""

from __future__ import annotations

import numpy as np
import torch


def mrope_positions(num_before: int, grid: tuple[int, int, int], num_after: int,
                    t_factor: float = 1.0) -> torch.Tensor:
    """Position ids of ``num_before`` text tokens, one video, then ``num_after`` text tokens.

    ``t_factor``: temporal positions per temporal patch (Qwen2.5-VL: ``second_per_grid_t * tokens_per_second``,
    truncated to integers as vLLM does; 1 for Qwen2-VL).

    Parameters
    ----------
    num_before:
        Text tokens before the first video token.
    grid:
        ``(t, h, w)`` of the video in language-model tokens (after the spatial merge), ``t * h * w`` tokens.
    num_after:
        Text tokens after the last video token.

    Returns
    -------
    torch.LongTensor ``[3, num_before + t * h * w + num_after]`` (rows: temporal, height, width).
    """
    t, h, w = grid
    if min(num_before, num_after) < 0 or min(t, h, w) <= 0:
        raise ValueError(f"invalid segment sizes: before={num_before}, grid={grid}, after={num_after}")
    before = np.broadcast_to(np.arange(num_before), (3, num_before))
    indices = np.indices((t, h, w))
    if t_factor != 1.0:
        indices[0] = (indices[0] * t_factor).astype(np.int64)
    video = indices.reshape(3, -1) + num_before
    after = np.broadcast_to(np.arange(num_after), (3, num_after)) + video.max() + 1
    return torch.from_numpy(np.concatenate([before, video, after], axis=1).astype(np.int64))
