"""A segment's next rotary position: the scheduler's count equals vLLM's own M-RoPE rule for the Qwen-VL family."""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cords_vllm.compress.positions import Grid, next_position

#: The checks against vLLM's own rule and the engine glue need vLLM; the pure core's run without it (a GPU host
#: with torch alone runs this directory).
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


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


@needs_vllm
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


@needs_vllm
def test_1d_positions_advance_by_every_token_and_m_rope_by_extent():
    """The scheduler's count for a 1-D rotary model (LLaVA-NeXT-Video) is one position per token, video tokens
    included; the same segment with M-RoPE facts advances by the grid's extent instead (control)."""
    from cords_vllm.integration.engine_core.requests import positions_after
    from cords_vllm.model_facts import FRAMES_FROM_LAYOUT, FRAMES_FROM_MROPE, ModelFacts

    one_d = ModelFacts(model_type="llava_next_video", frames_from=FRAMES_FROM_LAYOUT, tokens_per_frame=25)
    assert positions_after(110, [object()], one_d, start=40, start_position=1000) == 1110
    mrope = ModelFacts(model_type="qwen2_vl", frames_from=FRAMES_FROM_MROPE, spatial_merge_size=2)
    grid = SimpleNamespace(modality="video", mm_position=SimpleNamespace(offset=45, length=64, is_embed=None),
                           data={"video_grid_thw": SimpleNamespace(data=torch.tensor([1, 16, 16]))})
    assert positions_after(110, [grid], mrope, start=40, start_position=1000) == 1000 + 5 + 8 + 41


@needs_vllm
def test_the_position_offset_shifts_only_re_based_requests_tokens():
    """``shift_positions`` adds each request's removed tokens to its own tokens of the step (rows by
    ``query_start_loc``), leaves other requests and empty rows alone, and does nothing without offsets."""
    from cords_vllm.integration.worker.positions import shift_positions

    positions = torch.tensor([0, 1, 2, 7, 8, 3, 4, 5, 6])  # three requests: 3, 2 and 4 tokens
    starts = np.array([0, 3, 5, 9, 9], dtype=np.int32)  # a fourth row with no tokens this step
    assert shift_positions(positions, starts, [(0, 0), (2, 100), (3, 50)]) == 1
    assert positions.tolist() == [0, 1, 2, 7, 8, 103, 104, 105, 106]
    assert shift_positions(positions, starts, []) == 0 and positions[:5].tolist() == [0, 1, 2, 7, 8]
