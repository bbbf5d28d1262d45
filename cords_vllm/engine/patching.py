"""One mechanism for every vLLM function the plugin wraps: guarded, signature-checked, idempotent, all or nothing.

vLLM 0.32 has no extension point for evicting tokens from a running request's paged KV cache, nor for a
plugin's command-line flags. Each such change is a :class:`Patch`: a target method, the parameter names it
was written against, what vLLM lacks (``why``) and the upstream patch of ``patches/`` that would make it
unnecessary. :func:`install`:

* resolves every target and checks every signature **before changing anything**: a vLLM whose functions
  differ refuses to start (naming the function) instead of half-patching itself;
* detects the binding (plain, static or class method) with ``inspect.getattr_static`` and re-wraps it
  the same way;
* is **idempotent**: each wrapper carries the :class:`Patch` under one marker attribute, so loading the
  plugin twice in a process changes nothing.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MARKER = "_cords_vllm_patch"


class EngineSignatureError(RuntimeError):
    """A patched vLLM function does not have the signature the plugin was written against."""


@dataclass(frozen=True)
class Patch:
    """One wrapped vLLM method.

    Attributes
    ----------
    target:
        ``"package.module:Class.method"``, or ``"package.module:function"`` for a module-level function
        (called through the module's globals, so replacing the module attribute reaches every caller there).
    params:
        Leading parameter names the wrapped function must have (``self`` / ``cls`` included).
    make:
        ``make(original) -> wrapper``; ``original`` is the plain function (for a class method it takes
        ``cls`` first).
    why:
        What vLLM lacks, in one sentence.
    keywords:
        Parameter names that must exist anywhere in the signature.
    upstream:
        The file of ``patches/`` that makes the same change in vLLM itself, if any.
    """

    target: str
    params: tuple[str, ...]
    make: Callable[[Callable], Callable]
    why: str
    keywords: tuple[str, ...] = ()
    upstream: str | None = None

    def owner(self) -> tuple[Any, str]:
        """The class (or module, for a module-level function) that holds the target, and its name there."""
        module_name, _, path = self.target.partition(":")
        owner_name, _, attr = path.rpartition(".")
        owner: Any = importlib.import_module(module_name)
        for part in filter(None, owner_name.split(".")):
            owner = getattr(owner, part)
        return owner, attr


@dataclass(frozen=True)
class _Resolved:
    patch: Patch
    owner: Any
    attr: str
    kind: type | None  # staticmethod, classmethod or None (plain function)
    function: Callable
    installed: bool


def _resolve(patch: Patch) -> _Resolved:
    owner, attr = patch.owner()
    raw = inspect.getattr_static(owner, attr)
    kind = type(raw) if isinstance(raw, staticmethod | classmethod) else None
    function = raw.__func__ if kind is not None else raw
    installed = getattr(function, MARKER, None) is not None
    original = function.__wrapped__ if installed else function
    got = tuple(inspect.signature(original).parameters)
    if got[: len(patch.params)] != patch.params or not set(patch.keywords) <= set(got):
        raise EngineSignatureError(
            f"cords-vllm: {patch.target}{got} does not match the vLLM 0.32 signature {patch.params} (+ keywords "
            f"{patch.keywords}) it patches; this vLLM build is not supported")
    return _Resolved(patch, owner, attr, kind, original, installed)


def install(patches: Sequence[Patch]) -> None:
    """Install ``patches``: every target is resolved and checked first, then each is wrapped once."""
    resolved = [_resolve(p) for p in patches]
    for r in resolved:
        if r.installed:
            continue
        wrapper = functools.wraps(r.function)(r.patch.make(r.function))
        setattr(wrapper, MARKER, r.patch)
        setattr(r.owner, r.attr, r.kind(wrapper) if r.kind is not None else wrapper)


def installed(patches: Sequence[Patch]) -> list[Patch]:
    """The patches of ``patches`` currently installed."""
    return [r.patch for r in map(_resolve, patches) if r.installed]
