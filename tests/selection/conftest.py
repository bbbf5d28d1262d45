"""Run these tests with one intra-op thread.

The selection/metrics tests use tiny tensors; on a shared 2-core machine torch's OpenMP threads wait
on each other behind other processes and small ops get ~100x slower. The setting holds for one test
module and is restored after it, so other test directories keep their own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
