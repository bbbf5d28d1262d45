"""Deterministic synthetic videos with the structure a KV compressor can exploit.

A video is a sequence of scenes. Each scene has its own smooth background (a two-colour gradient) and a
moving object; some scenes are static stretches (nothing moves), some frames repeat an earlier frame, and
one rare "needle" spans a few frames: a saturated square on a flat background, unlike anything else in
the video. Everything is drawn with numpy from one seed, so the same arguments give the same bytes.

Frames are RGB ``uint8`` arrays ``[T, H, W, 3]``, the layout vLLM and the HF processors accept.
Qwen2-VL merges two consecutive frames into one temporal patch, so structural events (needle, repeats)
are aligned to even frame indices and span ``temporal_patch`` frames.
"""

from __future__ import annotations

import base64
import io
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

NEEDLE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25), "green": (25, 200, 40), "blue": (30, 60, 235), "yellow": (240, 220, 20),
    "magenta": (220, 30, 220), "cyan": (20, 210, 220), "orange": (245, 130, 20), "white": (250, 250, 250),
}


@dataclass(frozen=True)
class SyntheticVideo:
    """A generated video and the ground truth of its structure.

    Attributes
    ----------
    frames:
        ``uint8 [T, H, W, 3]`` RGB frames.
    scene_starts:
        First frame index of each scene.
    static_scenes:
        Indices (into ``scene_starts``) of scenes in which nothing moves.
    repeated_frames:
        ``(frame, source)`` pairs: ``frames[frame]`` is an exact copy of ``frames[source]``.
    needle_frames:
        Frame indices showing the needle (empty if the video has none).
    needle_colour:
        Name of the needle square's colour (a key of :data:`NEEDLE_COLOURS`), or ``None``.
    """

    frames: np.ndarray
    scene_starts: tuple[int, ...]
    static_scenes: tuple[int, ...]
    repeated_frames: tuple[tuple[int, int], ...]
    needle_frames: tuple[int, ...]
    needle_colour: str | None
    fps: float = field(default=2.0)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


def make_video(
    num_frames: int = 32,
    height: int = 224,
    width: int = 224,
    *,
    seed: int = 0,
    scene_length: int = 8,
    static_fraction: float = 0.3,
    repeat_fraction: float = 0.1,
    needle: bool = True,
    needle_position: float | None = None,
    needle_colour: str | None = None,
    temporal_patch: int = 2,
    noise: int = 6,
) -> SyntheticVideo:
    """Generate a deterministic synthetic video.

    Parameters
    ----------
    num_frames, height, width:
        Output shape ``[num_frames, height, width, 3]``; ``num_frames`` must be a positive multiple of
        ``temporal_patch``.
    seed:
        Seed of every random choice; the same arguments always give identical frames.
    scene_length:
        Frames per scene (scenes change background colours and object).
    static_fraction:
        Probability that a scene is static (its object does not move and there is no pixel noise).
    repeat_fraction:
        Fraction of temporal patches replaced by a copy of an earlier patch of the video.
    needle:
        Whether to insert the needle (one temporal patch with a saturated square).
    needle_position:
        Relative position in ``[0, 1)`` of the needle; random when ``None``.
    needle_colour:
        Colour name of the needle square; random when ``None``.
    temporal_patch:
        Frames merged into one temporal patch by the model (2 for Qwen2-VL).
    noise:
        Amplitude of the per-pixel noise in moving scenes.
    """
    _check_video_args(num_frames, height, width, scene_length, static_fraction, repeat_fraction, needle_position,
                      needle_colour, temporal_patch)
    rng = np.random.default_rng(seed)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    scene_starts, static_scenes = _draw_scenes(rng, frames, scene_length, static_fraction, noise)
    repeated = _repeat_patches(rng, frames, repeat_fraction, temporal_patch)
    needle_frames: tuple[int, ...] = ()
    colour_name = None
    if needle:
        needle_frames, colour_name = _draw_needle(rng, frames, needle_position, needle_colour, temporal_patch)
        repeated = [(f, s) for f, s in repeated if f not in needle_frames and s not in needle_frames]

    return SyntheticVideo(frames=frames, scene_starts=scene_starts, static_scenes=static_scenes,
                          repeated_frames=tuple(repeated), needle_frames=needle_frames,
                          needle_colour=colour_name)


