"""The video-QA task generator: determinism, answers correct by construction, needle placement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cords_vllm.lab.vqa import (
    COLOUR_NAMES,
    COLOURS,
    FAMILIES,
    SPLIT_SEEDS,
    CountFamily,
    VideoGeometry,
    answer_vocabulary,
    build_prompt,
    iter_examples,
    make_example,
    make_split,
    plan_example,
)
from cords_vllm.lab.vqa.video import TOKEN_PIXELS

SMALL = VideoGeometry(num_frames=16, size=56)


# ----------------------------------------------------------------------------- an independent decoder
def _saturated(frames: np.ndarray) -> np.ndarray:
    """``bool [..., H, W]``: pixels far from gray (the background is near-gray)."""
    f = frames.astype(np.int16)
    return (f.max(-1) - f.min(-1)) > 80


def _nearest_colour(rgb: np.ndarray) -> str:
    names = list(COLOURS)
    dist = [np.linalg.norm(rgb - np.asarray(COLOURS[n], np.float32)) for n in names]
    return names[int(np.argmin(dist))]


def _is_red_flash(pair: np.ndarray) -> bool:
    mean = pair.reshape(-1, 3).astype(np.float32).mean(0)
    return bool(mean[0] > mean[1] + 60 and mean[0] > mean[2] + 60)


def decode_answer(family: str, frames: np.ndarray) -> str:
    """Read the answer off the pixels, without the generator's metadata."""
    sat = _saturated(frames)                                   # [T, H, W]
    pairs = sat.reshape(-1, 2, *sat.shape[1:]).any(axis=(1, 2, 3))   # temporal patch has a mark
    if family == "static":
        always = sat.all(axis=0)
        return _nearest_colour(frames[:, always].reshape(-1, 3).astype(np.float32).mean(0))
    if family == "count":
        patches = frames.reshape(-1, 2, *frames.shape[1:])
        return str(sum(_is_red_flash(p) for p in patches))
    marked = np.flatnonzero(pairs)
    colours = [_nearest_colour(frames[2 * p:2 * p + 2][sat[2 * p:2 * p + 2]].astype(np.float32).mean(0))
               for p in marked]
    if family == "colour":
        assert len(marked) == 1, marked
        return colours[0]
    if family == "order":
        assert len(marked) == 2 and len(set(colours)) == 2, (marked, colours)
        return colours[0]
    raise AssertionError(family)


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_same_address_same_bytes(family: str) -> None:
    a = make_example(family, 5, seed=7, geometry=SMALL)
    b = make_example(family, 5, seed=7, geometry=SMALL)
    assert a.frames.tobytes() == b.frames.tobytes()
    assert (a.answer, a.needles, a.distractors) == (b.answer, b.needles, b.distractors)
    assert not a.frames.flags.writeable
    c = make_example(family, 6, seed=7, geometry=SMALL)
    d = make_example(family, 5, seed=8, geometry=SMALL)
    assert c.frames.tobytes() != a.frames.tobytes() and d.frames.tobytes() != a.frames.tobytes()


def test_examples_are_independently_addressable() -> None:
    stream = list(iter_examples(["colour", "order"], seed=3, geometry=SMALL, start=2, stop=4))
    assert [(e.family, e.index) for e in stream] == [("colour", 2), ("order", 2), ("colour", 3), ("order", 3)]
    alone = make_example("order", 3, seed=3, geometry=SMALL)
    assert stream[-1].frames.tobytes() == alone.frames.tobytes()


def test_plan_matches_rendered_example() -> None:
    for family in FAMILIES:
        plan = plan_example(family, 11, seed=2, geometry=SMALL)
        ex = make_example(family, 11, seed=2, geometry=SMALL)
        assert (plan.answer, plan.needles, plan.distractors) == (ex.answer, ex.needles, ex.distractors)


def test_splits_are_disjoint_from_training() -> None:
    assert 0 not in SPLIT_SEEDS.values() and len(set(SPLIT_SEEDS.values())) == len(SPLIT_SEEDS)
    held = make_split(["colour"], 2, "heldout", geometry=SMALL)
    assert held[0].seed == SPLIT_SEEDS["heldout"]
    assert held[0].frames.tobytes() != make_example("colour", 0, seed=0, geometry=SMALL).frames.tobytes()


# ----------------------------------------------------------------------------- correct by construction
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_answers_decoded_from_pixels(family: str) -> None:
    geometry = VideoGeometry(num_frames=32, size=112)
    for index in range(12):
        ex = make_example(family, index, seed=1, geometry=geometry)
        assert decode_answer(family, np.asarray(ex.frames)) == ex.answer, (family, index)
        assert ex.answer in FAMILIES[family].answers()


