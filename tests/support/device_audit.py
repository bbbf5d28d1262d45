"""CPU stand-ins for three CUDA costs: tensors on the wrong device, host synchronisation, and launch count.

* :class:`DeviceAudit` records every tensor factory call (``arange``, ``zeros``, ``full``, ...) that names no
  device. Such a call makes a CPU tensor whatever device the KV cache lives on, which crashes (or silently
  copies) on CUDA. The CPU build cannot see the mix, so the audit makes it visible.
  It also records every host read of a tensor (``item``, ``bool``, ``int``, ``tolist``, ...): each is a
  device-to-host synchronisation on CUDA.
* :class:`HostSyncCounter` counts, at the aten level (a ``TorchDispatchMode``), every op that synchronises the
  host with a CUDA device: scalar reads (``item``, ``int``, ``bool``: ``_local_scalar_dense`` /
  ``is_nonzero``), ops whose output size depends on the data (``nonzero``, ``masked_select``, boolean-mask
  indexing and ``index_put``, ``unique``, ``repeat_interleave`` with tensor repeats) and ``equal``; and, at the
  function level (a ``TorchFunctionMode``, since the dispatcher never sees host data), every blocking
  host-to-device upload made by project code: ``torch.tensor`` / ``as_tensor`` / ``asarray`` / ``from_numpy``
  of host data (on CUDA ``torch.tensor(v, device="cuda")`` is a pageable copy that waits for the stream), and
  ``to`` / ``cuda`` / ``copy_`` of a host-made tensor without ``non_blocking=True``. On CPU the "device" is a
  stand-in: a tensor counts as host-made when project code built it from Python or NumPy data, or drew it
  from a CPU generator. It also counts every aten op (``ops``): each is one kernel launch on CUDA.

Use ``with DeviceAudit() as audit: ...`` and inspect ``audit.undeviced`` / ``audit.syncs`` (call sites), or
``with HostSyncCounter() as count: ...`` and inspect ``count.syncs`` / ``count.uploads`` (call sites) and
``count.ops``.
"""

from __future__ import annotations

import traceback
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import cords_vllm

FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.linspace,
             torch.rand, torch.randn, torch.randint, torch.randperm}
HOST_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy}
PROJECT = "cords_vllm"
PACKAGE_DIR = str(Path(cords_vllm.__file__).resolve().parent)

aten = torch.ops.aten
#: Ops that read a tensor back to the host (CUDA: the host waits for the stream).
SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
                aten.equal.default}
#: Ops whose output size depends on the data (CUDA: the size is read back to the host).
DATA_SIZED = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
              aten._unique2.default, aten.unique_dim.default, aten.repeat_interleave.Tensor,
              aten.repeat_interleave.self_Tensor}
#: Indexing ops that synchronise only when one of their indices is a boolean mask.
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
#: Aten ops that launch no kernel on CUDA: allocations, and views the dispatcher does not tag as such.
NO_LAUNCH = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided,
             aten.lift_fresh, aten.detach, aten.detach_, aten.alias, aten.numpy_T, aten.t, aten.sym_size,
             aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_pinned}
#: Function-level calls that make a tensor from host (Python / NumPy) data.
HOST_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.Tensor.new_tensor}
#: Function-level calls that move a tensor to a device.
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}


def _call_site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if PROJECT in frame.filename.replace("\\", "/").split("/"):
            return f"{frame.filename.rsplit(PROJECT, 1)[-1]}:{frame.lineno} {frame.line}"
    return "<outside the project>"


