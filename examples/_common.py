"""Shared bits of the examples: the model to use and how to read a video file into frames."""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # examples never download; pass a local path or a cached model


def model_or_tiny(model: str | None) -> str:
    """``model`` if given (e.g. ``Qwen/Qwen2-VL-7B-Instruct``), else the tiny local test model."""
    if model:
        return model
    from cords_vllm.lab.synthetic import build_tiny_qwen2vl

    return str(build_tiny_qwen2vl())


def read_video(path: str, max_frames: int | None = None) -> np.ndarray:
    """Decode a video file into ``uint8 [T, H, W, 3]`` RGB frames (OpenCV); T is made even for Qwen2-VL."""
    import cv2

    capture = cv2.VideoCapture(path)
    frames = []
    while max_frames is None or len(frames) < max_frames:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    capture.release()
    if len(frames) < 2:
        raise ValueError(f"{path}: could not decode at least two frames (is it a video file?)")
    return np.stack(frames[: len(frames) // 2 * 2])
