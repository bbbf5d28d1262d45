"""Synthetic video-QA tasks whose one-token answers sit in rare frames anywhere in the video.

Each question family (:class:`Family`) plans an example from a random generator: the answer word, the
*needles* (the marks that hold the answer) and optional *distractors*; the video is then rendered from the
same generator (:mod:`cords_vllm.lab.vqa.video`). An example is addressed by ``(family, seed, index)`` and
derived from its own generator, so it can be produced alone, in any order, and the same address always
gives the same bytes.

Families
--------
``colour``  "What color was the square?" One saturated square in one temporal patch; answer: its colour
            (8 colours). The needle's patch is uniform over the video.
``order``   "Which color came first?" Two squares of different colours, at least two temporal patches
            apart; answer: the colour of the earlier one. Both squares are needles.
``count``   "How many red flashes?" ``0 .. max_count`` whole-frame red flashes (default 0-2, no decoys),
            at least two temporal patches apart; answer: a digit. Every flash is a needle.
``static``  "What color is the dot?" A small disc stays at one place for the whole video (so a policy that
            keeps only the most recent frames still sees it); half of the videos also show a square of
            another colour in one patch as a distractor. The dot is the needle; its position is 0.

Needle positions (first temporal patch / number of patches, in ``[0, 1)``) are uniform over the video for
``colour``; for ``order`` and ``count`` each needle is uniform (a pair / set of distinct patches drawn
uniformly). A benchmark reports accuracy by :attr:`VQAExample.needle_position` and can build an oracle that
keeps :meth:`VQAExample.needle_token_indices`.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from cords_vllm.lab.synthetic.video import with_metadata
from cords_vllm.lab.vqa.prompt import INPUT_SHAPES, build_prompt, chat_messages
from cords_vllm.lab.vqa.video import (
    COLOUR_NAMES,
    Mark,
    VideoGeometry,
    draw_marks,
    random_box,
    render_background,
)

#: Mixed into every example's seed so these streams differ from other users of ``default_rng(seed)``.
_SEED_NAMESPACE = 0xC0D5

#: Seeds of the fixed evaluation splits; training must use other seeds (the default training seed is 0).
SPLIT_SEEDS: dict[str, int] = {"monitor": 1_000_003, "heldout": 2_000_003, "test": 3_000_017}


@dataclass(frozen=True)
class Plan:
    """What a family decided for one example, before rendering: answer word, needles and distractors."""

    answer: str
    needles: tuple[Mark, ...]
    distractors: tuple[Mark, ...] = ()


class Family(abc.ABC):
    """A question family: one fixed question, a closed set of one-token answers and a planner.

    Subclasses set :attr:`name`, :attr:`question`, :attr:`code` (a stable integer mixed into the seeds) and
    implement :meth:`answers` and :meth:`plan`.
    """

    name: ClassVar[str]
    question: ClassVar[str]
    code: ClassVar[int]

    @abc.abstractmethod
    def answers(self) -> tuple[str, ...]:
        """Every answer word this family can produce."""

    @abc.abstractmethod
    def plan(self, rng: np.random.Generator, geometry: VideoGeometry) -> Plan:
        """Draw the answer and the marks of one example (draws from ``rng`` before rendering does)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _spaced_patches(rng: np.random.Generator, num_patches: int, count: int, min_gap: int) -> list[int]:
    """``count`` distinct temporal patches drawn uniformly (rejection) with pairwise gaps ``>= min_gap``,
    in drawing order (not sorted)."""
    if count == 0:
        return []
    if (count - 1) * min_gap >= num_patches:
        raise ValueError(f"cannot place {count} marks {min_gap} patches apart in {num_patches} patches")
    while True:
        patches = [int(p) for p in rng.choice(num_patches, size=count, replace=False)]
        ordered = sorted(patches)
        if all(b - a >= min_gap for a, b in itertools.pairwise(ordered)):
            return patches


@dataclass(repr=True)
class ColourFamily(Family):
    """Colour of a single square shown in one temporal patch (the needle-attribute question)."""

    name: ClassVar[str] = "colour"
    question: ClassVar[str] = "What color was the square?"
    code: ClassVar[int] = 1

    def answers(self) -> tuple[str, ...]:
        return COLOUR_NAMES

    def plan(self, rng: np.random.Generator, geometry: VideoGeometry) -> Plan:
        patch = int(rng.integers(0, geometry.num_patches))
        colour = COLOUR_NAMES[int(rng.integers(0, len(COLOUR_NAMES)))]
        box = random_box(rng, geometry.size, (26, 40))
        return Plan(colour, (Mark("square", colour, patch, patch + 1, box),))