def _project_site() -> str | None:
    """``/package/path.py:line code`` of the innermost project frame calling torch, ``None`` outside it."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if str(Path(frame.filename).resolve()).startswith(PACKAGE_DIR):
            return f"{frame.filename.rsplit(PROJECT, 1)[-1]}:{frame.lineno} {frame.line}"
    return None


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


def _has_mask_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _SyncDispatch(TorchDispatchMode):
    """The aten half of :class:`HostSyncCounter`: op count and synchronising ops."""

    def __init__(self, owner: HostSyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.owner.ops += 1
        self.owner.op_names.append(func.__name__)
        if not func.is_view and func.overloadpacket not in NO_LAUNCH:
            self.owner.launch_names.append(func.__name__)
        if func in SCALAR_READS or func in DATA_SIZED or (func in MASK_INDEXED and _has_mask_index(args)):
            self.owner.syncs.append(f"{func.__name__} at {_project_site() or '<outside the project>'}")
        return func(*args, **kwargs)


class _UploadFunctions(TorchFunctionMode):
    """The function half of :class:`HostSyncCounter`: blocking uploads and host reads invisible to aten."""

    def __init__(self, owner: HostSyncCounter) -> None:
        super().__init__()
        self.owner = owner
        self.host_made: dict[int, weakref.ref[torch.Tensor]] = {}  # by id: tensors compare elementwise

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in HOST_DATA:
            site = _project_site()
            if site is not None:
                self.owner.uploads.append(f"{func.__name__} at {site}")
        elif func in FACTORIES and isinstance(kwargs.get("generator"), torch.Generator) \
                and kwargs["generator"].device.type == "cpu" and isinstance(out, torch.Tensor) \
                and _project_site() is not None:
            self.host_made[id(out)] = weakref.ref(out)  # drawn on the host: moving it to the device is an upload
        elif func in MOVES and not kwargs.get("non_blocking", False):
            source = args[1] if func is torch.Tensor.copy_ else args[0]
            made = self.host_made.get(id(source))
            if made is not None and made() is source:
                site = _project_site()
                if site is not None:
                    self.owner.uploads.append(f"{func.__name__} at {site}")
        elif func in (torch.Tensor.tolist, torch.Tensor.numpy):  # no aten op reads the data
            site = _project_site()
            if site is not None:
                self.owner.syncs.append(f"{func.__name__} at {site}")
        return out


class HostSyncCounter:
    """Counts host synchronisations, blocking uploads and aten ops inside a ``with`` block (CPU stand-in).

    Attributes
    ----------
    syncs:
        One entry per synchronising op (``"<op> at <package path>:<line> <code>"``).
    uploads:
        One entry per blocking host-to-device upload made by project code.
    ops:
        Aten ops dispatched, views and allocations included, ``op_names`` their names.
    launch_names:
        What launches a kernel on CUDA, in order: every aten op but views and allocations, and every Triton kernel
        run through :meth:`watch_triton` (``"triton:<kernel>"``; what the interpreter does inside is not counted).
    """

    def __init__(self) -> None:
        self.syncs: list[str] = []
        self.uploads: list[str] = []
        self.ops = 0
        self.op_names: list[str] = []
        self.launch_names: list[str] = []
        self._functions = _UploadFunctions(self)
        self._dispatch = _SyncDispatch(self)

    @property
    def launches(self) -> int:
        """Kernel launches on CUDA: :attr:`launch_names`'s length."""
        return len(self.launch_names)

    def watch_triton(self, monkeypatch: Any, *modules: Any) -> None:
        """Count each launch of the kernels that ``modules`` build with their ``compiled(interpret[, kernel])`` as one,
        running it outside the counter (the interpreter's own tensor traffic is not a launch on CUDA)."""
        def run(label: str, kernel: Any, grid: Any, args: tuple, kwargs: dict) -> Any:
            self.launch_names.append(f"triton:{label}")
            with _disable_current_modes():
                return kernel[grid](*args, **kwargs)

        watch_launches(monkeypatch, modules, run)

    def __enter__(self) -> HostSyncCounter:
        self._functions.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._dispatch.__exit__(*exc)
        self._functions.__exit__(*exc)


def watch_launches(monkeypatch: Any, modules: Any, run: Any) -> None:
    """Route every launch ``kernel[grid](*args, **kwargs)`` of the kernels ``modules`` build with their
    ``compiled(interpret[, kernel])`` through ``run(label, kernel, grid, args, kwargs)``, which launches it
    (``label``: ``"<module>[:<kernel>]"``). A module watched again keeps one layer of watching."""
    for module in modules:
        build = getattr(module.compiled, "unwatched", module.compiled)

        def watched(interpret: bool, *which: Any, build: Any = build, name: str = module.__name__) -> Any:
            kernel = build(interpret, *which)
            label = ":".join([name.rsplit(".", 1)[-1], *map(str, which)])

            class _Watched:
                def __getitem__(self, grid: Any) -> Any:
                    return lambda *args, **kwargs: run(label, kernel, grid, args, kwargs)
            return _Watched()

        watched.unwatched = build  # type: ignore[attr-defined]
        monkeypatch.setattr(module, "compiled", watched)
