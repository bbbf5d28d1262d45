"""The shipped package never imports the test glue in ``cords_vllm.testing``.

Two checks over every module of ``cords_vllm`` outside ``cords_vllm.testing``: importing all of them in a fresh
interpreter leaves no ``cords_vllm.testing*`` module loaded (catches module-level and transitive imports), and
no import statement anywhere in their source, function bodies included, names ``cords_vllm.testing`` (catches
the lazy imports the first check cannot see).
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
TEST_GLUE = "cords_vllm.testing"
PACKAGE_DIR = Path(cords_vllm.__file__).resolve().parent

#: Modules that cannot be imported on a CPU-only machine, with the reason. None today.
CPU_UNIMPORTABLE: dict[str, str] = {}


def _is_test_glue(name: str) -> bool:
    return name == TEST_GLUE or name.startswith(TEST_GLUE + ".")


def _walk(path: Path, prefix: str) -> Iterator[tuple[str, Path]]:
    """``(module name, source file)`` of every module under ``path``, without importing anything.

    :func:`pkgutil.walk_packages` imports each package to find its children, which would load
    ``cords_vllm.testing`` itself; this walks the directories instead and never enters the test glue.
    """
    for info in pkgutil.iter_modules([str(path)], prefix):
        if _is_test_glue(info.name):
            continue
        leaf = info.name.rsplit(".", 1)[1]
        if info.ispkg:
            yield info.name, path / leaf / "__init__.py"
            yield from _walk(path / leaf, info.name + ".")
        else:
            yield info.name, path / f"{leaf}.py"


def runtime_modules() -> dict[str, Path]:
    """Every module of the package outside ``cords_vllm.testing``, the package itself included."""
    return {PACKAGE: PACKAGE_DIR / "__init__.py", **dict(_walk(PACKAGE_DIR, PACKAGE + "."))}


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """Absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def glue_imports(name: str, source: Path) -> list[str]:
    """The ``cords_vllm.testing*`` names that ``source`` (module ``name``) imports, at any depth."""
    tree = ast.parse(source.read_text(), filename=str(source))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_test_glue(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node.module, node.level, name, source.name == "__init__.py")
            if _is_test_glue(target):
                found.append(target)
            else:
                found += [f"{target}.{a.name}" for a in node.names if _is_test_glue(f"{target}.{a.name}")]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _is_test_glue(node.args[0].value)):
            found.append(node.args[0].value)  # importlib.import_module("cords_vllm.testing...") and the like
    return found


def test_walk_finds_the_package_without_the_glue() -> None:
    modules = runtime_modules()
    assert {"cords_vllm.demo", "cords_vllm.synthetic.tiny_model", "cords_vllm.reference.hf",
            "cords_vllm.serving.process", "cords_vllm.bench.offline"} <= modules.keys()
    assert not any(_is_test_glue(m) for m in modules)
    assert all(path.is_file() for path in modules.values())
    assert modules.keys() >= CPU_UNIMPORTABLE.keys()


def test_importing_the_runtime_package_loads_no_test_glue() -> None:
    names = sorted(set(runtime_modules()) - set(CPU_UNIMPORTABLE))
    code = (
        "import importlib, json, sys\n"
        f"names = {names!r}\n"
        "failed = {}\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed[name] = repr(e)\n"
        f"glue = sorted(m for m in sys.modules if m == {TEST_GLUE!r} or m.startswith({TEST_GLUE + '.'!r}))\n"
        "print(json.dumps({'failed': failed, 'glue': glue}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}, f"modules that fail to import on CPU (list them in CPU_UNIMPORTABLE): {result}"
    assert result["glue"] == [], f"importing the runtime package loaded the test glue: {result['glue']}"


def test_no_runtime_module_imports_test_glue_even_lazily() -> None:
    offenders = {name: found for name, path in runtime_modules().items()
                 if (found := glue_imports(name, path))}
    assert offenders == {}, f"runtime modules importing cords_vllm.testing: {offenders}"
