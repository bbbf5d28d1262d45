"""Deprecated module names: the modules that moved when the runtime, the vLLM seam and the lab were split, and
when the seam's loose modules were sorted into ``integration.patch`` and ``integration.handoff``.

Importing an old name (``cords_vllm.inprocess``, ``cords_vllm.synthetic.tiny_model``, ...) returns the module
at its new home, under both names, with a :class:`DeprecationWarning` that names the new one. Installed by
``cords_vllm/__init__.py``; nothing is imported until an old name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Old module (or package) name -> new name. A package's submodules follow it.
MOVED: dict[str, str] = {
    "cords_vllm.inprocess": "cords_vllm.integration.inprocess.llm",
    "cords_vllm.session": "cords_vllm.integration.inprocess.session",
    "cords_vllm.introspect": "cords_vllm.integration.inprocess.introspect",
    "cords_vllm.cli_args": "cords_vllm.integration.startup.cli_args",
    "cords_vllm.startup_checks": "cords_vllm.integration.startup.checks",
    "cords_vllm.version_guard": "cords_vllm.integration.patch.version_guard",
    "cords_vllm.streams.transcript": "cords_vllm.conversation.transcript",
    "cords_vllm.streams.text_budget": "cords_vllm.conversation.text_budget",
    "cords_vllm.streams": "cords_vllm.integration.api_server.streams",
    "cords_vllm.bench": "cords_vllm.lab.bench",
    "cords_vllm.vqa": "cords_vllm.lab.vqa",
    "cords_vllm.synthetic": "cords_vllm.lab.synthetic",
    "cords_vllm.metrics": "cords_vllm.lab.fidelity",
    "cords_vllm.reference": "cords_vllm.lab.reference",
    "cords_vllm.serving": "cords_vllm.lab.serving",
    "cords_vllm.demo": "cords_vllm.lab.demo",
    "cords_vllm.demo_requests": "cords_vllm.lab.demo_requests",
    # integration/'s root sorted into the patching mechanism and the hand-offs between processes
    "cords_vllm.integration.patching": "cords_vllm.integration.patch.mechanism",
    "cords_vllm.integration.patches": "cords_vllm.integration.patch.table",
    "cords_vllm.integration.import_hooks": "cords_vllm.integration.patch.import_hooks",
    "cords_vllm.integration.version_guard": "cords_vllm.integration.patch.version_guard",
    "cords_vllm.integration.attach": "cords_vllm.integration.patch.attach",
    "cords_vllm.integration.plans": "cords_vllm.integration.handoff.plans",
    "cords_vllm.integration.published": "cords_vllm.integration.handoff.published",
    "cords_vllm.integration.failures": "cords_vllm.integration.handoff.failures",
    "cords_vllm.integration.engine_policy": "cords_vllm.integration.handoff.engine_policy",
}


def new_name(name: str) -> str | None:
    """The new name of module ``name`` (``None`` if it did not move)."""
    for old in sorted(MOVED, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            return MOVED[old] + name[len(old):]
    return None


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sys.meta_path`` finder that answers an old module name with the module at its new name."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = new_name(spec.name)
        warnings.warn(f"{spec.name} moved to {new}; the old name will be removed in cords-vllm 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed at its new name already."""


def install() -> None:
    """Put :class:`MovedModuleFinder` first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
