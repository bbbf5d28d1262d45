"""Small device counts the host reads a compression later, without waiting for the device.

A frame compression's size (how many frames its region holds) follows from which frames earlier compressions kept,
decided on the device. Reading it back where it is needed stops the host until the device has done everything queued
before it: on CUDA one host sync per compression, and the host cannot queue the rest of the step meanwhile. The fused
step (:mod:`~cords_vllm.compress.step_triton`) instead writes what the *next* compression needs to know (an upper
bound, the label runs of the tokens the region keeps) at the end of each compression, and copies it to host memory
asynchronously; the next compression, an engine step or more later, reads the copy, long complete by then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class LateRead:
    """Device counts on their way to the host: ``host`` (``int32 [P]``; on CUDA pinned host memory filled by a
    non-blocking copy, ``done`` the event after it; on a CPU device the counts themselves, ``done`` ``None``)."""

    host: torch.Tensor
    done: torch.cuda.Event | None

    @classmethod
    def of(cls, counts: torch.Tensor) -> LateRead:
        """Start copying ``counts`` (a device tensor the caller writes no more) to the host; returns at once."""
        if counts.device.type != "cuda":
            return cls(counts, None)
        host = torch.empty(counts.shape, dtype=counts.dtype, device="cpu", pin_memory=True)
        host.copy_(counts, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(host, done)

    def values(self) -> list[int]:
        """The counts. Waits for the copy only if it has not completed (it was queued a compression ago)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()
