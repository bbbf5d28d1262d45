"""CPU stand-ins for two CUDA failure modes: tensors created on the wrong device, and host synchronisation.

* :class:`DeviceAudit` records every tensor factory call (``arange``, ``zeros``, ``full``, ...) that names no
  device. Such a call makes a CPU tensor whatever device the KV cache lives on, which crashes (or silently
  copies) on CUDA. The CPU build cannot see the mix, so the audit makes it visible.
* It also records every host read of a tensor (``item``, ``bool``, ``int``, ``tolist``, ...): each is a
  device-to-host synchronisation on CUDA.

Use ``with DeviceAudit() as audit: ...`` and inspect ``audit.undeviced`` / ``audit.syncs`` (call sites).
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.linspace,
             torch.rand, torch.randn, torch.randint, torch.randperm}
HOST_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy}
PROJECT = "cords_vllm"


def _call_site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if PROJECT in frame.filename.replace("\\", "/").split("/"):
            return f"{frame.filename.rsplit(PROJECT, 1)[-1]}:{frame.lineno} {frame.line}"
    return "<outside the project>"


class DeviceAudit(TorchFunctionMode):
    """Records device-less tensor factories and host reads made by project code."""

    def __init__(self) -> None:
        super().__init__()
        self.undeviced: list[str] = []
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            site = _call_site()
            if site != "<outside the project>":
                self.undeviced.append(site)
        elif func in HOST_READS:
            site = _call_site()
            if site != "<outside the project>":
                self.syncs.append(site)
        return func(*args, **kwargs)
