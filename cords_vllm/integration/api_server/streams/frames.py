"""Decoding the frames a client appends to a stream: images (JPEG/PNG) or a short clip, into one array.

Synchronous (the API runs it in a worker thread). Every failure is a :class:`FrameError` that names the offending
field (``frames[3]``, ``video``) and its status, so the API answers a 4xx saying which input was wrong.

A push is read in two stages, so that every limit is checked before the work it bounds:

1. :func:`read_push` reads what the push holds from its headers alone, decoding no frame: the frame count (the
   list's length, a ``video/jpeg`` clip's parts, a container's header read through vLLM's own OpenCV capture), each
   image's size from its header (vLLM's ``VLLM_MAX_IMAGE_PIXELS`` and the stream's frame-size limit), one size for
   the whole push, and the smallest side. The :class:`PushMedia` it returns says how many decoded bytes the push
   will take, and the model's and the engine's rules are checked on it (:mod:`.push_bounds`).
2. :func:`decode_push` decodes the frames into one array allocated once (``[T, H, W, 3]``, no stacked copy),
   and no more frames than the headers declared.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Media types accepted for single frames and for clips.
IMAGE_TYPES = ("image/jpeg", "image/png")
VIDEO_TYPES = ("video/jpeg", "video/mp4", "video/webm", "video/x-matroska", "video/quicktime")


class FrameError(ValueError):
    """Frames that cannot be used; ``field`` names the request field (e.g. ``frames[2]``), ``status`` the HTTP
    status the API answers (400: malformed; 413: past a size limit)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status


@dataclass(frozen=True)
class FrameLimits:
    """What one push may carry: ``max_frames`` frames of at most ``max_pixels`` pixels (``0``: no pixel limit)."""

    max_frames: int
    max_pixels: int


def vllm_max_image_pixels() -> int:
    """vLLM's limit on one image's (or video frame's) pixels, ``VLLM_MAX_IMAGE_PIXELS`` (0: none)."""
    import vllm.envs as envs

    return int(envs.VLLM_MAX_IMAGE_PIXELS)


def _check_pixels(width: int, height: int, field: str, max_pixels: int) -> None:
    if max_pixels > 0 and width * height > max_pixels:
        raise FrameError(field, f"frames are {width}x{height} = {width * height} pixels; at most {max_pixels} (the "
                                "stream's frame-size limit and VLLM_MAX_IMAGE_PIXELS)", 413)


def _check_count(count: int, field: str, max_frames: int) -> None:
    if count > max_frames:
        raise FrameError(field, f"{count} frames in one push; at most {max_frames} (--kv-stream-max-frames)", 413)


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


