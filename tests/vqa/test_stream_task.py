"""Stream-shaped QA examples: answers right by construction, what is held, positions with gaps, the transcript."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cords_vllm.conversation.transcript import VIDEO
from cords_vllm.lab.vqa import COLOURS, shipped_checkpoint
from cords_vllm.lab.vqa.stream_task import (
    STREAM_QUESTIONS,
    StreamEncoder,
    make_stream_example,
    stream_split,
    stream_text,
)
from cords_vllm.lab.vqa.video import TEMPORAL_PATCH


def _marks_seen(clip: np.ndarray) -> dict[str, str]:
    """Independent decoder: ``{kind: colour}`` of the saturated marks of one clip (a dot is in every temporal
    patch, a square in one)."""
    f = clip.astype(np.int16)
    saturated = (f.max(-1) - f.min(-1)) > 80                              # [F, S, S]
    patches = saturated.reshape(-1, TEMPORAL_PATCH, *saturated.shape[1:]).any(1)  # [F/2, S, S]
    shown = patches.reshape(len(patches), -1).any(1)
    if not shown.any():
        return {}
    kind = "dot" if shown.all() else "square"
    where = patches[int(np.argmax(shown))]
    frame = clip[TEMPORAL_PATCH * int(np.argmax(shown))][where].astype(np.float32).mean(0)
    names = list(COLOURS)
    return {kind: names[int(np.argmin([np.linalg.norm(frame - np.asarray(COLOURS[n])) for n in names]))]}


def test_answer_is_the_latest_mark_of_the_kind_asked() -> None:
    examples = stream_split(40, "monitor", size=56, clips=(3, 6))
    kinds = set()
    for e in examples:
        seen = [_marks_seen(clip) for clip in e.clips]
        latest = [m[e.kind] for m in seen if e.kind in m]
        assert latest and latest[-1] == e.answer
        assert e.question == STREAM_QUESTIONS[e.kind]
        kinds.add(e.kind)
        assert len({m.colour for _, m in e.marks}) == len(e.marks)  # colours differ: a wrong kind is a wrong answer
    assert kinds == {"dot", "square"}
    assert any(sum(m.kind == e.kind for _, m in e.marks) > 1 for e in examples)  # distractors of the same kind


def test_hard_examples_ask_the_kind_whose_latest_mark_is_not_the_latest() -> None:
    """``hard=1``: both kinds shown, a mark of the other kind after the answer, read back from the pixels;
    ``hard=0`` is the default split, example for example."""
    for e in stream_split(24, "monitor", size=56, clips=(2, 6), hard=1.0):
        seen = [_marks_seen(clip) for clip in e.clips]
        latest_of_kind = max(i for i, m in enumerate(seen) if e.kind in m)
        assert seen[latest_of_kind][e.kind] == e.answer
        assert any(m and e.kind not in m for m in seen[latest_of_kind + 1:])
        assert e.other_kind_newer
    plain, zero = stream_split(24, "monitor", size=56), stream_split(24, "monitor", size=56, hard=0.0)
    assert all(a.answer == b.answer and np.array_equal(a.clips, b.clips) for a, b in zip(plain, zero, strict=True))
    assert not all(e.other_kind_newer for e in plain)  # the default mix has both cases
    assert any(e.other_kind_newer for e in plain)


def test_examples_are_deterministic_and_splits_differ() -> None:
    a, b = make_stream_example(3, seed=11, size=56), make_stream_example(3, seed=11, size=56)
    assert np.array_equal(a.clips, b.clips) and a.gaps == b.gaps and a.answer == b.answer
    assert not np.array_equal(stream_split(1, "monitor", size=56)[0].clips[0],
                              stream_split(1, "heldout", size=56)[0].clips[0])


def test_recent_clips_are_held_whole_and_old_clips_keep_every_mark_token() -> None:
    held, total = 0, 0
    for e in stream_split(20, "heldout", size=112, recent_clips=2):
        assert e.keep[-1] is None and e.keep[-2] is None
        assert all(k is not None for k in e.keep[:-2])
        for c, mark in e.marks:
            if e.keep[c] is not None:
                assert set(mark.token_indices(e.geometry)) <= set(e.keep[c].tolist())
        held += sum(len(k) for k in e.keep[:-2])
        total += (len(e.keep) - 2) * e.geometry.num_video_tokens
    assert 0.05 < held / total < 0.75  # older clips keep 5-70% of their tokens (plus marks)


@pytest.fixture(scope="module")
def encoder() -> StreamEncoder:
    from transformers import AutoTokenizer

    return StreamEncoder(AutoTokenizer.from_pretrained(shipped_checkpoint()))


def test_layout_is_the_stream_transcript_with_gaps_in_vllm_positions(encoder: StreamEncoder) -> None:
    from cords_vllm.lab.reference.hf import vllm_mrope_positions

    e = make_stream_example(5, seed=3, size=56, clips=(5, 5))
    text = stream_text(e)
    assert text.count(VIDEO) == 5 and text.endswith(e.question + "<|im_end|>\n<|im_start|>assistant\n")
    ids, positions, held = encoder.layout(e)
    pad = encoder.hf.video_pad_id
    starts = [i for i in range(len(ids)) if ids[i] == pad and (i == 0 or ids[i - 1] != pad)]
    plain, _ = vllm_mrope_positions(ids.tolist(), {pad: [(e.geometry.num_patches,
                                                          e.geometry.size // 14, e.geometry.size // 14)] * 5}, 2)
    offset = torch.zeros(len(ids), dtype=torch.long)
    for c, s in enumerate(starts):
        offset[s - 1:] += e.gaps[c]
    assert torch.equal(positions, plain + offset)
    n = e.geometry.num_video_tokens
    for c, s in enumerate(starts):
        expect = n if e.keep[c] is None else len(e.keep[c])
        assert int(held[s:s + n].sum()) == expect
    assert bool(held[ids != pad].all())  # text is never dropped
