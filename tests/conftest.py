"""Shared fixtures: offline environment, the tiny Qwen2-VL checkpoint, synthetic videos."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines in tests

import pytest

from cords_vllm.testing import TinyModelSpec, build_tiny_qwen2vl


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Directory of the default tiny Qwen2-VL (built once per machine, then cached)."""
    return str(build_tiny_qwen2vl(TinyModelSpec()))
