"""A stream's protected-token account: what a turn needs, what it keeps, and which servers check it."""

from __future__ import annotations

import pytest

from cords_vllm.config import KVPolicyConfig
from cords_vllm.conversation.text_budget import TextBudget, TextRoomExceeded, protected_token_counter
from cords_vllm.conversation.transcript import ASSISTANT, END, SYSTEM, USER, VIDEO, Transcript

#: A toy tokenizer: one token per character, so counts are easy to check by hand; specials are single tokens.
SPECIALS = {"<|vision_start|>": 1, "<|video_pad|>": 2, "<|vision_end|>": 3, "<|im_start|>": 4, "<|im_end|>": 5}


def encode(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        special = next((s for s in SPECIALS if text.startswith(s, i)), None)
        ids.append(SPECIALS[special] if special else 100 + ord(text[i]))
        i += len(special) if special else 1
    return ids


def test_a_clip_counts_its_markup_but_not_the_video_or_its_markers():
    count = protected_token_counter(encode, [1, 2, 3])
    assert count(VIDEO) == 0
    assert count(SYSTEM + USER + VIDEO) == len(encode(SYSTEM + USER))
    assert count(END + USER + VIDEO) == len(encode(END + USER)) == 8


def test_a_turn_reserves_its_answer_and_keeps_all_but_the_last_token():
    budget = TextBudget(limit=40)
    budget.admit(10, max_tokens=1, what="a clip")  # a clip generates one token, which the engine discards
    budget.finish(1)
    assert budget.held == 10
    budget.admit(20, max_tokens=11, what="the question")  # 20 + 10 kept answer tokens at most: fits exactly
    assert budget.held == 30
    budget.finish(4)  # 4 generated (the last, e.g. <|im_end|>, discarded): 3 kept
    assert (budget.held, budget.room) == (33, 7)


def test_a_turn_that_could_pass_the_limit_is_refused_and_nothing_is_counted():
    budget = TextBudget(limit=40, held=33)
    with pytest.raises(TextRoomExceeded) as err:
        budget.admit(5, max_tokens=4, what="the question")
    assert (err.value.need, err.value.room) == (8, 7)
    message = str(err.value)
    assert "the question needs up to 8" in message and "max_text_tokens' (40)" in message and "7 left" in message
    assert budget.held == 33
    budget.admit(5, max_tokens=3, what="the question")  # 5 + 2 = 7: fits
    assert budget.held == 38
    with pytest.raises(ValueError, match="max_tokens"):
        budget.admit(1, max_tokens=0, what="x")


def test_without_a_limit_everything_is_admitted():
    budget = TextBudget(limit=None)
    budget.admit(10**6, max_tokens=10**6, what="x")
    assert budget.room is None and budget.held == 10**6


def test_a_whole_conversation_counts_what_the_engine_keeps():
    """System prompt, clips, a question, its answer, then more clips: the count the engine's request has."""
    count = protected_token_counter(encode, [1, 2, 3])
    budget, transcript = TextBudget(limit=None), Transcript()
    for turn, max_tokens, generated in [(transcript.clip(), 1, 1), (transcript.clip(), 1, 1),
                                        (transcript.question("q?"), 4, 2), (transcript.clip(), 1, 1)]:
        budget.admit(count(turn), max_tokens, "turn")
        budget.finish(generated)
    kept_answer = 1  # two generated, the end token discarded
    assert budget.held == len(encode(SYSTEM + USER + "q?" + END + ASSISTANT)) + kept_answer + len(encode(END + USER))


def _registry(policy: str, config: dict | None, count_text=len):
    from cords_vllm.integration.api_server.streams.registry import StreamLimits, StreamRegistry

    return StreamRegistry(engine=None, limits=StreamLimits(), policy=KVPolicyConfig.parse(policy, config),
                          block_size=32, pool_blocks=10_000, max_model_len=4096, count_text=count_text)


def test_streams_check_text_exactly_when_the_policy_evicts_their_video():
    assert _registry("cords", {"budget": 64, "max_text_tokens": 100}).text_limit() == 100
    assert _registry("cords", {"budget": 64}).text_limit() == 4096  # the default limit, capped by max-model-len
    stream = _registry("cords", {"budget": 64, "max_text_tokens": 100}).open()
    assert (stream.text.limit, stream.count_text) == (100, len)
    # nothing to check: none evicts nothing; clips are all text when video is not a candidate; no tokenizer
    assert _registry("none", None).text_limit() is None
    assert _registry("cords", {"budget": 64, "modalities": ["image"]}).text_limit() is None
    unchecked = _registry("cords", {"budget": 64}, count_text=None).open()
    assert (unchecked.text.limit, unchecked.count_text) == (None, None)