def _check_video_args(num_frames: int, height: int, width: int, scene_length: int, static_fraction: float,
                      repeat_fraction: float, needle_position: float | None, needle_colour: str | None,
                      temporal_patch: int) -> None:
    """Raise ``ValueError`` naming the first argument of :func:`make_video` out of its range."""
    if num_frames <= 0 or num_frames % temporal_patch:
        raise ValueError(f"num_frames must be a positive multiple of temporal_patch={temporal_patch}, "
                         f"got {num_frames}")
    if height < 28 or width < 28:
        raise ValueError(f"height and width must be >= 28 pixels, got {height}x{width}")
    if scene_length < temporal_patch:
        raise ValueError(f"scene_length must be >= temporal_patch={temporal_patch}, got {scene_length}")
    for name, value in (("static_fraction", static_fraction), ("repeat_fraction", repeat_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if needle_position is not None and not 0.0 <= needle_position < 1.0:
        raise ValueError(f"needle_position must be in [0, 1), got {needle_position}")
    if needle_colour is not None and needle_colour not in NEEDLE_COLOURS:
        raise ValueError(f"needle_colour must be one of {sorted(NEEDLE_COLOURS)}, got {needle_colour!r}")


def _draw_scenes(rng: np.random.Generator, frames: np.ndarray, scene_length: int, static_fraction: float,
                 noise: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Fill ``frames`` scene by scene: a two-colour gradient background and one object, moving with pixel noise
    unless the scene is static. Returns ``(scene_starts, static_scenes)``."""
    num_frames, height, width, _ = frames.shape
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    ramp = (xx / max(width - 1, 1) + yy / max(height - 1, 1)) / 2.0  # [H, W] in [0, 1]

    scene_starts = tuple(range(0, num_frames, scene_length))
    static_scenes = []
    for s, start in enumerate(scene_starts):
        end = min(start + scene_length, num_frames)
        c0, c1 = rng.integers(40, 200, size=(2, 3))
        background = (c0[None, None, :] * (1 - ramp[..., None]) + c1[None, None, :] * ramp[..., None])
        static = bool(rng.random() < static_fraction)
        if static:
            static_scenes.append(s)
        size = int(rng.integers(max(6, min(height, width) // 10), max(8, min(height, width) // 4)))
        colour = rng.integers(60, 190, size=3)
        y0 = int(rng.integers(0, height - size))
        x0 = int(rng.integers(0, width - size))
        vy, vx = (0, 0) if static else (int(rng.integers(-4, 5)), int(rng.integers(2, 7)))
        for t in range(start, end):
            frame = background.copy()
            k = t - start
            y = (y0 + vy * k) % (height - size)
            x = (x0 + vx * k) % (width - size)
            frame[y:y + size, x:x + size] = colour
            if not static and noise > 0:
                frame += rng.integers(-noise, noise + 1, size=frame.shape)
            frames[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return scene_starts, tuple(static_scenes)


def _repeat_patches(rng: np.random.Generator, frames: np.ndarray, repeat_fraction: float,
                    temporal_patch: int) -> list[tuple[int, int]]:
    """Copy an earlier temporal patch over ``repeat_fraction`` of the later ones, in place; returns the
    ``(frame, source)`` pairs copied."""
    num_patches = len(frames) // temporal_patch
    repeated: list[tuple[int, int]] = []
    n_repeat = round(repeat_fraction * num_patches)
    if n_repeat and num_patches > 1:
        targets = sorted(rng.choice(np.arange(1, num_patches), size=min(n_repeat, num_patches - 1),
                                    replace=False).tolist())
        for p in targets:
            src = int(rng.integers(0, p))
            for j in range(temporal_patch):
                frames[p * temporal_patch + j] = frames[src * temporal_patch + j]
                repeated.append((p * temporal_patch + j, src * temporal_patch + j))
    return repeated


def _draw_needle(rng: np.random.Generator, frames: np.ndarray, needle_position: float | None,
                 needle_colour: str | None, temporal_patch: int) -> tuple[tuple[int, ...], str]:
    """Draw the needle over one temporal patch, in place: a saturated square on flat grey. Returns its frames and
    its colour's name."""
    num_frames, height, width, _ = frames.shape
    num_patches = num_frames // temporal_patch
    pos = rng.random() if needle_position is None else needle_position
    colour_name = needle_colour or str(rng.choice(sorted(NEEDLE_COLOURS)))
    patch = min(int(pos * num_patches), num_patches - 1)
    needle_frames = tuple(range(patch * temporal_patch, (patch + 1) * temporal_patch))
    side = min(height, width) // 2
    y, x = (height - side) // 2, (width - side) // 2
    for t in needle_frames:
        frames[t] = 128
        frames[t, y:y + side, x:x + side] = NEEDLE_COLOURS[colour_name]
    return needle_frames, colour_name


def with_metadata(frames: np.ndarray, fps: float = 2.0, first: int = 0) -> tuple[np.ndarray, dict]:
    """A decoded video as vLLM's offline ``multi_modal_data`` takes it with its times: ``(frames, metadata)``,
    frames ``first .. first + T - 1`` of a ``fps`` camera, none re-sampled. Qwen2.5-VL needs it (its temporal
    positions follow time), Qwen3-VL reads its timestamps from it; Qwen2-VL ignores it."""
    n = len(frames)
    return frames, {"fps": float(fps), "duration": (first + n) / fps, "total_num_frames": first + n,
                    "frames_indices": list(range(first, first + n)), "video_backend": "opencv",
                    "do_sample_frames": False}


def encode_mp4(frames: np.ndarray, fps: float = 2.0) -> bytes:
    """Encode ``uint8 [T, H, W, 3]`` RGB frames as an MP4 (``mp4v``) with OpenCV; returns the file bytes."""
    import cv2

    _check_frames(frames)
    _t, h, w, _ = frames.shape
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (w, h))
        if not writer.isOpened():
            raise RuntimeError("OpenCV could not open an mp4v writer")
        for frame in frames:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def mp4_data_url(frames: np.ndarray, fps: float = 2.0) -> str:
    """``data:video/mp4;base64,...`` URL for an OpenAI ``video_url`` content part."""
    return "data:video/mp4;base64," + base64.b64encode(encode_mp4(frames, fps)).decode()


def jpeg_frames_data_url(frames: np.ndarray, quality: int = 95) -> str:
    """``data:video/jpeg;base64,<jpg>,<jpg>,...``: vLLM's frame-list form, which keeps every frame."""
    from PIL import Image

    _check_frames(frames)
    parts = []
    for frame in frames:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=quality)
        parts.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(parts)


def video_tokens(num_frames: int, height: int, width: int, *, patch: int = 14, merge: int = 2,
                 temporal_patch: int = 2) -> int:
    """Number of Qwen2-VL video tokens for frames already at a size the processor keeps as is.

    ``(T / temporal_patch) * (H / (patch * merge)) * (W / (patch * merge))``; sizes must be multiples of
    ``patch * merge`` (28) for this to be exact.
    """
    unit = patch * merge
    return (num_frames // temporal_patch) * (height // unit) * (width // unit)


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[-1] != 3 \
            or frames.dtype != np.uint8 or frames.shape[0] == 0:
        shape = getattr(frames, "shape", None)
        dtype = getattr(frames, "dtype", None)
        raise ValueError(f"frames must be a non-empty uint8 array [T, H, W, 3], got shape={shape} dtype={dtype}")
