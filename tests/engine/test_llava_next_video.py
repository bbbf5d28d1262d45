"""LLaVA-NeXT-Video keeps the model's math under compression: 1-D rotary positions, frames from the layout.

A tiny fp32 ``LlavaNextVideoForConditionalGeneration`` (CLIP tower, 2 x 2 pooled frames of 25 tokens each, Llama
text model; :mod:`cords_vllm.lab.synthetic.tiny_llava`) runs in the engine and in the HF reference
(:class:`~cords_vllm.lab.reference.hf_llava.HFLlavaNextVideoReference`). Uncompressed, they agree to fp32
rounding; compressed at ``token`` and ``frame`` granularity, the reference that drops exactly the tokens the
engine's workers dropped at the same points agrees too (kept tokens keep their positions, later tokens continue
at their logical ones), and a reference without the evictions does not. The model has no M-RoPE: its frames are
found from the placeholder's layout (each frame 25 contiguous ``<video>`` tokens), so frame granularity keeps or
drops whole frames, and only video tokens are ever evicted. A live stream of clips in LLaVA's chat markup is
re-based at every turn and still equals the reference: its new tokens' 1-D positions take the tokens removed so
far as an offset (without it, they do not).
"""

from __future__ import annotations

import pytest

from cords_vllm.integration.inprocess.heap import settle
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
    settle()


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
    assert facts.rebases_streams and not facts.explicit_positions, "1-D rotary: re-based with a position offset"
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



def _session(llava, turns: list[dict], max_tokens: int):
    """One re-based engine session of ``turns`` (frame granularity, fp32; the last turn generates ``max_tokens``
    tokens, the others one), closed; its :class:`SessionRun`."""
    from cords_vllm.config import kv_policy_args
    from cords_vllm.integration.inprocess.llm import make_llm

    llm = make_llm(llava[0], block_size=32, max_num_batched_tokens=4096, max_num_scheduled_tokens=256,
                   limit_mm_per_prompt={"video": 1}, **kv_policy_args("cords", budget=192, slack=64))
    run = run_session(llm, turns, logprobs=20, answer_tokens=max_tokens)
    del llm
    settle()
    return run


def test_a_re_based_session_equals_the_reference_and_needs_the_position_offset(llava, monkeypatch):
    """A stream of 6 clips in LLaVA's chat markup is re-based at every turn (evicted tokens leave the request in
    every process), yet its answer equals the HF reference over the whole stream with the same evictions, every
    top log-prob within fp32 rounding: each new token's 1-D position is its index in the request plus the
    tokens removed so far (the model runner's position offset). Without the offset the same session's log-probs
    differ (negative control); closing returns every block."""
    from cords_vllm.conversation.transcript import LLAVA, Transcript
    from cords_vllm.integration.worker import hooks

    _, reference = llava
    clips = [video(4, seed=100 + i) for i in range(6)]
    transcript = Transcript(LLAVA)
    texts = [transcript.clip() for _ in clips]
    question = transcript.question("What color was the square?")
    assert texts[0] == "USER: <video>\n" and question == "What color was the square? ASSISTANT:"
    turns = [*({"prompt": t, "multi_modal_data": {"video": f}} for t, f in zip(texts, clips, strict=True)),
             {"prompt": question}]
    steps = 4
    run = _session(llava, turns, steps)
    assert run.free_after == run.free_before
    prompt = "".join(texts) + question
    length = int(reference.encode(prompt, clips)[0].numel())
    assert run.held.evicted_tokens > 0 and run.lengths.prompt < length - 256, "re-based: evicted tokens left it"
    evictions = evictions_of(run.events)
    assert len(evictions) >= 3
    ref = reference.run(prompt, clips, max_new_tokens=steps, chunk_sizes=chunks_for(length, evictions),
                        evictions=evictions, forced_tokens=run.answer)
    assert _gap(run.logprobs, ref) < TOL
    assert ref.token_ids == run.answer

    # negative control: the same session with the model runner's positions left as request indices
    monkeypatch.setattr(hooks, "shift_positions", lambda *args: 0)
    unshifted = _session(llava, turns, steps)
    assert evictions_of(unshifted.events).keys() == evictions.keys()
    assert _gap(unshifted.logprobs, ref) > CONTROL_FACTOR * TOL, "without the offset the positions are wrong"


def _gap(logprobs: list[dict[int, float]], result) -> float:
    """Largest ``|engine - reference|`` over the engine's top log-probs of every step."""
    ref = result.logits.log_softmax(-1)
    return max(abs(lp - float(ref[step, token])) for step, top in enumerate(logprobs) for token, lp in top.items())
