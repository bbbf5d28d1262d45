"""Running a block of PyTorch code with a given number of intra-op threads.

Greedy selection is a long chain of small ops. With several OpenMP threads each op waits for every thread,
and a core busy with another process stalls the whole chain (measured on a 2-core machine: 0.09 s with one
thread vs 3 s with two for 4 x 768 tokens). Selection therefore runs with one thread by default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run a block with ``n`` intra-op threads, then restore the previous count (``n <= 0``: unchanged).

    Uses torch's underlying setter: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op once
    its threads are bound to cores. Compression runs synchronously before the forward, which gets its thread
    count back.
    """
    previous = torch.get_num_threads()
    if n <= 0 or n == previous:
        yield
        return
    torch._C.set_num_threads(n)
    try:
        yield
    finally:
        torch._C.set_num_threads(previous)
