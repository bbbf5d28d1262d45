"""Stream-shaped video QA: what a long, compressed live stream holds when it is asked, as one example.

The one-shot task (:mod:`cords_vllm.lab.vqa.tasks`) shows one video with one mark per question. A camera that
has streamed for minutes holds something else when it is asked: its last clips in full (the recent window),
scattered tokens of older clips (what the policy kept: the marks among them), the text of earlier questions, and
M-RoPE positions that continue from clip to clip with gaps where evicted clips were. It also holds several
marks: squares and dots of earlier events, so "What color was the square?" means *the latest* square. A model
trained on one mark per video names the most salient mark whatever is asked; :func:`make_stream_example` draws
examples of the stream's shape so a model learns to tell marks apart by kind and by time.

An example (:class:`StreamExample`) is ``K`` clips of ``clip_frames`` frames in the live stream's transcript
(:mod:`cords_vllm.conversation.transcript`): system prompt, a user message of clips, earlier questions as the
stream leaves them (the answer token is discarded by the engine), then the question. Each clip carries the
stream benchmark's timestamp cells. Positions are vLLM's M-RoPE rule over the held clips plus ``gaps`` (positions
of clips no longer held); older clips keep a random fraction of their tokens, every mark token among them.

:class:`StreamEncoder` turns examples into HF inputs with the video features scattered into the embeddings, so
tokens can be dropped after the vision encoder has seen whole clips.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cords_vllm.conversation.transcript import Transcript
from cords_vllm.lab.vqa.video import (
    COLOUR_NAMES,
    TEMPORAL_PATCH,
    Mark,
    VideoGeometry,
    draw_marks,
    random_box,
    render_background,
)

#: The two questions and the mark kind each asks about (its latest one).
STREAM_QUESTIONS: dict[str, str] = {"dot": "What color is the dot?", "square": "What color was the square?"}
#: Side ranges (pixels) of the marks, as the one-shot families draw them.
DOT_SIDE, SQUARE_SIDE = (12, 16), (26, 40)
#: Split seeds of stream examples (disjoint from the one-shot task's).
STREAM_SPLIT_SEEDS: dict[str, int] = {"train": 7_000, "monitor": 7_001, "heldout": 7_002}


def timestamp(clip: np.ndarray, number: int, bits: int = 16, cell: int = 6) -> np.ndarray:
    """A copy of ``clip`` (``uint8 [T, S, S, 3]``) with ``number`` drawn in every frame as ``bits`` black (0) or
    white (1) cells of ``cell`` pixels in a row at the bottom-left corner (a camera's frame counter)."""
    out = np.array(clip)
    y = out.shape[1] - cell
    for b in range(min(bits, out.shape[2] // cell)):
        out[:, y:, b * cell:(b + 1) * cell] = 255 if number >> b & 1 else 0
    return out


def clip_mark(kind: str, colour: str, rng: np.random.Generator, geometry: VideoGeometry) -> Mark:
    """A mark of one clip: a dot in every frame, or a square in one random temporal patch."""
    if kind == "dot":
        return Mark("dot", colour, 0, geometry.num_patches, random_box(rng, geometry.size, DOT_SIDE))
    patch = int(rng.integers(0, geometry.num_patches))
    return Mark("square", colour, patch, patch + 1, random_box(rng, geometry.size, SQUARE_SIDE))


@dataclass(frozen=True)
class StreamExample:
    """What a stream holds when asked, and the answer.

    Attributes
    ----------
    clips:
        ``uint8 [K, F, S, S, 3]``, the held clips in stream order.
    marks:
        ``(clip index, mark)`` of every mark drawn.
    gaps:
        ``[K]`` positions of evicted clips before each held clip (added to its positions and everything after).
    keep:
        Per clip, the sorted indices of its video tokens the stream still holds (``None``: all of them).
    asked_after:
        Clip indices after which an earlier question was asked (its text stays; its answer token does not).
    kind, answer:
        The mark kind asked about (its latest mark's colour is the answer).
    """

    clips: np.ndarray
    marks: tuple[tuple[int, Mark], ...]
    gaps: tuple[int, ...]
    keep: tuple[np.ndarray | None, ...]
    asked_after: tuple[int, ...]
    kind: str
    answer: str

    @property
    def question(self) -> str:
        return STREAM_QUESTIONS[self.kind]

    @property
    def geometry(self) -> VideoGeometry:
        return VideoGeometry(num_frames=self.clips.shape[1], size=self.clips.shape[2])

    @property
    def other_kind_newer(self) -> bool:
        """Whether a mark of the other kind came after the answer (the hard case: naming the latest mark of any
        kind is wrong, as for a question about minutes ago asked seconds after another event)."""
        return self.marks[-1][1].kind != self.kind


def make_stream_example(index: int, *, seed: int, size: int = 112, clip_frames: int = 8,
                        clips: tuple[int, int] = (4, 14), recent_clips: int = 2, min_gap: int = 50,
                        max_gap: int = 4000, hard: float = 0.0
                        ) -> StreamExample:
    """Stream example ``index`` of split ``seed`` (deterministic).

    ``clips``: range (inclusive) of held clips; the last ``recent_clips`` are held whole and contiguous, older ones
    keep 5-70% of their tokens (every mark token) and are ``min_gap`` to ``max_gap`` positions (log-uniform) after
    the clip before them (evicted clips); the first held clip starts up to ``4 * max_gap`` positions in.
    One to four marks of distinct colours in distinct clips: up to
    three squares and two dots; the question asks about a kind present, its answer is that kind's latest mark.
    With probability ``hard`` (drawn from its own generator, so ``hard=0`` draws the same examples as before it
    existed) the example is :attr:`StreamExample.other_kind_newer`: both kinds are shown and the kind asked is
    the one whose latest mark is not the latest mark.
    """
    rng = np.random.default_rng([seed, index])
    forced = hard > 0 and np.random.default_rng([seed, index, 1]).random() < hard
    geometry = VideoGeometry(num_frames=clip_frames, size=size)
    k = int(rng.integers(clips[0], clips[1] + 1))
    squares, dots = int(rng.integers(0, 4)), int(rng.integers(0, 3))
    if squares + dots == 0:
        squares = 1
    squares, dots = min(squares, k), min(dots, k - min(squares, k))
    if forced and k > 1:
        squares = max(1, min(squares, k - 1))
        dots = max(1, min(dots, k - squares))
    colours = rng.permutation(len(COLOUR_NAMES))[:squares + dots]
    where = rng.permutation(k)[:squares + dots]
    marks = tuple(sorted(((int(c), clip_mark(kind, COLOUR_NAMES[int(col)], rng, geometry))
                          for c, col, kind in zip(where, colours, ["square"] * squares + ["dot"] * dots,
                                                  strict=True)),
                         key=lambda m: m[0]))
    background = np.clip(render_background(rng, VideoGeometry(num_frames=k * clip_frames, size=size)), 0, 255)
    start = int(rng.integers(0, 1 << 16))
    out = np.empty((k, clip_frames, size, size, 3), np.uint8)
    for c in range(k):
        clip = background[c * clip_frames:(c + 1) * clip_frames].astype(np.float32)
        drawn = tuple(m for i, m in marks if i == c)
        out[c] = timestamp(draw_marks(rng, clip, drawn) if drawn else clip.astype(np.uint8), start + c)
    # Older held clips were kept out of minutes of video: positions of evicted clips lie between them; the recent
    # window is contiguous; the first held clip starts anywhere in the stream's range.
    gaps = tuple(int(np.exp(rng.uniform(0, np.log(max_gap * 4)))) if c == 0
                 else 0 if c >= k - recent_clips
                 else int(np.exp(rng.uniform(np.log(min_gap), np.log(max_gap)))) for c in range(k))
    per_clip = geometry.num_video_tokens
    keep: list[np.ndarray | None] = []
    for c in range(k):
        if c >= k - recent_clips:
            keep.append(None)
            continue
        held = rng.random(per_clip) < rng.uniform(0.05, 0.7)
        for i, m in marks:
            if i == c:
                held[m.token_indices(geometry)] = True
        keep.append(np.flatnonzero(held))
    asked = tuple(sorted({int(x) for x in rng.integers(0, k - 1, size=int(rng.integers(0, 3)))})) if k > 1 else ()
    kinds = [kind for kind, n in (("square", squares), ("dot", dots)) if n]
    kind = kinds[int(rng.integers(0, len(kinds)))]
    if forced and k > 1:
        kind = "dot" if marks[-1][1].kind == "square" else "square"
    answer = [m.colour for _, m in marks if m.kind == kind][-1]
    return StreamExample(out, marks, gaps, tuple(keep), asked, kind, answer)


def stream_split(count: int, split: str, **kwargs: Any) -> list[StreamExample]:
    """``count`` examples of split ``split`` (``train``, ``monitor``, ``heldout``)."""
    return [make_stream_example(i, seed=STREAM_SPLIT_SEEDS[split], **kwargs) for i in range(count)]


def stream_text(example: StreamExample) -> str:
    """The transcript the stream holds: clips (one ``<|video_pad|>`` each), earlier questions, the question."""
    t = Transcript()
    parts = []
    for c in range(len(example.clips)):
        parts.append(t.clip())
        if c in example.asked_after:
            parts.append(t.question(STREAM_QUESTIONS["dot" if c % 2 else "square"]))
    parts.append(t.question(example.question))
    return "".join(parts)


@dataclass
class StreamBatch:
    """HF inputs of a right-padded batch: ``inputs_embeds [B, L, H]``, ``position_ids [3, B, L]``,
    ``last_index [B]`` (each row's last prompt token) and ``answer_ids [B]``."""

    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor
    last_index: torch.Tensor
    answer_ids: torch.Tensor


class StreamEncoder:
    """Builds :class:`StreamBatch` es of :class:`StreamExample` s for one tokenizer and model."""

    def __init__(self, tokenizer: Any) -> None:
        from cords_vllm.lab.vqa.hf import HFEncoder

        self.hf = HFEncoder(tokenizer)
        self.tokenizer = tokenizer

    def layout(self, example: StreamExample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [L], positions [3, L], held [L] bool)`` of the whole transcript with every clip expanded;
        ``held`` marks the tokens the stream still holds."""
        from cords_vllm.lab.reference.hf import vllm_mrope_positions
        from cords_vllm.lab.vqa.video import MERGE, PATCH

        geometry = example.geometry
        pad, n = self.hf.video_pad_id, geometry.num_video_tokens
        ids: list[int] = []
        clip_starts: list[int] = []
        for t in self.tokenizer.encode(stream_text(example), add_special_tokens=False):
            if t == pad:
                clip_starts.append(len(ids))
                ids += [pad] * n
            else:
                ids.append(t)
        side = geometry.size // PATCH
        grid = (geometry.num_frames // TEMPORAL_PATCH, side, side)
        positions, _ = vllm_mrope_positions(ids, {pad: [grid] * len(clip_starts)}, MERGE)
        held = torch.ones(len(ids), dtype=torch.bool)
        for c, start in enumerate(clip_starts):
            positions[:, start - 1:] += example.gaps[c]  # from the clip's <|vision_start|> on
            if example.keep[c] is not None:
                held[start:start + n] = False
                held[start + torch.as_tensor(example.keep[c], dtype=torch.long)] = True
        return torch.tensor(ids, dtype=torch.long), positions, held

    def encode(self, model: Any, examples: Sequence[StreamExample]) -> StreamBatch:
        """Embed ``examples`` (one clip geometry) with ``model`` (a ``Qwen2VLForConditionalGeneration``):
        gradients flow through the vision encoder and the embeddings when called outside ``no_grad``."""
        from cords_vllm.lab.vqa.hf import patchify

        layouts = [self.layout(e) for e in examples]
        pixels, grid = patchify(np.concatenate([e.clips for e in examples]))
        features = torch.cat(list(model.model.get_video_features(pixels, grid).pooler_output))
        embed = model.model.get_input_embeddings()
        rows, used = [], 0
        for ids, positions, held in layouts:
            x = embed(ids)
            is_video = ids == self.hf.video_pad_id
            count = int(is_video.sum())
            x = x.masked_scatter(is_video[:, None], features[used:used + count].to(x.dtype))
            used += count
            rows.append((x[held], positions[:, held]))
        length = max(len(x) for x, _ in rows)
        b, hidden = len(rows), rows[0][0].shape[-1]
        embeds = rows[0][0].new_zeros((b, length, hidden))
        pos = torch.zeros((3, b, length), dtype=torch.long)
        for r, (x, p) in enumerate(rows):
            embeds[r, :len(x)] = x
            pos[:, r, :len(x)] = p
            pos[:, r, len(x):] = p[:, -1:] + torch.arange(1, length - len(x) + 1)
        last = torch.tensor([len(x) - 1 for x, _ in rows], dtype=torch.long)
        answers = torch.tensor([self.hf.answer_id(e.answer) for e in examples], dtype=torch.long)
        return StreamBatch(embeds, pos, last, answers)


def stream_logits(model: Any, batch: StreamBatch) -> torch.Tensor:
    """Next-token logits ``float [B, vocab]`` at each row's last prompt token."""
    out = model.model(inputs_embeds=batch.inputs_embeds, position_ids=batch.position_ids, use_cache=False)
    hidden = out.last_hidden_state[torch.arange(len(batch.last_index)), batch.last_index]
    return model.lm_head(hidden)
