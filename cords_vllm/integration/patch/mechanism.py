"""One mechanism for every vLLM function the plugin wraps or relies on: signature-checked, idempotent, all or
nothing.

vLLM 0.32 has no extension point for evicting tokens from a running request's paged KV cache, nor for a
plugin's command-line flags. The plugin's whole contract with vLLM is one table
(:data:`cords_vllm.integration.patch.table.TABLE`) of three kinds of entries:

* :class:`Patch`: a vLLM function the plugin wraps; what vLLM lacks (``why``) and the upstream patch of
  ``patches/`` that would make it unnecessary.
* :class:`Call`: a vLLM function the plugin calls (private ones included), checked but never changed.
* :class:`Field`: an attribute the plugin declares on a vLLM class (the plans' hand-off on ``SchedulerOutput``),
  or :class:`Drains`: an attribute vLLM must still read where the plugin relies on it.

:func:`install`:

* resolves every entry and checks every signature **before changing anything**: a vLLM whose functions
  differ refuses to start (naming the function) instead of half-patching itself;
* detects a wrapped function's binding (plain, static or class method) with ``inspect.getattr_static`` and
  re-wraps it the same way;
* is **idempotent**: each wrapper carries its :class:`Patch` under one marker attribute, so loading the plugin
  twice in a process changes nothing.
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
    """A vLLM function or class the plugin relies on is not what the plugin was written against."""


def _owner(target: str) -> tuple[Any, str]:
    """The class (or module) that holds ``target`` (``"package.module:Class.attr"``), and the attribute name."""
    module_name, _, path = target.partition(":")
    owner_name, _, attr = path.rpartition(".")
    owner: Any = importlib.import_module(module_name)
    for part in filter(None, owner_name.split(".")):
        owner = getattr(owner, part)
    return owner, attr


def _unwrap(raw: Any) -> tuple[type | None, Callable]:
    kind = type(raw) if isinstance(raw, staticmethod | classmethod) else None
    return kind, raw.__func__ if kind is not None else raw


def _check_signature(target: str, function: Callable, params: tuple[str, ...], keywords: tuple[str, ...]) -> None:
    got = tuple(inspect.signature(function).parameters)
    if got[: len(params)] != params or not set(keywords) <= set(got):
        raise EngineSignatureError(
            f"cords-vllm: {target}{got} does not match the vLLM 0.32 signature {params} (+ keywords "
            f"{keywords}) the plugin relies on; this vLLM build is not supported")


@dataclass(frozen=True)
class Patch:
    """One wrapped vLLM function.

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
    platform:
        The one vLLM platform (``current_platform.device_type``: ``"cpu"``, ``"cuda"``...) whose processes need
        it, or ``None`` for every platform. An entry of another platform is never resolved, so its module is
        never imported.
    """

    target: str
    params: tuple[str, ...]
    make: Callable[[Callable], Callable]
    why: str
    keywords: tuple[str, ...] = ()
    upstream: str | None = None
    platform: str | None = None


@dataclass(frozen=True)
class Call:
    """A vLLM function the plugin calls; checked at install, never changed. ``params``/``keywords`` as in
    :class:`Patch`; ``why``: what the plugin uses it for; ``platform`` as in :class:`Patch`."""

    target: str
    params: tuple[str, ...]
    why: str
    keywords: tuple[str, ...] = ()
    platform: str | None = None


@dataclass(frozen=True)
class Field:
    """An attribute declared on a vLLM class with a default (so every instance has it), where upstream would add a
    field. ``target``: ``"package.module:Class.attr"``."""

    target: str
    default: Any
    why: str
    upstream: str | None = None
    platform: str | None = None


@dataclass(frozen=True)
class Drains:
    """An attribute that the vLLM function ``target`` must still read (``self.<attribute>``), because the plugin
    writes to it and relies on vLLM consuming it."""

    target: str
    attribute: str
    why: str
    platform: str | None = None


Entry = Patch | Call | Field | Drains


@dataclass(frozen=True)
class _Resolved:
    entry: Entry
    owner: Any
    attr: str
    kind: type | None = None
    function: Callable | None = None
    installed: bool = False


def _resolve(entry: Entry) -> _Resolved:
    owner, attr = _owner(entry.target)
    if isinstance(entry, Field):
        if not inspect.isclass(owner):
            raise EngineSignatureError(f"cords-vllm: {entry.target}: {owner!r} is not a class")
        return _Resolved(entry, owner, attr, installed=attr in vars(owner))
    raw = inspect.getattr_static(owner, attr)
    kind, function = _unwrap(raw)
    if isinstance(entry, Drains):
        source = inspect.getsource(getattr(function, "__wrapped__", function))
        if f"self.{entry.attribute}" not in source:
            raise EngineSignatureError(f"cords-vllm: {entry.target} no longer reads self.{entry.attribute}, which "
                                       "the plugin relies on; this vLLM build is not supported")
        return _Resolved(entry, owner, attr)
    installed = getattr(function, MARKER, None) is not None
    original = function.__wrapped__ if installed else function
    _check_signature(entry.target, original, entry.params, entry.keywords)
    return _Resolved(entry, owner, attr, kind, original, installed)


def install(entries: Sequence[Entry]) -> None:
    """Install ``entries``: every one is resolved and checked first, then each patch and field is applied once."""
    resolved = [_resolve(e) for e in entries]
    for r in resolved:
        if r.installed:
            continue
        if isinstance(r.entry, Patch):
            wrapper = functools.wraps(r.function)(r.entry.make(r.function))
            setattr(wrapper, MARKER, r.entry)
            setattr(r.owner, r.attr, r.kind(wrapper) if r.kind is not None else wrapper)
        elif isinstance(r.entry, Field):
            setattr(r.owner, r.attr, r.entry.default)


def module_of(entry: Entry) -> str:
    """The vLLM module that holds ``entry``'s target."""
    return entry.target.partition(":")[0]


def for_platform(entries: Sequence[Entry], platform: str) -> list[Entry]:
    """The entries a process of ``platform`` needs (those of every platform and its own)."""
    return [e for e in entries if e.platform in (None, platform)]


def install_when_imported(entries: Sequence[Entry]) -> None:
    """Install ``entries`` module by module, each module's entries together (checked first, all or nothing) when
    vLLM imports that module, or now for a module already imported. Nothing is imported to resolve an entry, so
    an entry whose module this process never loads costs nothing and changes nothing."""
    from cords_vllm.integration.patch.import_hooks import when_imported

    by_module: dict[str, list[Entry]] = {}
    for entry in entries:
        by_module.setdefault(module_of(entry), []).append(entry)
    for module, group in by_module.items():
        when_imported(module, lambda _module, group=tuple(group): install(group))


def installed(entries: Sequence[Entry]) -> list[Entry]:
    """The patches and fields of ``entries`` currently installed."""
    return [r.entry for r in map(_resolve, entries) if r.installed]