@dataclass(repr=True)
class OrderFamily(Family):
    """Which of two squares of different colours came first (temporal order); the squares are at least
    ``min_gap`` temporal patches apart."""

    min_gap: int = 2
    name: ClassVar[str] = "order"
    question: ClassVar[str] = "Which color came first?"
    code: ClassVar[int] = 2

    def answers(self) -> tuple[str, ...]:
        return COLOUR_NAMES

    def plan(self, rng: np.random.Generator, geometry: VideoGeometry) -> Plan:
        first, second = sorted(_spaced_patches(rng, geometry.num_patches, 2, self.min_gap))
        i, j = (int(x) for x in rng.choice(len(COLOUR_NAMES), size=2, replace=False))
        marks = tuple(Mark("square", COLOUR_NAMES[c], p, p + 1, random_box(rng, geometry.size, (26, 40)))
                      for c, p in ((i, first), (j, second)))
        return Plan(COLOUR_NAMES[i], marks)


@dataclass(repr=True)
class CountFamily(Family):
    """How many red whole-frame flashes the video has (``0 .. max_count``), with optional decoy flashes of
    other colours. Answers are digits (single tokens)."""

    max_count: int = 2
    max_decoys: int = 0
    min_gap: int = 2
    name: ClassVar[str] = "count"
    question: ClassVar[str] = "How many red flashes?"
    code: ClassVar[int] = 3
    #: Decoy colours: far from red.
    decoy_colours: ClassVar[tuple[str, ...]] = ("green", "blue", "yellow", "cyan", "purple")

    def __post_init__(self) -> None:
        if not 1 <= self.max_count <= 9 or self.max_decoys < 0:
            raise ValueError("CountFamily needs 1 <= max_count <= 9 and max_decoys >= 0")

    def answers(self) -> tuple[str, ...]:
        return tuple(str(n) for n in range(self.max_count + 1))

    def plan(self, rng: np.random.Generator, geometry: VideoGeometry) -> Plan:
        count = int(rng.integers(0, self.max_count + 1))
        decoys = int(rng.integers(0, self.max_decoys + 1)) if self.max_decoys else 0
        patches = _spaced_patches(rng, geometry.num_patches, count + decoys, self.min_gap)
        whole = (0, 0, geometry.size, geometry.size)
        needles = tuple(sorted((Mark("flash", "red", p, p + 1, whole) for p in patches[:count]),
                               key=lambda m: m.patch_start))
        distractors = tuple(
            Mark("flash", self.decoy_colours[int(rng.integers(0, len(self.decoy_colours)))], p, p + 1, whole)
            for p in sorted(patches[count:]))
        return Plan(str(count), needles, distractors)


@dataclass(repr=True)
class StaticFamily(Family):
    """Colour of a small dot that stays for the whole video (a detail even a recency policy keeps); with
    probability ``distractor_probability`` a square of another colour is shown in one temporal patch."""

    distractor_probability: float = 0.5
    name: ClassVar[str] = "static"
    question: ClassVar[str] = "What color is the dot?"
    code: ClassVar[int] = 4

    def answers(self) -> tuple[str, ...]:
        return COLOUR_NAMES

    def plan(self, rng: np.random.Generator, geometry: VideoGeometry) -> Plan:
        colour = COLOUR_NAMES[int(rng.integers(0, len(COLOUR_NAMES)))]
        dot = Mark("dot", colour, 0, geometry.num_patches, random_box(rng, geometry.size, (12, 16)))
        distractors: tuple[Mark, ...] = ()
        if rng.random() < self.distractor_probability:
            others = [c for c in COLOUR_NAMES if c != colour]
            other = others[int(rng.integers(0, len(others)))]
            patch = int(rng.integers(0, geometry.num_patches))
            distractors = (Mark("square", other, patch, patch + 1, random_box(rng, geometry.size, (26, 40))),)
        return Plan(colour, (dot,), distractors)


#: The default families, by name.
FAMILIES: dict[str, Family] = {
    f.name: f for f in (ColourFamily(), OrderFamily(), CountFamily(), StaticFamily())
}


def get_family(family: str | Family) -> Family:
    """A :class:`Family` instance from a name in :data:`FAMILIES` (or the instance itself)."""
    if isinstance(family, Family):
        return family
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}") from None


def answer_vocabulary(families: Sequence[str | Family] | None = None) -> tuple[str, ...]:
    """Sorted union of the answer words of ``families`` (default: all of :data:`FAMILIES`)."""
    chosen = [get_family(f) for f in (families if families is not None else FAMILIES)]
    return tuple(sorted({a for f in chosen for a in f.answers()}))


