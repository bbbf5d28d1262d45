"""vLLM's own video pruning (``--video-pruning-rate``: EVS, and VidCom2 on Qwen3-VL) runs on the CPU build, with
``--kv-policy none`` and with ``cords`` on top, for Qwen2.5-VL and Qwen3-VL.

Two fixes of the patch table make it run (:mod:`cords_vllm.integration.worker.video_pruning`): the CPU runner
turns on the run-time M-RoPE recomputation the GPU runner turns on (without it the first video prefill crashes,
checked here), and Qwen3-VL's recomputation no longer takes a prompt's outer ``<|vision_start|>`` for the first
frame's (checked against the bare-placeholder prompt's positions, and without the fix).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.integration.worker import video_pruning
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_model
from tests.engine.conftest import VIDEO_PROMPT, run_engine, video
from tests.engine.test_families import clip

pytestmark = pytest.mark.engine

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
FRAMES = 16
RATE = 0.5
PRUNING = {"video_pruning_rate": RATE}
#: The prompt with a bare placeholder (Qwen3-VL's processor writes each frame's markers itself).
BARE_PROMPT = VIDEO_PROMPT.replace("<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>")
#: One prefill chunk for the whole prompt: vLLM's Qwen3-VL EVS recomputation is not chunk-invariant by itself.
ONE_CHUNK = {"max_num_scheduled_tokens": 4096}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple[str, str]:
    """``(family, checkpoint)``, fp32."""
    yield request.param, str(build_tiny_model(TinyModelSpec(family=request.param, dtype="float32")))
    settle()


@pytest.fixture(scope="module")
def qwen3_vl() -> str:
    return str(build_tiny_model(TinyModelSpec(family="qwen3_vl", dtype="float32")))


@pytest.fixture(scope="module")
def pruned(family):
    """The family's run of the test clip under EVS alone (both tests below compare against it)."""
    return run_engine(family[1], _request(), engine_kwargs=PRUNING)


def _request(prompt: str = VIDEO_PROMPT) -> list[dict]:
    return [{"prompt": prompt, "multi_modal_data": {"video": clip(video(FRAMES))}}]


def _video_tokens(path: str) -> int:
    """Video tokens of the test clip without pruning: temporal patches x merged patches of a 224x224 frame."""
    vision = json.loads((Path(path) / "config.json").read_text())["vision_config"]
    side = 224 // (vision["patch_size"] * vision["spatial_merge_size"])
    return FRAMES // vision["temporal_patch_size"] * side * side


def test_evs_prunes_the_videos_tokens_and_answers(family, pruned):
    _, path = family
    full = run_engine(path, _request())
    tokens = _video_tokens(path)
    assert full.prompt_lens[0] - pruned.prompt_lens[0] == tokens - int(tokens * (1 - RATE)), \
        "EVS keeps (1 - rate) of the video tokens"
    assert len(pruned.token_ids[0]) == 6
    assert pruned.free_blocks_after == pruned.free_blocks_before


@pytest.mark.slow  # in -m slow (make test-slow): keeps the default suite under 20 minutes
def test_vidcom2_runs_on_qwen3_vl(qwen3_vl):
    full = run_engine(qwen3_vl, _request())
    pruned = run_engine(qwen3_vl, _request(), engine_kwargs={**PRUNING, "video_pruning_method": "vidcom2"})
    assert pruned.prompt_lens[0] < full.prompt_lens[0] and len(pruned.token_ids[0]) == 6


def test_cords_compresses_on_top_of_evs_and_returns_every_block(family, pruned):
    """EVS prunes, then the policy compresses what is left (frames found in the positions EVS recomputed)."""
    _, path = family
    run = run_engine(path, _request(), "cords", budget=96, slack=32, granularity="frame", engine_kwargs=PRUNING)
    assert run.prompt_lens == pruned.prompt_lens
    assert len(run.events) >= 2 and len(run.token_ids[0]) == 6
    assert run.free_blocks_after == run.free_blocks_before
    assert max(run.max_blocks_held.values()) < max(pruned.max_blocks_held.values())


