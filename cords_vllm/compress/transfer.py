"""Host-to-device transfer of a step's small index arrays: one buffer, one non-blocking copy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``long`` device copies of host integer ``arrays`` (shapes kept), in one non-blocking transfer.

    The arrays are packed into one ``int64`` host buffer (pinned when ``device`` is CUDA, so the copy is
    asynchronous and never synchronises the stream) and split on the device into views.
    """
    sizes = [int(np.size(a)) for a in arrays]
    buffer = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]) if arrays else \
        np.empty(0, dtype=np.int64)
    host = torch.from_numpy(buffer)
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True) if device != host.device else host
    out, offset = [], 0
    for array, size in zip(arrays, sizes, strict=True):
        out.append(packed[offset: offset + size].view(np.shape(array)))
        offset += size
    return out
