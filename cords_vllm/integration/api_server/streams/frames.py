"""Decoding the frames a client appends to a stream: images (JPEG/PNG) or a short clip, into one array.

Pure and synchronous (the API runs it in a worker thread). Every failure is a :class:`FrameError` that names
the offending field (``frames[3]``, ``video``), so the API answers a 4xx saying which input was wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence

import numpy as np

#: Media types accepted for single frames and for clips.
IMAGE_TYPES = ("image/jpeg", "image/png")
VIDEO_TYPES = ("video/jpeg", "video/mp4", "video/webm", "video/x-matroska", "video/quicktime")


class FrameError(ValueError):
    """Frames that cannot be used; ``field`` names the request field (e.g. ``frames[2]``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def parse_data_url(url: str, field: str, allowed: Sequence[str]) -> tuple[str, bytes]:
    """``data:<type>;base64,<payload>`` -> ``(type, bytes)``; the type must be one of ``allowed``.

    For ``video/jpeg`` (vLLM's form for a clip of JPEG frames) the payload is several base64 JPEGs joined by
    commas; the bytes returned are then the raw payload text.
    """
    if not isinstance(url, str) or not url.startswith("data:"):
        raise FrameError(field, "expected a data URL ('data:<media type>;base64,<data>')")
    header, sep, payload = url[5:].partition(",")
    media_type, _, encoding = header.partition(";")
    if not sep or encoding != "base64":
        raise FrameError(field, "expected a base64 data URL ('data:<media type>;base64,<data>')")
    media_type = media_type.lower()
    if media_type not in allowed:
        raise FrameError(field, f"media type {media_type!r} is not supported; use one of {', '.join(allowed)}")
    if media_type == "video/jpeg":
        return media_type, payload.encode()
    return media_type, _b64decode(payload, field)


def _b64decode(payload: str, field: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise FrameError(field, "the data is not valid base64") from None


def decode_image(data: bytes, field: str) -> np.ndarray:
    """One JPEG/PNG image -> ``[H, W, 3]`` uint8 RGB."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise FrameError(field, "the image is empty")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in ("JPEG", "PNG"):
                raise FrameError(field, f"image format {image.format} is not supported; send JPEG or PNG")
            return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError):
        raise FrameError(field, "cannot be decoded as a JPEG or PNG image") from None


def decode_clip(media_type: str, data: bytes, field: str) -> np.ndarray:
    """A short clip -> ``[T, H, W, 3]`` uint8 RGB, every frame of it.

    ``video/jpeg`` is comma-joined base64 JPEGs (vLLM's own form); other types are decoded by vLLM's video
    loader.
    """
    if media_type == "video/jpeg":
        parts = data.decode().split(",")
        return stack_frames([decode_image(_b64decode(p, f"{field}[{i}]"), f"{field}[{i}]")
                             for i, p in enumerate(parts)], field)
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO

    try:
        decoded = VideoMediaIO(ImageMediaIO(), num_frames=-1).load_bytes(data)
    except Exception as exc:  # the loaders raise many types for corrupt input
        raise FrameError(field, f"cannot be decoded as a {media_type} clip ({type(exc).__name__})") from None
    frames = np.asarray(decoded.media[0])
    if frames.ndim != 4 or frames.shape[0] == 0:
        raise FrameError(field, "the clip has no frames")
    return np.ascontiguousarray(frames[..., :3].astype(np.uint8, copy=False))


def stack_frames(frames: Sequence[np.ndarray], field: str) -> np.ndarray:
    """Frames of one push -> ``[T, H, W, 3]``; they must all have the first frame's size."""
    if not frames:
        raise FrameError(field, "no frames were sent")
    shape = frames[0].shape
    for i, frame in enumerate(frames):
        if frame.shape != shape:
            raise FrameError(f"{field}[{i}]", f"frame size {frame.shape[1]}x{frame.shape[0]} differs from the "
                                              f"first frame's {shape[1]}x{shape[0]}; one push has one size")
    return np.stack(frames)


def check_frame_size(frames: np.ndarray, field: str, *, min_side: int, max_pixels: int) -> None:
    """Reject frames smaller than ``min_side`` on a side or larger than ``max_pixels`` pixels."""
    _, height, width, _ = frames.shape
    if min(height, width) < min_side:
        raise FrameError(field, f"frames are {width}x{height}; each side must be at least {min_side} pixels")
    if height * width > max_pixels:
        raise FrameError(field, f"frames are {width}x{height} = {height * width} pixels; at most {max_pixels}")