def _recorded_positions(monkeypatch, path: str, prompt: str) -> torch.Tensor:
    """The M-RoPE positions Qwen3-VL's EVS recomputation returned last for ``prompt`` (one prefill chunk)."""
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as Model

    current, seen = Model.recompute_mrope_positions, []

    def record(self, *args, **kwargs):
        out = current(self, *args, **kwargs)
        seen.append(out[1].clone())
        return out

    with monkeypatch.context() as m:
        m.setattr(Model, "recompute_mrope_positions", record)
        run_engine(path, _request(prompt), max_tokens=1, engine_kwargs={**PRUNING, **ONE_CHUNK})
    return seen[-1]


@pytest.mark.slow  # in -m slow (make test-slow): keeps the default suite under 20 minutes
def test_qwen3_vl_outer_vision_markers_do_not_shift_the_video(monkeypatch, qwen3_vl):
    """``<|vision_start|><|video_pad|><|vision_end|>`` keeps its outer markers (transformers >= 5.10): the
    positions are the bare placeholder's, one token and one position later (and two after the outer end)."""
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as Model

    bare = _recorded_positions(monkeypatch, qwen3_vl, BARE_PROMPT)
    wrapped = _recorded_positions(monkeypatch, qwen3_vl, VIDEO_PROMPT)
    assert wrapped.shape[1] == bare.shape[1] + 2
    assert torch.equal(wrapped[:, 1:bare.shape[1] + 1], bare + 1)
    # without the fix, EVS takes the outer marker for the first frame's and writes the video past its end
    monkeypatch.setattr(Model, "recompute_mrope_positions", Model.recompute_mrope_positions.__wrapped__)
    assert "The expanded size of the tensor (0) must match" in _failure(qwen3_vl, VIDEO_PROMPT, ONE_CHUNK)


def test_outer_vision_starts_are_those_that_open_no_media():
    vs, ve, pad, img = 10, 11, 12, 13
    ids = [1, vs, 5, 6, vs, pad, pad, ve, 7, vs, ve, vs, img, ve, ve, vs]
    opening = (img, pad, ve)
    assert video_pruning.outer_vision_starts(ids, vs, opening).tolist() == [1, 15]
    hidden = video_pruning.hide_outer_vision_starts(ids, vs, opening)
    assert hidden == [1, -1, 5, 6, vs, pad, pad, ve, 7, vs, ve, vs, img, ve, ve, -1]
    assert torch.equal(video_pruning.hide_outer_vision_starts(torch.tensor(ids), vs, opening), torch.tensor(hidden))
    plain = [1, vs, pad, ve]
    assert video_pruning.hide_outer_vision_starts(plain, vs, opening) is plain


def test_the_cpu_engine_crashes_at_the_first_pruned_prefill_without_the_fix(monkeypatch, family):
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if not current_platform.is_cpu():
        pytest.skip("the CPU runner's fix")
    _, path = family
    monkeypatch.setattr(CPUModelRunner, "load_model", CPUModelRunner.load_model.__wrapped__)
    # the pruned embeddings carry their positions in extra channels, merged unstripped
    assert re.search("Error during index put|split_with_sizes expects", _failure(path, VIDEO_PROMPT))


def _failure(path: str, prompt: str, engine_kwargs: dict | None = None) -> str:
    """The error of an engine run with pruning that must fail ("" if it did not). The failed engine is collected
    here, before the next test builds one: collected later, it would tear down the next engine's process groups."""
    try:
        run_engine(path, _request(prompt), max_tokens=1, engine_kwargs={**PRUNING, **(engine_kwargs or {})})
        message = ""
    except Exception as exc:  # vLLM raises several kinds here
        message = str(exc)
    settle()
    return message
