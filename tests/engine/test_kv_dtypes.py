"""The KV dtypes a policy serves on the real engine: a bf16 model with an fp8 KV cache (``--kv-cache-dtype fp8``).

vLLM's CPU backend stores fp8 KV (AVX-512 or AMX) as ``uint8`` bytes with a per-layer scale, as the CUDA backends
do: selection must read the dequantised values and the compaction must move the bytes as they are. Every other
dtype a policy cannot compress is refused at start-up, naming ``--kv-cache-dtype``.
"""

from __future__ import annotations

import pytest
import torch

from cords_vllm.config import KVPolicyConfigError, kv_policy_args
from cords_vllm.integration.inprocess.llm import make_llm
from tests.engine.conftest import TEXT_PROMPT, VIDEO_PROMPT, run_engine, video

pytestmark = pytest.mark.engine

FP8 = {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}
needs_fp8_kv = pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                                  reason="vLLM's CPU backend stores fp8 KV only with AVX-512 or AMX")


def _prompts(frames: int = 32) -> list[dict]:
    return [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(frames)}}, {"prompt": TEXT_PROMPT}]


@needs_fp8_kv
def test_fp8_cache_with_a_budget_above_the_video_gives_the_same_tokens_as_none(tiny_model: str) -> None:
    none = run_engine(tiny_model, _prompts(), "none", engine_kwargs=FP8)
    cords = run_engine(tiny_model, _prompts(), "cords", engine_kwargs=FP8, budget=4096, slack=64)
    assert cords.compressions == 0
    assert cords.token_ids == none.token_ids
    assert cords.free_blocks_after == cords.free_blocks_before


@needs_fp8_kv
@pytest.mark.parametrize("granularity", ["frame", "token"])
def test_fp8_cache_compresses_answers_and_returns_every_block(tiny_model: str, granularity: str) -> None:
    run = run_engine(tiny_model, _prompts(64), "cords", max_tokens=4, engine_kwargs=FP8, budget=256, slack=64,
                     granularity=granularity)
    assert run.compressions >= 2
    assert all(len(t) == 4 for t in run.token_ids)
    assert run.free_blocks_after == run.free_blocks_before
    # The text request shares the batch and is never compressed: it answers as under none.
    none = run_engine(tiny_model, _prompts(64)[1:], "none", max_tokens=4, engine_kwargs=FP8)
    assert run.token_ids[1] == none.token_ids[0]


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "nvfp4"])
def test_kv_dtypes_a_policy_cannot_compress_are_refused_at_start_up(tiny_model: str, kv_cache_dtype: str) -> None:
    with pytest.raises((KVPolicyConfigError, ValueError), match=r"--kv-policy cords does not support --kv-cache-dtype"):
        make_llm(tiny_model, kv_cache_dtype=kv_cache_dtype, **kv_policy_args("cords", budget=256))
