"""Run a callback right after a module is imported, without importing it.

The plugin must never import a vLLM module that vLLM itself would not import in the running process: vLLM's CPU
worker module, for one, replaces torch's CUDA events, streams and pinned copies for the whole process when it is
imported. So the patch table is not resolved up front; each module's entries are installed when vLLM imports
that module (:func:`when_imported`), or at once if it already has.

The mechanism is the classic post-import hook (as in ``wrapt``): a :data:`sys.meta_path` finder that, for a
watched module name only, asks the other finders for the module's spec and wraps its loader so that the callback
runs after the module's code, before any importer receives the module. Every other import is untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the module's own loader, then runs the callbacks on the executed module."""

    def __init__(self, loader: Any, callbacks: list[Callback]) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # the module sees its own loader (get_source, resources)
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """The one finder of this process: watched module names and their pending callbacks."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}
        self._lock = threading.RLock()
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending or fullname in self._finding:
            return None
        with self._lock:
            callbacks = self.pending.pop(fullname, None)
            if callbacks is None:
                return None
            self._finding.add(fullname)
            try:
                spec = None
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):
                        continue
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
            finally:
                self._finding.discard(fullname)
            if spec is None or spec.loader is None:
                self.pending[fullname] = callbacks  # not importable (yet): keep watching
                return None
            spec.loader = _HookedLoader(spec.loader, callbacks)
            return spec


_FINDER = _PostImportFinder()


def when_imported(module: str, callback: Callback) -> None:
    """Call ``callback(module_object)`` once ``module`` is imported: now if it already is, else right after vLLM
    (or anyone) imports it. Never imports ``module`` itself."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        callback(loaded)
        return
    with _FINDER._lock:
        _FINDER.pending.setdefault(module, []).append(callback)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def watched() -> list[str]:
    """Modules with callbacks still waiting for their import."""
    return sorted(_FINDER.pending)


__all__ = ["watched", "when_imported"]
