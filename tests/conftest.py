"""Shared fixtures: offline environment, the tiny Qwen2-VL checkpoint, synthetic videos."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines in tests
# The project's Triton kernels run under Triton's CPU interpreter where no GPU is (the tests ask for them with
# kernels="triton"). Triton decides per @jit function when its module is imported, so this precedes every import
# of Triton; the engine never runs a kernel on CPU ("auto" picks the PyTorch path there).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cords_vllm.integration.inprocess import llm as inprocess_llm
from cords_vllm.integration.inprocess.heap import settle, settle_if_thawed
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_qwen2vl
from cords_vllm.threads import intra_op_threads

#: Test directories of pure-torch code on tiny tensors, run with one intra-op thread (see cords_vllm.threads).
ONE_THREAD_DIRS = ("selection", "metrics", "compress")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Before a test's fixtures start an engine, the heap the last one thawed is settled
    (:mod:`cords_vllm.integration.inprocess.heap`: five full collections of the whole heap per engine were more
    than half of a short engine test)."""
    settle_if_thawed()
    yield


@pytest.fixture
def make_llm() -> Iterator[Callable[..., Any]]:
    """:func:`cords_vllm.integration.inprocess.llm.make_llm`, and the heap settled after the test, whose engines are
    dropped with it (:func:`~cords_vllm.integration.inprocess.heap.settle`: what they left collected once, what
    survives frozen, before the next test starts one). A test that starts another engine after dropping one settles
    between the two itself."""
    yield inprocess_llm.make_llm
    settle()


@pytest.fixture(autouse=True, scope="module")
def _pure_torch_threads(request) -> Iterator[None]:
    if Path(str(request.fspath)).parent.name in ONE_THREAD_DIRS:
        with intra_op_threads(1):
            yield
    else:
        yield


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Directory of the default tiny Qwen2-VL (built once per machine, then cached)."""
    return str(build_tiny_qwen2vl(TinyModelSpec()))


#: The rotary range of :func:`short_range_model`: a stream reaches it in about a hundred 4-frame pushes.
SHORT_RANGE = 1024


@pytest.fixture(scope="session")
def short_range_model() -> str:
    """The tiny Qwen2-VL with a rotary range of :data:`SHORT_RANGE` positions (``max_position_embeddings``)."""
    return str(build_tiny_qwen2vl(TinyModelSpec(max_position_embeddings=SHORT_RANGE)))
