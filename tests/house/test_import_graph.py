"""The package's import graph has no cycle, counting every import that runs (a function's lazy one included; an
``if TYPE_CHECKING:`` block's, which never runs, left out): a module's shared types live in a leaf module both sides
import, never behind an import deferred to break a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "cords_vllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports anywhere in its code (``from pkg import mod`` names the module)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {name for name in names if name in modules}
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    modules = set(files)
    return {name: imports_of(path, modules) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_check_finds_a_cycle(tmp_path):
    lazy = tmp_path / "m.py"
    lazy.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.a\ndef f():\n    import x.b\n")
    assert imports_of(lazy, {"x.a", "x.b"}) == {"x.b"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def private_uses(path: Path, modules: set[str]) -> list[str]:
    """The private names (``_x``) of the package's other modules that ``path`` reaches: imported by name, or read as
    an attribute of an imported module. A package importing its own private module is its own business."""
    me = module_name(path)
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in modules | {PACKAGE}:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if alias.name.startswith("_") and not alias.name.startswith("__") and node.module != me and not (
                        full in modules and me == node.module):
                    found.append(f"from {node.module} import {alias.name}")
                if full in modules:
                    aliases[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and aliases.get(node.value.id, me) != me):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_is_used_outside_its_module():
    files = {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    modules = set(files)
    used = {name: uses for name, path in files.items() if (uses := private_uses(path, modules))}
    assert used == {}


def test_the_private_name_check_finds_one(tmp_path):
    (tmp_path / "cords_vllm").mkdir()
    user = tmp_path / "cords_vllm" / "user.py"
    user.write_text("from cords_vllm import other\nfrom cords_vllm.other import _hidden\nother._secret()\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert private_uses(user, {"cords_vllm.other", "cords_vllm.user"}) == [
            "from cords_vllm.other import _hidden", "cords_vllm.other._secret"]
    finally:
        ROOT = saved