@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), seed=st.integers(0, 2**31), index=st.integers(0, 10**6))
def test_answers_decoded_from_pixels_property(family: str, seed: int, index: int) -> None:
    ex = make_example(family, index, seed=seed, geometry=SMALL)
    assert decode_answer(family, np.asarray(ex.frames)) == ex.answer


def test_count_with_decoys_counts_only_red() -> None:
    fam = CountFamily(max_count=4, max_decoys=2)
    geometry = VideoGeometry(num_frames=64, size=56)
    seen = set()
    for index in range(30):
        ex = make_example(fam, index, seed=0, geometry=geometry)
        seen.add(ex.answer)
        assert decode_answer("count", np.asarray(ex.frames)) == ex.answer
        assert all(m.colour != "red" for m in ex.distractors)
    assert seen == {"0", "1", "2", "3", "4"}


def test_answers_are_the_task_vocabulary() -> None:
    assert set(answer_vocabulary()) == set(COLOUR_NAMES) | {"0", "1", "2"}


# ----------------------------------------------------------------------------- needle metadata
def test_needle_metadata_locates_the_marks() -> None:
    geometry = VideoGeometry(num_frames=64, size=112)
    for family in ("colour", "order"):
        for index in range(6):
            ex = make_example(family, index, seed=4, geometry=geometry)
            sat = _saturated(np.asarray(ex.frames))
            marked_frames = tuple(int(f) for f in np.flatnonzero(sat.any(axis=(1, 2))))
            assert ex.needle_frames == marked_frames
            # Tokens whose 28x28 region holds a saturated pixel == the needle's token indices.
            g = geometry.grid_side
            cells = sat[::2].reshape(geometry.num_patches, g, TOKEN_PIXELS, g, TOKEN_PIXELS).any(axis=(2, 4))
            assert ex.needle_token_indices() == [int(i) for i in np.flatnonzero(cells.reshape(-1))]
            for (start, stop), pos in zip(ex.needle_token_spans(), ex.needle_positions, strict=True):
                assert stop - start == geometry.tokens_per_patch
                assert start == round(pos * geometry.num_video_tokens)
    static = make_example("static", 0, seed=4, geometry=geometry)
    assert static.needle_positions == (0.0,) and static.needle_token_spans() == ((0, 512),)


def test_needle_positions_are_uniform() -> None:
    """Chi-square of the needle's temporal patch against the uniform law (32 patches, 31 dof)."""
    geometry = VideoGeometry(num_frames=64, size=112)
    n, bins = 3200, geometry.num_patches
    critical = 61.1  # chi2(31) at p = 0.001
    samples = {
        "colour": [plan_example("colour", i, seed=0, geometry=geometry).needles[0].patch_start
                   for i in range(n)],
        # each needle of a pair / set, by identity (the earlier one is, by definition, skewed early)
        "order": [m.patch_start for i in range(n // 2)
                  for m in plan_example("order", i, seed=0, geometry=geometry).needles],
        "count": [m.patch_start for i in range(n)
                  for m in plan_example("count", i, seed=0, geometry=geometry).needles],
    }
    for family, patches in samples.items():
        counts = np.bincount(patches, minlength=bins)
        expected = len(patches) / bins
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        # (order / count: the min-gap rejection makes the law only nearly uniform, ~3% at the ends)
        assert chi2 < critical, (family, chi2, counts)
    colour_pos = [p / bins for p in samples["colour"]]
    assert min(colour_pos) == 0.0 and max(colour_pos) == (bins - 1) / bins


def test_count_answers_balanced() -> None:
    answers = [plan_example("count", i, seed=0).answer for i in range(900)]
    for a in ("0", "1", "2"):
        assert 250 < answers.count(a) < 350


def test_prompt_is_the_chat_template_rendering() -> None:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from cords_vllm.lab.vqa import shipped_checkpoint

    tok = AutoTokenizer.from_pretrained(shipped_checkpoint())
    ex = make_example("colour", 0, geometry=SMALL)
    rendered = tok.apply_chat_template(ex.messages(), add_generation_prompt=True, tokenize=False)
    assert rendered == ex.prompt == build_prompt(FAMILIES["colour"].question)
    url_form = tok.apply_chat_template(ex.messages("data:video/jpeg;base64,AAAA"), add_generation_prompt=True,
                                       tokenize=False)
    assert url_form == ex.prompt
    for word in answer_vocabulary():
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
