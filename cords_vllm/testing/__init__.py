"""Test fixtures that need no download: a tiny Qwen2-VL checkpoint and synthetic videos."""

from cords_vllm.testing.synthetic_video import (
    NEEDLE_COLOURS,
    SyntheticVideo,
    encode_mp4,
    jpeg_frames_data_url,
    make_video,
    mp4_data_url,
    video_tokens,
)
from cords_vllm.testing.tiny_model import TinyModelSpec, build_tiny_qwen2vl, default_cache_dir

__all__ = [
    "NEEDLE_COLOURS",
    "SyntheticVideo",
    "TinyModelSpec",
    "build_tiny_qwen2vl",
    "default_cache_dir",
    "encode_mp4",
    "jpeg_frames_data_url",
    "make_video",
    "mp4_data_url",
    "video_tokens",
]