@contextlib.contextmanager
def _opened_image(data: bytes, field: str, max_pixels: int) -> Iterator[Any]:
    """A JPEG/PNG image opened from its header alone, its format and size (``max_pixels``: 413) checked; every
    failure inside, the decoding of the ``with`` body included, is a :class:`FrameError` naming ``field``."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    if not data:
        raise FrameError(field, "the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size is checked below, first
            image_file = Image.open(io.BytesIO(data))
        with image_file as image:
            if image.format not in ("JPEG", "PNG"):
                raise FrameError(field, f"image format {image.format} is not supported; send JPEG or PNG")
            _check_pixels(*image.size, field, max_pixels)
            yield image
    except Image.DecompressionBombError:  # PIL's own guard, past twice its MAX_IMAGE_PIXELS
        raise FrameError(field, "the image declares more pixels than PIL decodes (a decompression bomb)", 413) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, FrameError):
            raise
        raise FrameError(field, "cannot be decoded as a JPEG or PNG image") from None


def decode_image(data: bytes, field: str, max_pixels: int = 0) -> np.ndarray:
    """One JPEG/PNG image -> ``[H, W, 3]`` uint8 RGB; its size is read from the header and checked against
    ``max_pixels`` (413) before anything is decoded."""
    with _opened_image(data, field, max_pixels) as image:
        return np.asarray(image.convert("RGB"))


def decode_clip(media_type: str, data: bytes, field: str, limits: FrameLimits | None = None) -> np.ndarray:
    """A short clip -> ``[T, H, W, 3]`` uint8 RGB, every frame of it.

    ``video/jpeg`` is comma-joined base64 JPEGs (vLLM's own form): its parts are counted before any is decoded.
    Other types are decoded by vLLM's video loader once the container's header has said how many frames of what
    size it holds (:func:`clip_header`), and no more frames than it declared are decoded.
    """
    limits = limits or FrameLimits(max_frames=1 << 30, max_pixels=0)
    if media_type == "video/jpeg":
        _check_count(data.count(b",") + 1, field, limits.max_frames)
        parts = data.decode().split(",")
        return stack_frames([decode_image(_b64decode(p, f"{field}[{i}]"), f"{field}[{i}]", limits.max_pixels)
                             for i, p in enumerate(parts)], field)
    count, width, height = clip_header(data, media_type, field)
    _check_count(count, field, limits.max_frames)
    _check_pixels(width, height, field, limits.max_pixels)
    return _decode_container(media_type, data, field, count, limits)


def _decode_container(media_type: str, data: bytes, field: str, count: int, limits: FrameLimits) -> np.ndarray:
    """The frames of a container clip whose header declared ``count`` (and no more) by vLLM's video loader."""
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO

    try:
        decoded = VideoMediaIO(ImageMediaIO(), num_frames=count).load_bytes(data)
    except Exception as exc:  # the loaders raise many types for corrupt input
        raise FrameError(field, f"cannot be decoded as a {media_type} clip ({type(exc).__name__})") from None
    frames = np.asarray(decoded.media[0])
    if frames.ndim != 4 or frames.shape[0] == 0:
        raise FrameError(field, "the clip has no frames")
    _check_count(len(frames), field, limits.max_frames)
    _check_pixels(frames.shape[2], frames.shape[1], field, limits.max_pixels)
    return np.ascontiguousarray(frames[..., :3].astype(np.uint8, copy=False))


def clip_header(data: bytes, media_type: str, field: str) -> tuple[int, int, int]:
    """``(frames, width, height)`` a container clip declares, read by OpenCV's stream capture on vLLM's backend
    without decoding a frame. A clip that does not declare its frame count is refused (400): its decoding could not
    be bounded."""
    import cv2
    from vllm.multimodal.video_decoders.opencv import OpenCVVideoBackendMixin

    source = io.BytesIO(data)  # referenced here while the capture reads it (OpenCV keeps no reference)
    try:
        capture = cv2.VideoCapture(source, OpenCVVideoBackendMixin.get_cv2_video_api(), [])
        if not capture.isOpened():
            raise ValueError("could not open the stream")
    except Exception as exc:
        raise FrameError(field, f"cannot be decoded as a {media_type} clip ({type(exc).__name__})") from None
    try:
        count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    finally:
        capture.release()
    if count <= 0:
        raise FrameError(field, f"the {media_type} clip does not declare its frame count; send its frames as "
                                "images or a clip whose header says how many frames it holds")
    return count, width, height


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


# ------------------------------------------------------------------------------------------------------
# A push, read from its headers, then decoded


@dataclass(frozen=True)
class PushMedia:
    """What one push holds, read from its headers before any frame is decoded.

    ``field`` is the request field (``frames`` or ``video``); every frame is ``width`` x ``height``. ``images``
    holds each image's bytes and field (``frames`` and ``video/jpeg`` clips), ``clip`` a container clip's media
    type and bytes.
    """

    field: str
    count: int
    width: int
    height: int
    images: tuple[tuple[bytes, str], ...] = ()
    clip: tuple[str, bytes] | None = None

    @property
    def decoded_bytes(self) -> int:
        """The bytes the decoded frames take (``[T, H, W, 3]`` uint8)."""
        return self.count * self.width * self.height * 3


def image_size(data: bytes, field: str, max_pixels: int = 0) -> tuple[int, int]:
    """``(width, height)`` of a JPEG/PNG image, read from its header alone; ``max_pixels`` checked (413)."""
    with _opened_image(data, field, max_pixels) as image:
        return image.size


def read_push(items: Sequence[Any], clip: Any, limits: FrameLimits, min_side: int = 1) -> PushMedia:
    """Read a push from its headers: ``items`` (uploaded ``(bytes, field)`` pairs, or data URLs / OpenAI
    ``image_url`` parts) or one ``clip`` (an uploaded ``(bytes, media type)`` pair, or a data URL).

    Checked, in order, each before the work it bounds: the frame count (413), each frame's pixels (413, naming the
    frame), one size for every frame (400, naming the first that differs), the smallest side (400). No frame is
    decoded.
    """
    if items:
        _check_count(len(items), "frames", limits.max_frames)
        images = []
        for i, item in enumerate(items):
            if isinstance(item, tuple):  # an uploaded file: (bytes, field)
                images.append(item)
            else:
                _, data = parse_data_url(image_url(item), f"frames[{i}]", IMAGE_TYPES)
                images.append((data, f"frames[{i}]"))
        return _image_push("frames", images, limits, min_side)
    if isinstance(clip, tuple):
        data, media_type = clip
        media_type = media_type if media_type in VIDEO_TYPES else "video/mp4"
    else:
        media_type, data = parse_data_url(clip, "video", VIDEO_TYPES)
    if media_type == "video/jpeg":
        _check_count(data.count(b",") + 1, "video", limits.max_frames)
        parts = data.decode().split(",")
        return _image_push("video", [(_b64decode(p, f"video[{i}]"), f"video[{i}]") for i, p in enumerate(parts)],
                           limits, min_side)
    count, width, height = clip_header(data, media_type, "video")
    _check_count(count, "video", limits.max_frames)
    _check_pixels(width, height, "video", limits.max_pixels)
    _check_side(width, height, "video", min_side)
    return PushMedia("video", count, width, height, clip=(media_type, data))


def _image_push(field: str, images: list[tuple[bytes, str]], limits: FrameLimits, min_side: int) -> PushMedia:
    width = height = 0
    for i, (data, name) in enumerate(images):
        size = image_size(data, name, limits.max_pixels)
        if i == 0:
            width, height = size
        elif size != (width, height):
            raise FrameError(name, f"frame size {size[0]}x{size[1]} differs from the first frame's {width}x{height}; "
                                   "one push has one size")
    if not images:
        raise FrameError(field, "no frames were sent")
    _check_side(width, height, field, min_side)
    return PushMedia(field, len(images), width, height, images=tuple(images))


def _check_side(width: int, height: int, field: str, min_side: int) -> None:
    if min(width, height) < min_side:
        raise FrameError(field, f"frames are {width}x{height}; each side must be at least {min_side} pixels")


def decode_push(media: PushMedia, max_pixels: int = 0) -> np.ndarray:
    """The push's frames, ``[T, H, W, 3]`` uint8, decoded into one array allocated once; a frame whose decoded size
    is not its header's is refused (400)."""
    if media.clip is not None:
        media_type, data = media.clip  # its header was read and checked by read_push
        frames = _decode_container(media_type, data, media.field, media.count, FrameLimits(media.count, max_pixels))
        if frames.shape[1:3] != (media.height, media.width):
            raise FrameError(media.field, f"decoded frames are {frames.shape[2]}x{frames.shape[1]}, the header "
                                          f"declared {media.width}x{media.height}")
        return frames
    out = np.empty((media.count, media.height, media.width, 3), np.uint8)
    for i, (data, field) in enumerate(media.images):
        frame = decode_image(data, field, max_pixels)
        if frame.shape != out.shape[1:]:
            raise FrameError(field, f"decoded as {frame.shape[1]}x{frame.shape[0]}, its header declared "
                                    f"{media.width}x{media.height}")
        out[i] = frame
        del frame
    return out


def image_url(item: str | dict[str, Any]) -> Any:
    """The URL of a frame given as a string or as an OpenAI ``image_url`` content part."""
    if isinstance(item, dict):
        part = item.get("image_url", item)
        return part.get("url") if isinstance(part, dict) else part
    return item
