"""The architecture note's layout names the code as it is (every path exists, every module is named), and the
README stays a five-minute read."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def layout_paths() -> set[str]:
    """Every path the architecture note's ``## Layout`` block names (indentation = nesting, two spaces a level)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    paths: set[str] = set()
    parents: list[str] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        head = re.split(r"\s{2,}|\s\(", line.strip(), maxsplit=1)[0]
        names = [n.strip() for n in re.split(r",\s*|\s+", head) if n.strip()]
        parents = parents[:depth]
        for name in names:
            paths.add("/".join([*parents, name.rstrip("/")]))
        if len(names) == 1 and names[0].endswith("/"):
            parents.append(names[0].rstrip("/"))
    return paths


def test_every_path_of_the_layout_exists():
    missing = sorted(p for p in layout_paths() if not (REPO / p).exists())
    assert missing == []


def test_the_layout_names_every_module_of_the_runtime_and_the_seam():
    named = layout_paths()
    for folder in ("cords_vllm", "cords_vllm/integration", "cords_vllm/lab"):
        children = {f"{folder}/{p.name}" for p in (REPO / folder).iterdir()
                    if (p.suffix == ".py" and (p.name != "__init__.py" or folder == "cords_vllm"))
                    or (p / "__init__.py").is_file() or p.name == "assets"}
        assert children - named == set(), f"not in the layout (docs/architecture.md): {sorted(children - named)}"


def test_the_architecture_note_names_existing_code():
    text = (REPO / "docs" / "architecture.md").read_text()
    for path in set(re.findall(r"`((?:integration|lab|selection|compress|conversation)/[\w/]*\.?\w*)`", text)):
        assert (REPO / "cords_vllm" / path.rstrip("/")).exists(), path
    for name in re.findall(r"`(\w+\.py)`", text):
        assert list((REPO / "cords_vllm").rglob(name)), name


def test_test_modules_have_unique_names():
    """Test folders are not packages, so pytest imports each test module by its bare name: two with one name stop
    the whole collection."""
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_the_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "make demo" in text and "make test" in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target


def test_the_docs_links_resolve():
    for page in (REPO / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http", "mailto:")):
                assert (page.parent / target).resolve().exists(), (page.name, target)
