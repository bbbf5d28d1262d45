"""Compression points belong to the request: the same kept tokens and outputs whatever the batch and chunking."""

from __future__ import annotations

import pytest
import torch

from cords_vllm.compress.plan import BudgetSettings, compressed_footprint_blocks
from tests.engine.conftest import BLOCK, VIDEO_PROMPT, evictions_of, run_engine, video

pytestmark = pytest.mark.engine

BUDGET, SLACK = 192, 64
FRAMES = 32


def _prompt(seed: int) -> dict:
    return {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(FRAMES, seed=seed)}}


def _kept(run, prefix: str = "0") -> dict[int, list[torch.Tensor]]:
    return evictions_of([e for e in run.events if e.req_id.split("-")[0] == prefix])


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True)) for k in a)


@pytest.fixture(scope="module")
def alone(tiny_model):
    return run_engine(tiny_model, [_prompt(1)], "cords", max_tokens=4, budget=BUDGET, slack=SLACK)


@pytest.mark.parametrize("engine", [
    pytest.param({"max_num_scheduled_tokens": 160, "long_prefill_token_threshold": 64}, id="small-chunks"),
    pytest.param({"max_num_scheduled_tokens": 4096}, id="whole-prompt-steps"),
    pytest.param({"max_num_scheduled_tokens": 8192, "max_num_batched_tokens": 8192, "enable_chunked_prefill": False},
                 id="chunked-prefill-off"),
])
def test_chunk_settings_do_not_change_what_is_kept(tiny_model, alone, engine):
    other = run_engine(tiny_model, [_prompt(1)], "cords", max_tokens=4, engine_kwargs=engine, budget=BUDGET,
                       slack=SLACK)
    assert len(_kept(alone)) >= 3
    assert _same(_kept(other), _kept(alone))
    assert other.token_ids == alone.token_ids


def test_a_batch_of_eight_does_not_change_what_is_kept(tiny_model, alone):
    batch = run_engine(tiny_model, [_prompt(1)] + [_prompt(seed) for seed in range(20, 27)], "cords",
                       max_tokens=4, budget=BUDGET, slack=SLACK)
    assert _same(_kept(batch), _kept(alone))
    assert batch.token_ids[0] == alone.token_ids[0]
    assert batch.free_blocks_after == batch.free_blocks_before


def test_a_lone_request_never_holds_more_than_its_footprint(alone):
    prompt_len, video_tokens = alone.prompt_lens[0], FRAMES * 32
    footprint = compressed_footprint_blocks(prompt_len + 4, video_tokens, BudgetSettings(BUDGET, BUDGET // 4, SLACK),
                                            BLOCK)
    assert max(alone.max_blocks_held.values()) <= footprint < -(-(prompt_len + 4) // BLOCK)
