"""The house's walls, checked from the import statements of every module (function bodies included).

* The runtime (everything of ``cords_vllm`` but the lab) never imports the lab, lazily or not, and importing
  every runtime module in a fresh interpreter loads none of it.
* ``cords_vllm.integration`` is the one seam: no other runtime module imports vLLM; the lab uses vLLM's public
  top-level API only (``from vllm import ...``) and reaches internals through ``cords_vllm.integration.inprocess``.
* The pure core (selection, the compress step, config, conversation text, model facts) imports neither vLLM nor a
  web, process or file-system module.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import cords_vllm

PACKAGE = "cords_vllm"
LAB = "cords_vllm.lab"
SEAM = "cords_vllm.integration"
PURE = ("cords_vllm.selection", "cords_vllm.compress", "cords_vllm.config", "cords_vllm.conversation",
        "cords_vllm.model_facts", "cords_vllm.utils")
#: Imports a pure module may not make: the engine, web frameworks, processes and the file system.
NOT_PURE = ("vllm", "fastapi", "starlette", "requests", "urllib", "http", "socket", "subprocess", "shutil",
            "tempfile", "pathlib", "os", "cords_vllm.integration", LAB)
PACKAGE_DIR = Path(cords_vllm.__file__).resolve().parent


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _walk(path: Path, prefix: str) -> Iterator[tuple[str, Path]]:
    """``(module name, source file)`` of every module under ``path``, without importing anything."""
    for info in pkgutil.iter_modules([str(path)], prefix):
        leaf = info.name.rsplit(".", 1)[1]
        if info.ispkg:
            yield info.name, path / leaf / "__init__.py"
            yield from _walk(path / leaf, info.name + ".")
        else:
            yield info.name, path / f"{leaf}.py"


def all_modules() -> dict[str, Path]:
    return {PACKAGE: PACKAGE_DIR / "__init__.py", **dict(_walk(PACKAGE_DIR, PACKAGE + "."))}


def runtime_modules() -> dict[str, Path]:
    """Every module of the package outside the lab, the package itself included."""
    return {name: path for name, path in all_modules().items() if not _within(name, LAB)}


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """Absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(name: str, source: Path) -> list[tuple[str, list[str]]]:
    """``(module, imported names)`` of every import statement in ``source`` (module ``name``), at any depth."""
    tree = ast.parse(source.read_text(), filename=str(source))
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module, node.level, name, source.name == "__init__.py")
            found.append((target, [a.name for a in node.names]))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"):
            found.append((node.args[0].value, []))
    return found


def _offenders(modules: dict[str, Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, path in modules.items():
        bad = []
        for target, names in imports_of(name, path):
            full = [target, *(f"{target}.{n}" for n in names)]
            bad += [t for t in full if any(_within(t, f) for f in forbidden)]
        if bad:
            out[name] = sorted(set(bad))
    return out


def test_the_walk_sees_the_runtime_the_seam_and_the_lab() -> None:
    modules = all_modules()
    assert {"cords_vllm.lab.demo", "cords_vllm.lab.synthetic.tiny_model", "cords_vllm.lab.reference.hf",
            "cords_vllm.integration.patch.table", "cords_vllm.integration.engine_core.scheduler",
            "cords_vllm.integration.worker.compressor", "cords_vllm.selection.cords",
            "cords_vllm.compress.step"} <= modules.keys()
    assert all(path.is_file() for path in modules.values())
    assert not any(_within(m, LAB) for m in runtime_modules())


def test_no_runtime_module_imports_the_lab_even_lazily() -> None:
    assert _offenders(runtime_modules(), (LAB,)) == {}


def test_importing_the_whole_runtime_loads_no_lab_module() -> None:
    names = sorted(runtime_modules())
    code = (
        "import importlib, json, sys\n"
        f"names = {names!r}\n"
        "failed = {}\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed[name] = repr(e)\n"
        f"lab = sorted(m for m in sys.modules if m == {LAB!r} or m.startswith({LAB + '.'!r}))\n"
        "print(json.dumps({'failed': failed, 'lab': lab}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}, f"runtime modules that fail to import on CPU: {result}"
    assert result["lab"] == [], f"importing the runtime loaded the lab: {result['lab']}"


def test_the_seam_is_the_only_runtime_importer_of_vllm() -> None:
    outside = {n: p for n, p in runtime_modules().items() if not _within(n, SEAM)}
    assert _offenders(outside, ("vllm",)) == {}
    assert _offenders({n: p for n, p in runtime_modules().items() if _within(n, SEAM)}, ("vllm",)), \
        "the seam imports vLLM: the check above would see an import"


def test_the_lab_uses_vllms_public_top_level_api_only() -> None:
    lab = {n: p for n, p in all_modules().items() if _within(n, LAB)}
    deep = {name: bad for name, path in lab.items()
            if (bad := [t for t, _ in imports_of(name, path) if t.startswith("vllm.")])}
    assert deep == {}, "the lab reaches vLLM internals through cords_vllm.integration.inprocess only"


def test_the_pure_core_imports_no_engine_no_web_no_processes_and_no_file_system() -> None:
    pure = {n: p for n, p in runtime_modules().items() if any(_within(n, m) for m in PURE)}
    assert {"cords_vllm.selection.cords", "cords_vllm.compress.plan", "cords_vllm.config",
            "cords_vllm.conversation.transcript", "cords_vllm.model_facts"} <= pure.keys()
    assert _offenders(pure, NOT_PURE) == {}


def test_the_guard_sees_a_lazy_import(tmp_path) -> None:
    """The checks above fail on an import inside a function body (a test that cannot fail is a defect)."""
    scratch = tmp_path / "fake.py"
    scratch.write_text("def f():\n    from vllm import LLM\n    import cords_vllm.lab.demo\n")
    assert _offenders({"cords_vllm.selection.fake": scratch}, ("vllm", LAB)) == {
        "cords_vllm.selection.fake": ["cords_vllm.lab.demo", "vllm", "vllm.LLM"]}
