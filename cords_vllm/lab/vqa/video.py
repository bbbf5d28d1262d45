"""Rendering of the synthetic needle videos: redundant backgrounds plus rare, salient marks.

A video is ``uint8 [T, S, S, 3]`` RGB. The background is deliberately redundant, the kind of content a KV
compressor should be able to drop: a near-gray linear gradient with a slight tint, a few gray shapes that
drift slowly and bounce off the borders, and pixel noise drawn from a fixed bank. On top of it, a task
draws a few :class:`Mark` s: saturated squares shown for one temporal patch, whole-frame colour flashes,
or a small dot that stays for the whole video. Everything is drawn from a ``numpy.random.Generator``, so
the same generator state gives the same bytes.

Qwen2-VL merges ``TEMPORAL_PATCH = 2`` consecutive frames into one temporal patch and ``MERGE x MERGE``
patches of ``PATCH x PATCH`` pixels into one token, so a frame of ``S x S`` pixels (``S`` a multiple of
28, kept as is by the processor) gives ``(S / 28) ** 2`` tokens per temporal patch, and marks are aligned to
temporal patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from cords_vllm.utils import cdiv

#: Pixels per side of a vision patch, frames per temporal patch and the spatial merge of Qwen2-VL.
PATCH = 14
TEMPORAL_PATCH = 2
MERGE = 2
#: Pixels per side of the image region one video token covers.
TOKEN_PIXELS = PATCH * MERGE

#: Saturated colours of the marks (the background is near-gray). Names are single answer tokens.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 230), "yellow": (230, 220, 30),
    "cyan": (30, 210, 220), "magenta": (220, 30, 220), "orange": (250, 140, 20), "purple": (130, 40, 200),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)

MarkKind = Literal["square", "flash", "dot"]


@dataclass(frozen=True)
class VideoGeometry:
    """Frame count and frame size of a task's videos.

    Attributes
    ----------
    num_frames:
        ``T``, a positive multiple of :data:`TEMPORAL_PATCH`.
    size:
        ``S``, the side of the square frames in pixels, a multiple of :data:`TOKEN_PIXELS` (28), so the
        Qwen2-VL processor keeps frames as they are (the shipped processor keeps sizes from 56x56 to
        224x224 unchanged).
    """

    num_frames: int = 64
    size: int = 112

    def __post_init__(self) -> None:
        if self.num_frames <= 0 or self.num_frames % TEMPORAL_PATCH:
            raise ValueError(f"num_frames must be a positive multiple of {TEMPORAL_PATCH}, "
                             f"got {self.num_frames}")
        if self.size <= 0 or self.size % TOKEN_PIXELS:
            raise ValueError(f"size must be a positive multiple of {TOKEN_PIXELS}, got {self.size}")

    @property
    def num_patches(self) -> int:
        """Temporal patches ``T / 2``."""
        return self.num_frames // TEMPORAL_PATCH

    @property
    def grid_side(self) -> int:
        """Tokens per side of one temporal patch, ``S / 28``."""
        return self.size // TOKEN_PIXELS

    @property
    def tokens_per_patch(self) -> int:
        """Video tokens of one temporal patch, ``(S / 28) ** 2``."""
        return self.grid_side ** 2

    @property
    def num_video_tokens(self) -> int:
        """Video tokens of the whole video, ``(T / 2) * (S / 28) ** 2`` (after the spatial merge)."""
        return self.num_patches * self.tokens_per_patch

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        """``(t, h, w)`` grid of the video tokens as the language model sees them (after the merge)."""
        return self.num_patches, self.grid_side, self.grid_side


@dataclass(frozen=True)
class Mark:
    """One salient element drawn over the background.

    Attributes
    ----------
    kind:
        ``"square"`` (a saturated square), ``"flash"`` (the whole frame tinted towards the colour) or
        ``"dot"`` (a small saturated disc).
    colour:
        A key of :data:`COLOURS`.
    patch_start, patch_stop:
        Temporal patches ``[patch_start, patch_stop)`` the mark is shown in (frames
        ``[2 * patch_start, 2 * patch_stop)``).
    box:
        ``(y0, x0, y1, x1)`` pixel bounds (exclusive end) of the mark in each frame; the whole frame for a
        flash.
    """

    kind: MarkKind
    colour: str
    patch_start: int
    patch_stop: int
    box: tuple[int, int, int, int]

    @property
    def frames(self) -> range:
        """Frame indices showing the mark."""
        return range(self.patch_start * TEMPORAL_PATCH, self.patch_stop * TEMPORAL_PATCH)

    def position(self, geometry: VideoGeometry) -> float:
        """Relative temporal position in ``[0, 1)`` of the mark's first temporal patch."""
        return self.patch_start / geometry.num_patches

    def token_span(self, geometry: VideoGeometry) -> tuple[int, int]:
        """``[start, stop)`` of the video tokens (indices into the video's token block) of every temporal
        patch the mark is shown in, including tokens the mark does not touch."""
        return self.patch_start * geometry.tokens_per_patch, self.patch_stop * geometry.tokens_per_patch

    def token_indices(self, geometry: VideoGeometry) -> list[int]:
        """Indices into the video's token block of the tokens whose 28x28 region overlaps the mark's box, in
        every temporal patch it is shown in (sorted). For a flash: all tokens of its patches."""
        y0, x0, y1, x1 = self.box
        g = geometry.grid_side
        rows = range(y0 // TOKEN_PIXELS, min(g, cdiv(y1, TOKEN_PIXELS)))
        cols = range(x0 // TOKEN_PIXELS, min(g, cdiv(x1, TOKEN_PIXELS)))
        per_patch = [r * g + c for r in rows for c in cols]
        return [p * geometry.tokens_per_patch + i for p in range(self.patch_start, self.patch_stop)
                for i in per_patch]


@lru_cache(maxsize=8)
def noise_bank(size: int, count: int = 64, seed: int = 1234) -> np.ndarray:
    """A fixed bank of standard-normal noise frames ``float32 [count, size, size, 3]`` (read-only)."""
    bank = np.random.default_rng(seed).standard_normal((count, size, size, 3), dtype=np.float32)
    bank.setflags(write=False)
    return bank


def render_background(rng: np.random.Generator, geometry: VideoGeometry, *, num_shapes: int = 2,
                      noise: float = 6.0) -> np.ndarray:
    """Draw a redundant background video.

    Returns ``float32 [T, S, S, 3]`` in ``[0, 255]`` (not yet clipped or quantised): a gray gradient with
    a slight tint, ``num_shapes`` gray discs or boxes drifting by at most ~1.2 px per frame, and pixel noise
    of standard deviation ``noise`` (frames picked, with random flips, from a fixed bank).
    """
    t_count, s = geometry.num_frames, geometry.size
    yy, xx = np.mgrid[0:s, 0:s].astype(np.float32)
    level, slope_x, slope_y = rng.uniform(60, 160), rng.uniform(-40, 40), rng.uniform(-40, 40)
    gradient = level + slope_x * xx / s + slope_y * yy / s                       # [S, S]
    tint = 1.0 + rng.uniform(-0.04, 0.04, size=3).astype(np.float32)             # [3]
    video = np.empty((t_count, s, s, 3), np.float32)
    video[:] = gradient[None, :, :, None] * tint
    t = np.arange(t_count, dtype=np.float32)[:, None]
    for _ in range(num_shapes):
        gray = rng.uniform(20, 235)
        radius = rng.uniform(8, 18)
        start = rng.uniform(0, s, size=2)
        velocity = rng.uniform(-1.2, 1.2, size=2)
        span = s - 2 * radius
        centre = start[None, :] + velocity[None, :] * t                          # [T, 2]
        centre = np.abs((centre - radius) % (2 * span) - span) + radius          # bounce inside the frame
        cy, cx = centre[:, 0, None, None], centre[:, 1, None, None]              # [T, 1, 1]
        if rng.random() < 0.5:
            inside = (yy[None] - cy) ** 2 + (xx[None] - cx) ** 2 <= radius ** 2  # [T, S, S] disc
        else:
            inside = (np.abs(yy[None] - cy) <= radius) & (np.abs(xx[None] - cx) <= 0.7 * radius)
        video[inside] = gray
    if noise > 0:
        bank = noise_bank(s)
        frames = bank[rng.integers(0, len(bank), size=t_count)]
        if rng.random() < 0.5:
            frames = frames[:, ::-1]
        if rng.random() < 0.5:
            frames = frames[:, :, ::-1]
        video += noise * frames
    return video


def random_box(rng: np.random.Generator, size: int, side_range: tuple[int, int]) -> tuple[int, int, int, int]:
    """A random square ``(y0, x0, y1, x1)`` with side in ``side_range`` (inclusive) inside a ``size``
    square frame."""
    side = int(rng.integers(side_range[0], side_range[1] + 1))
    y0 = int(rng.integers(0, size - side + 1))
    x0 = int(rng.integers(0, size - side + 1))
    return y0, x0, y0 + side, x0 + side


def draw_marks(rng: np.random.Generator, video: np.ndarray, marks: tuple[Mark, ...]) -> np.ndarray:
    """Draw ``marks`` over a background ``float32 [T, S, S, 3]`` and return ``uint8 [T, S, S, 3]``.

    Each mark's colour is jittered by up to +-20 per channel. Squares are drawn flat; flashes blend the
    frames 25 / 75 with the colour; dots are discs inscribed in their box. Marks are drawn in order.
    """
    s = video.shape[1]
    yy, xx = np.mgrid[0:s, 0:s]
    for mark in marks:
        colour = np.asarray(COLOURS[mark.colour], np.float32) + rng.uniform(-20, 20, size=3)
        frames = slice(mark.frames.start, mark.frames.stop)
        y0, x0, y1, x1 = mark.box
        if mark.kind == "flash":
            video[frames] = 0.25 * video[frames] + 0.75 * colour
        elif mark.kind == "square":
            video[frames, y0:y1, x0:x1] = colour
        elif mark.kind == "dot":
            cy, cx, r = (y0 + y1 - 1) / 2, (x0 + x1 - 1) / 2, (y1 - y0) / 2
            inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            video[frames, inside] = colour
        else:  # pragma: no cover - guarded by the Literal type
            raise ValueError(f"unknown mark kind {mark.kind!r}")
    np.clip(video, 0, 255, out=video)
    return video.astype(np.uint8)
