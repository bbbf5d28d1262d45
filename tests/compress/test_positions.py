"""A segment's next rotary position: the scheduler's count equals vLLM's own M-RoPE rule for the Qwen-VL family."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from cords_vllm.compress.positions import Grid, next_position


def _vllm_positions(num_tokens: int, grids: list[Grid], merge: int = 2) -> torch.Tensor:
    """vLLM 0.32's ``Qwen2VLForConditionalGeneration.get_mrope_input_positions`` on the segment (the real method,
    with a stand-in for the model object: it reads only ``config`` and the features' grids)."""
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration as Model

    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge,
                                                                                 tokens_per_second=1.0)))
    model.iter_mm_grid_thw = lambda features: Model.iter_mm_grid_thw(model, features)
    features = [SimpleNamespace(
        modality="video", mm_position=SimpleNamespace(offset=g.offset, length=g.num_tokens),
        data={"video_grid_thw": SimpleNamespace(data=torch.tensor([g.t, g.h * merge, g.w * merge])),
              "second_per_grid_ts": SimpleNamespace(data=torch.tensor(g.t_factor))})
        for g in grids]
    positions, _ = Model.get_mrope_input_positions(model, list(range(num_tokens)), features)
    return positions


@pytest.mark.parametrize("seed", range(40))
def test_next_position_is_vllms_rule(seed):
    rng = random.Random(seed)
    grids, offset = [], rng.randrange(0, 12)
    for _ in range(rng.randrange(0, 4)):
        grid = Grid(offset, rng.randrange(1, 6), rng.randrange(1, 9), rng.randrange(1, 9),
                    rng.choice([1.0, 1.0, 2.0, 0.5]))
        grids.append(grid)
        offset += grid.num_tokens + rng.randrange(0, 6)
    num_tokens = offset + rng.randrange(0, 6)
    if num_tokens == 0:
        return
    start = rng.randrange(0, 1000)
    assert next_position(num_tokens, grids, start) == int(_vllm_positions(num_tokens, grids).max()) + 1 + start


def test_a_clip_takes_its_largest_side_not_its_tokens():
    clip = Grid(1, 4, 16, 16)  # 8 frames of 448 x 448 after the merge: 1,024 tokens
    assert next_position(clip.num_tokens + 2, [clip]) == 18  # its 16 positions and the two vision markers
    with pytest.raises(ValueError, match="overlaps"):
        next_position(10, [Grid(0, 1, 2, 2), Grid(3, 1, 2, 2)])
