"""Which implementation runs the compress step's hot loops: Triton kernels or the PyTorch reference.

Two implementations sit behind the same functions (:func:`~cords_vllm.selection.cords.cords_greedy`,
:func:`~cords_vllm.compress.step.compress_region`):

* ``"torch"``: the PyTorch code, the reference, and what runs on CPU;
* ``"triton"``: Triton kernels beside it (:mod:`cords_vllm.selection.cords_triton`,
  :mod:`cords_vllm.compress.copy_triton`) that keep the same tokens with a fixed, small number of launches.

The choice (:data:`CHOICES`) comes from ``kv_policy_config`` key ``kernels`` (the worker sets it for its
compressions with :func:`kernels_in_force`), else from the environment variable :data:`ENV`, else ``"auto"``: Triton
on a CUDA device of compute capability 8.0 or newer when Triton imports, PyTorch elsewhere. ``"triton"`` forces the
kernels (on a CPU tensor only under ``TRITON_INTERPRET=1``, how the tests run them); ``"torch"`` forces the
reference.

Every kernel launch goes through :func:`launch`, which :func:`recording` can note: the start-up warm-up
(:mod:`cords_vllm.compress.kernel_warmup`) records a small compression's launches and compiles them again at every
width the server's compressions can take. No vLLM import.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

#: The environment variable that picks the implementation when no configuration does.
ENV = "CORDS_VLLM_KERNELS"
#: Accepted values of :data:`ENV` and of ``kv_policy_config`` key ``kernels``.
CHOICES: tuple[str, ...] = ("auto", "triton", "torch")

#: The oldest CUDA compute capability ``auto`` runs the kernels on (Triton's fully supported range starts there).
MIN_CAPABILITY = (8, 0)

_IN_FORCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("cords_vllm_kernels", default=None)


def check_choice(value: object, source: str) -> str:
    """``value`` if it is one of :data:`CHOICES`; ``ValueError`` naming ``source`` otherwise."""
    if value not in CHOICES:
        raise ValueError(f"{source} must be one of {', '.join(CHOICES)}, got {value!r}")
    return str(value)


def requested() -> str:
    """The choice in force: :func:`kernels_in_force`'s, else :data:`ENV`'s, else ``"auto"``."""
    value = _IN_FORCE.get()
    if value is not None:
        return value
    return check_choice(os.environ.get(ENV, "auto") or "auto", ENV)


@contextlib.contextmanager
def kernels_in_force(choice: str | None) -> Iterator[None]:
    """Run the block with ``choice`` (one of :data:`CHOICES`; ``None``: leave the current one)."""
    if choice is None:
        yield
        return
    token = _IN_FORCE.set(check_choice(choice, "kernels"))
    try:
        yield
    finally:
        _IN_FORCE.reset(token)


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed and imports."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capable(device: torch.device) -> bool:
    """Whether ``auto`` may run the kernels on ``device``: a CUDA device of :data:`MIN_CAPABILITY` or newer."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= MIN_CAPABILITY


def use_triton(device: torch.device) -> bool:
    """Whether work on ``device`` runs the Triton kernels.

    Raises ``RuntimeError`` when ``"triton"`` is forced where it cannot run (no Triton; a CPU tensor outside the
    interpreter), rather than fall back silently.
    """
    choice = requested()
    if choice == "torch":
        return False
    runnable = triton_available() and (device.type == "cuda" or (device.type == "cpu" and interpreting()))
    if choice == "triton" and not runnable:
        why = "Triton is not installed" if not triton_available() else \
            f"tensors on {device.type} need CUDA (or TRITON_INTERPRET=1 on CPU)"
        raise RuntimeError(f"cords-vllm kernels 'triton' were asked for, but {why}")
    return runnable if choice == "triton" else runnable and capable(device)


def describe(device: torch.device) -> str:
    """One line for the start-up log: which implementation runs on ``device``, and why."""
    choice = requested()
    source = "kv_policy_config 'kernels'" if _IN_FORCE.get() is not None else (
        ENV if os.environ.get(ENV) else "default")
    if use_triton(device):
        return f"Triton kernels (kernels={choice}, from {source})"
    if choice == "torch":
        why = "forced"
    elif not triton_available():
        why = "Triton is not installed"
    elif device.type == "cuda":
        why = f"compute capability below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    else:
        why = f"no kernels for {device.type}"
    return f"PyTorch reference ({why}; kernels={choice}, from {source})"


@dataclass(frozen=True)
class Launch:
    """One kernel launch, ``kernel[grid](*args, **kwargs)``: ``name`` says which kernel (``"plan"``, ``"units"``,
    ``"finish"``, ``"normalize"``, ``"greedy"``, ``"copy"``); ``kernel`` is Triton's jitted function."""

    name: str
    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]


_RECORDING: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar("cords_vllm_launches", default=None)


def launch(name: str, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``, noted as :class:`Launch` ``name`` inside :func:`recording`."""
    recorded = _RECORDING.get()
    if recorded is not None:
        recorded.append(Launch(name, kernel, grid, args, kwargs))
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """The block's kernel launches, in order, as :class:`Launch` records (they still run)."""
    recorded: list[Launch] = []
    token = _RECORDING.set(recorded)
    try:
        yield recorded
    finally:
        _RECORDING.reset(token)
