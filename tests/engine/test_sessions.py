"""Live streams as bounded engine sessions: compressed across turns, equal to one-shot, every block returned."""

from __future__ import annotations

import pytest
import torch

from cords_vllm.compress.plan import BudgetSettings, compressed_footprint_blocks
from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess import llm as inprocess_llm
from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.integration.inprocess.introspect import record_steps, snapshot
from cords_vllm.integration.inprocess.session import EngineSession
from tests.engine.conftest import BLOCK, chunks_for, evictions_of, video

pytestmark = pytest.mark.engine

BUDGET, SLACK = 192, 64
PUSHES, CLIP_FRAMES = 12, 4  # 4 frames = 128 video tokens per push
QUESTION_AFTER = (3, 7, 11)
OPEN = "<|im_start|>user\n"
CLIP = "<|vision_start|><|video_pad|><|vision_end|>"
QUESTION = "What color was the square?<|im_end|>\n<|im_start|>assistant\n"


def _llm(make_llm, model, policy="cords"):
    kwargs = {"block_size": BLOCK, "max_num_batched_tokens": 4096, "max_num_scheduled_tokens": 256,
              "limit_mm_per_prompt": {"image": 0, "video": PUSHES}}
    if policy != "none":
        kwargs.update(kv_policy_args(policy, budget=BUDGET, slack=SLACK))
    return make_llm(model, **kwargs)


def _turns():
    """The stream's turns: (prompt text, clip or None, max_tokens)."""
    for i in range(PUSHES):
        yield (OPEN if i == 0 else "") + CLIP, video(CLIP_FRAMES, seed=100 + i), 1
        if i in QUESTION_AFTER:
            yield QUESTION if i == PUSHES - 1 else QUESTION + "<|im_start|>user\n", None, 1


def _prompt(text, clip):
    return {"prompt": text, "multi_modal_data": {"video": clip}} if clip is not None else {"prompt": text}


@pytest.fixture(scope="module")
def session_run(tiny_model):
    llm = _llm(inprocess_llm.make_llm, tiny_model)
    steps = record_steps(llm)
    free = snapshot(llm).free_blocks
    session = EngineSession(llm, "camera-0")
    answers, held_after_turn = [], []
    for text, clip, max_tokens in _turns():
        tokens = session.push(_prompt(text, clip), max_tokens)
        if clip is None:
            answers.append(tokens)
        state = snapshot(llm)
        held_after_turn.append(state.requests[session.request_id])
    events = [e for e in snapshot(llm).events if e.req_id == session.request_id]
    session.close()
    result = {"answers": answers, "held": held_after_turn, "events": events, "steps": steps,
              "free_before": free, "free_after": snapshot(llm).free_blocks, "request_id": session.request_id}
    del llm
    settle()
    return result


def test_a_session_is_compressed_across_turns_and_stays_bounded(session_run):
    held = session_run["held"]
    assert len(held) == PUSHES + len(QUESTION_AFTER)
    assert held[-1].compressions >= 5  # compressed as the video arrives, across turns
    video_tokens = PUSHES * (CLIP_FRAMES * 32 + 2)  # each clip's tokens and its two vision markers
    # re-based at every turn: what it evicted left the request, what it holds plus that is what it was sent
    assert held[-1].candidate_tokens + held[-1].evicted_tokens == video_tokens
    assert held[-1].candidate_tokens <= BUDGET + SLACK + 2 * BLOCK
    settings = BudgetSettings(BUDGET, BUDGET // 4, SLACK)
    for state in held:  # after every turn, waiting for the next one
        assert state.held_candidate_tokens <= BUDGET + SLACK + 2 * BLOCK
    # at every step, inside turns too: the bounded footprint of the whole stream (all of its text kept)
    text_tokens = held[-1].held_blocks * BLOCK  # upper bound on what the last state holds, text included
    footprint = compressed_footprint_blocks(text_tokens + video_tokens, video_tokens, settings, BLOCK)
    peak = session_run["steps"].max_blocks_held[session_run["request_id"]]
    assert peak <= footprint < -(-(video_tokens + 60) // BLOCK)
    assert session_run["free_after"] == session_run["free_before"]  # closing returns every block


def test_answers_and_kept_tokens_equal_the_one_shot_request_and_hf(tiny_model, session_run, hf_reference, make_llm):
    """A question answered mid-stream equals a one-shot request over the same tokens, compressions included,
    and the HF reference that drops the same tokens at the same points."""
    llm = _llm(make_llm, tiny_model)
    from vllm import SamplingParams

    turns = list(_turns())
    ends = [i for i, (_, clip, _) in enumerate(turns) if clip is None]
    prompts = []
    for end in ends:
        text = "".join(t for t, _, _ in turns[: end + 1])
        clips = [c for _, c, _ in turns[: end + 1] if c is not None]
        prompts.append({"prompt": text, "multi_modal_data": {"video": clips}})
    from cords_vllm.integration.inprocess.introspect import snapshot as snap

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=20), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == session_run["answers"]
    # the last one-shot request saw the whole stream: it kept exactly the session's tokens at the same points
    last = outs[-1].request_id
    one_shot = evictions_of([e for e in snap(llm).events if e.req_id.startswith(last.split("-")[0])])
    session = evictions_of(session_run["events"])
    assert len(session) >= 5 and one_shot.keys() == session.keys()
    for at in session:
        assert all(torch.equal(a, b) for a, b in zip(session[at], one_shot[at], strict=True))
    # the HF reference over the whole stream, evicting the session's tokens at the session's points
    prompt = prompts[-1]
    length = len(outs[-1].prompt_token_ids)
    ref = hf_reference.run(prompt["prompt"], prompt["multi_modal_data"]["video"], max_new_tokens=1,
                           chunk_sizes=chunks_for(length, session), evictions=session)
    assert ref.token_ids == session_run["answers"][-1]
    ref_lp = ref.logits.log_softmax(-1)
    top = outs[-1].outputs[0].logprobs[0]
    assert max(abs(lp.logprob - float(ref_lp[0, t])) for t, lp in top.items()) < 2e-4


@pytest.mark.parametrize("where", ["mid-push", "mid-question", "waiting"])
def test_ending_a_session_anywhere_returns_every_block(tiny_model, where, make_llm):
    llm = _llm(make_llm, tiny_model)
    free = snapshot(llm).free_blocks
    session = EngineSession(llm, "camera-1")
    for i in range(3):
        session.push(_prompt((OPEN if i == 0 else "") + CLIP, video(CLIP_FRAMES, seed=i)))
    assert snapshot(llm).requests[session.request_id].compressions >= 1
    if where == "mid-push":
        session.start_turn(_prompt(CLIP, video(CLIP_FRAMES, seed=9)))
        session.step()
        session.abort()
    elif where == "mid-question":
        session.start_turn(_prompt(QUESTION, None), max_tokens=8)
        for _ in range(3):
            session.step()
        session.abort()
    else:
        session.close()
    llm.llm_engine.step()  # aborted requests reach the workers with the next step
    state = snapshot(llm)
    assert state.free_blocks == free and state.requests == {} and state.held_by_workers == {}
