"""Inputs that need no download: tiny Qwen-VL checkpoints, synthetic videos and synthetic KV caches.

The demo, the benchmarks, the examples and the tests all build on these. :mod:`cords_vllm.lab.synthetic.kv`
(which needs torch) is not re-exported here; import :func:`cords_vllm.lab.synthetic.kv.make_synthetic_kv` from it.
"""

from cords_vllm.lab.synthetic.tiny_model import TinyModelSpec, build_tiny_model, build_tiny_qwen2vl, default_cache_dir
from cords_vllm.lab.synthetic.video import (
    NEEDLE_COLOURS,
    SyntheticVideo,
    encode_mp4,
    jpeg_frames_data_url,
    make_video,
    mp4_data_url,
    video_tokens,
)

__all__ = [
    "NEEDLE_COLOURS",
    "SyntheticVideo",
    "TinyModelSpec",
    "build_tiny_model",
    "build_tiny_qwen2vl",
    "default_cache_dir",
    "encode_mp4",
    "jpeg_frames_data_url",
    "make_video",
    "mp4_data_url",
    "video_tokens",
]