@dataclass(frozen=True, eq=False)
class VQAExample:
    """One rendered video question with its ground truth.

    Attributes
    ----------
    family, question, answer:
        Family name, question text and the one-token answer word.
    frames:
        ``uint8 [T, S, S, 3]`` RGB video (read-only).
    geometry:
        The video's :class:`VideoGeometry`.
    needles:
        Marks that hold the answer (empty for a ``count`` example whose answer is ``"0"``).
    distractors:
        Other salient marks that do not change the answer.
    seed, index:
        The example's address: ``make_example(family, index, seed=seed, geometry=geometry)`` recreates it.
    """

    family: str
    question: str
    answer: str
    frames: np.ndarray = field(repr=False)
    geometry: VideoGeometry
    needles: tuple[Mark, ...]
    distractors: tuple[Mark, ...]
    seed: int
    index: int

    @property
    def prompt(self) -> str:
        """Raw prompt with one ``<|video_pad|>`` (what ``LLM.generate`` takes)."""
        return build_prompt(self.question)

    def messages(self, video: Any | None = None) -> list[dict[str, Any]]:
        """Chat messages that the shipped chat template renders to :attr:`prompt`."""
        return chat_messages(self.question, video)

    def vllm_request(self, inputs: str = "video", fps: float | None = None) -> dict[str, Any]:
        """The offline vLLM request: ``{"prompt": ..., "multi_modal_data": {"video": frames}}`` (a writable
        copy of the frames, which the engine wraps in a tensor; with ``fps``, the frames and their times, which
        Qwen2.5-VL and Qwen3-VL need), or with ``inputs="images"`` every frame as its own image, in order
        (``{"image": [frame, ...]}``), as evaluation clients send a video."""
        if inputs == "video":
            frames = np.array(self.frames)
            return {"prompt": self.prompt,
                    "multi_modal_data": {"video": frames if fps is None else with_metadata(frames, fps)}}
        if inputs == "images":
            return {"prompt": build_prompt(self.question, images=len(self.frames)),
                    "multi_modal_data": {"image": [np.array(f) for f in self.frames]}}
        raise ValueError(f"inputs must be one of {INPUT_SHAPES}, got {inputs!r}")

    @property
    def needle_positions(self) -> tuple[float, ...]:
        """Relative position in ``[0, 1)`` of each needle's first temporal patch, in temporal order."""
        return tuple(m.position(self.geometry) for m in self.needles)

    @property
    def needle_position(self) -> float | None:
        """The position a benchmark bins accuracy by: the earliest needle's (``None`` without needles)."""
        return min(self.needle_positions) if self.needles else None

    @property
    def needle_frames(self) -> tuple[int, ...]:
        """Sorted frame indices that show a needle."""
        return tuple(sorted({f for m in self.needles for f in m.frames}))

    def needle_token_spans(self) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` ranges, into the video's token block, of the temporal patches showing each
        needle (all their tokens). Add the index of the first ``<|video_pad|>`` to get prompt indices."""
        return tuple(m.token_span(self.geometry) for m in self.needles)

    def needle_token_indices(self) -> list[int]:
        """Sorted indices, into the video's token block, of the tokens whose region a needle touches."""
        return sorted({i for m in self.needles for i in m.token_indices(self.geometry)})


def _example_rng(family: Family, index: int, seed: int) -> np.random.Generator:
    if index < 0 or seed < 0:
        raise ValueError(f"index and seed must be >= 0, got index={index}, seed={seed}")
    return np.random.default_rng([_SEED_NAMESPACE, seed, family.code, index])


def plan_example(family: str | Family, index: int, *, seed: int = 0,
                 geometry: VideoGeometry | None = None) -> Plan:
    """The plan of :func:`make_example` (same answer and marks) without rendering the video (cheap)."""
    fam = get_family(family)
    return fam.plan(_example_rng(fam, index, seed), geometry or VideoGeometry())


def make_example(family: str | Family, index: int, *, seed: int = 0,
                 geometry: VideoGeometry | None = None) -> VQAExample:
    """Render example ``index`` of ``family`` for ``seed``; deterministic (same arguments, same bytes)."""
    fam = get_family(family)
    geometry = geometry or VideoGeometry()
    rng = _example_rng(fam, index, seed)
    plan = fam.plan(rng, geometry)
    frames = draw_marks(rng, render_background(rng, geometry), plan.distractors + plan.needles)
    frames.setflags(write=False)
    return VQAExample(family=fam.name, question=fam.question, answer=plan.answer, frames=frames,
                      geometry=geometry, needles=plan.needles, distractors=plan.distractors, seed=seed,
                      index=index)


def iter_examples(families: Sequence[str | Family], *, seed: int, geometry: VideoGeometry | None = None,
                  start: int = 0, stop: int | None = None) -> Iterator[VQAExample]:
    """Examples ``start, start + 1, ...`` (to ``stop``, or forever) of each family, interleaved
    round-robin: index ``i`` of every family, then ``i + 1``."""
    fams = [get_family(f) for f in families]
    index = start
    while stop is None or index < stop:
        for fam in fams:
            yield make_example(fam, index, seed=seed, geometry=geometry)
        index += 1


def make_split(families: Sequence[str | Family], per_family: int, split: str = "heldout", *,
               geometry: VideoGeometry | None = None) -> list[VQAExample]:
    """``per_family`` examples of each family from a fixed evaluation split (:data:`SPLIT_SEEDS`),
    interleaved round-robin."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; known: {sorted(SPLIT_SEEDS)}")
    return list(iter_examples(families, seed=SPLIT_SEEDS[split], geometry=geometry, stop=per_family))
