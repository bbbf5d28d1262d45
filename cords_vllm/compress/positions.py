"""How far a prompt advances a model's rotary positions (pure: host integers only).

A stream's length limit is its position range: the model's rotary embedding is built for
``max_position_embeddings`` positions, and with M-RoPE (the Qwen-VL families) a clip advances the positions by
far fewer than its tokens: a ``t x h x w`` grid of video tokens takes ``max(t, h, w)`` positions, not
``t * h * w``. :func:`next_position` is vLLM 0.32's rule (``Qwen2VLForConditionalGeneration.
get_mrope_input_positions``: text tokens count on from the previous segment's largest position plus one, a
grid's tokens get ``(t * t_factor, h, w)`` coordinates from there), reduced to the one number the scheduler
needs: the position after a segment. The workers compute the positions themselves with the model's own method
and check that they agree (:class:`~cords_vllm.compress.plan.TurnPositions`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    """One multimodal input of a prompt as the language model's positions see it.

    ``offset``: its first placeholder token in the segment; ``t``, ``h``, ``w``: its grid in language-model
    tokens (after the spatial merge, ``t * h * w`` placeholder tokens); ``t_factor``: positions per temporal
    step (``second_per_grid_t * tokens_per_second`` for Qwen2.5-VL, 1 for Qwen2-VL and images).
    """

    offset: int
    t: int
    h: int
    w: int
    t_factor: float = 1.0

    @property
    def num_tokens(self) -> int:
        return self.t * self.h * self.w

    @property
    def extent(self) -> int:
        """Positions the grid takes: its largest coordinate plus one."""
        return max(int((self.t - 1) * self.t_factor), self.h - 1, self.w - 1) + 1


def next_position(num_tokens: int, grids: Iterable[Grid], start: int = 0) -> int:
    """The first position after a segment of ``num_tokens`` tokens whose first token takes position ``start``.

    ``grids`` are the segment's multimodal inputs (offsets relative to the segment); every other token is text
    and advances the position by one.
    """
    position, offset = start, 0
    for grid in sorted(grids, key=lambda g: g.offset):
        if grid.offset < offset or grid.offset + grid.num_tokens > num_tokens:
            raise ValueError(f"input at {grid.offset} ({grid.num_tokens} tokens) overlaps the segment's other "
                             f"inputs or ends past its {num_tokens} tokens")
        position += grid.offset - offset + grid.extent
        offset = grid.offset + grid.num_tokens
    return position + num_tokens - offset
