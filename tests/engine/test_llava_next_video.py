"""LLaVA-NeXT-Video keeps the model's math under compression: 1-D rotary positions, frames from the layout.

A tiny fp32 ``LlavaNextVideoForConditionalGeneration`` (CLIP tower, 2 x 2 pooled frames of 25 tokens each, Llama
text model; :mod:`cords_vllm.lab.synthetic.tiny_llava`) runs in the engine and in the HF reference
(:class:`~cords_vllm.lab.reference.hf_llava.HFLlavaNextVideoReference`). Uncompressed, they agree to fp32
rounding; compressed at ``token`` and ``frame`` granularity, the reference that drops exactly the tokens the
engine's workers dropped at the same points agrees too (kept tokens keep their positions, later tokens continue
at their logical ones), and a reference without the evictions does not. The model has no M-RoPE: its frames are
found from the placeholder's layout (each frame 25 contiguous ``<video>`` tokens), so frame granularity keeps or
drops whole frames, and only video tokens are ever evicted.
"""

from __future__ import annotations

import gc

import pytest

from cords_vllm.lab.reference.exactness import CONTROL_FACTOR
from cords_vllm.lab.synthetic.tiny_llava import TinyLlavaSpec, build_tiny_llava_next_video
from cords_vllm.model_facts import FRAMES_FROM_LAYOUT, ModelFacts
from tests.engine.conftest import (
    assert_exact_with_control,
    chunks_for,
    evictions_of,
    run_engine,
    run_session,
    video,
)
from tests.engine.test_exactness import TOL, _compare

pytestmark = pytest.mark.engine

PROMPT = "USER: <video>\nWhat color was the square? ASSISTANT:"
SPEC = TinyLlavaSpec()
FRAMES = 32


@pytest.fixture(scope="module")
def llava():
    """``(checkpoint, HF reference)`` of the tiny LLaVA-NeXT-Video, fp32."""
    from cords_vllm.lab.reference.hf_llava import HFLlavaNextVideoReference

    path = str(build_tiny_llava_next_video(SPEC))
    yield path, HFLlavaNextVideoReference(path)
    gc.collect()


def _request(frames) -> dict:
    return {"prompt": PROMPT, "multi_modal_data": {"video": frames}}


def _dropped(events) -> set[int]:
    """Logical ids some compression dropped (from any layer or head)."""
    dropped: set[int] = set()
    for event in events:
        for keep in event.kept_logical:
            dropped |= set(range(event.at_token)) - set(keep.flatten().tolist())
    return dropped


def test_frames_come_from_the_placeholder_layout(llava):
    from transformers import AutoConfig

    facts = ModelFacts.from_hf_config(AutoConfig.from_pretrained(llava[0]), uses_mrope=False)
    assert facts.model_type == "llava_next_video" and facts.frames_from == FRAMES_FROM_LAYOUT
    assert facts.tokens_per_frame == SPEC.tokens_per_frame == 25 and facts.finds_frames
    assert not facts.rebases_streams, "1-D rotary: a re-based request would shift its positions"
    assert facts.vision_markers == frozenset()


def test_uncompressed_engine_equals_hf(llava):
    path, reference = llava
    frames = video(16)
    run = run_engine(path, [_request(frames)], "none", max_tokens=6)
    ref = reference.run(PROMPT, frames, max_new_tokens=6, forced_tokens=run.token_ids[0])
    assert run.prompt_lens[0] == reference.encode(PROMPT, frames)[0].numel() == 16 * 25 + 24
    assert _compare(run, ref) < TOL


@pytest.mark.parametrize("granularity", ["frame", "token"])
def test_compressed_engine_equals_the_hf_reference(llava, granularity):
    path, reference = llava
    frames = video(FRAMES)
    run = run_engine(path, [_request(frames)], "cords", max_tokens=6, budget=256, slack=64,
                     granularity=granularity)
    assert len(run.events) >= 2, "the prompt must be compressed at least twice"
    assert_exact_with_control(run, reference, PROMPT, frames, TOL, CONTROL_FACTOR)

    ids = reference.encode(PROMPT, frames)[0]
    assert ids.numel() == run.prompt_lens[0]
    pad = ids == reference.config.video_token_id
    dropped = _dropped(run.events)
    assert dropped and all(bool(pad[i]) for i in dropped), "only video tokens are evicted"
    if granularity == "frame":
        # frames found independently: the run of <video> tokens cut into 25-token frames; a frame is kept or
        # dropped whole, but for at most one more per compression (the last one chosen is cut to the block count,
        # and stays one smaller unit afterwards)
        first = int(pad.nonzero()[0, 0])
        assert int(pad.sum()) == FRAMES * 25 and bool(pad[first:first + FRAMES * 25].all())
        frame_sets = [set(range(first + 25 * k, first + 25 * (k + 1))) for k in range(FRAMES)]
        partial_before = 0
        for event in sorted(run.events, key=lambda e: e.at_token):
            kept = set(event.kept_logical[0].flatten().tolist())
            partial = [f for f in frame_sets if max(f) < event.at_token and 0 < len(f & kept) < len(f)]
            assert len(partial) <= partial_before + 1, f"{len(partial)} frames partly kept at token {event.at_token}"
            partial_before = len(partial)
        assert sum(f <= dropped for f in frame_sets) >= FRAMES // 4, "whole frames were evicted"



@pytest.mark.slow  # in -m slow (make test-slow): keeps the default suite under 20 minutes
def test_a_session_is_compressed_across_turns_without_re_basing(llava):
    """An engine session of 6 clips (not re-based: 1-D positions would shift) compresses across turns at frame
    granularity, keeps its row logical (null entries where it evicted), answers as the HF reference over the
    whole session with the same evictions, and returns every block when closed."""
    from cords_vllm.config import kv_policy_args
    from cords_vllm.integration.inprocess.llm import make_llm

    path, reference = llava
    llm = make_llm(path, block_size=32, max_num_batched_tokens=4096, max_num_scheduled_tokens=256,
                   limit_mm_per_prompt={"video": 1}, **kv_policy_args("cords", budget=192, slack=64))
    clips = [video(4, seed=100 + i) for i in range(6)]
    texts = ["USER: <video>\n"] + ["<video>\n"] * 5
    question = "What color was the square? ASSISTANT:"
    turns = [{"prompt": t, "multi_modal_data": {"video": f}} for t, f in zip(texts, clips, strict=True)]
    run = run_session(llm, [*turns, {"prompt": question}])
    answer, held, events = run.answer, run.held, run.events
    assert run.free_after == run.free_before
    del llm
    gc.collect()
    assert held.evicted_tokens > 0 and held.region_blocks > held.held_blocks, "compressed, row kept logical"
    evictions = evictions_of(events)
    assert len(evictions) >= 3
    prompt = "".join(texts) + question
    length = int(reference.encode(prompt, clips)[0].numel())
    ref = reference.run(prompt, clips, max_new_tokens=1, chunk_sizes=chunks_for(length, evictions),
                        evictions=evictions)
    assert ref.token_ids == answer
