"""Every install command the project shows a user names something that exists.

cords-vllm is not published on a package index: an install line must install it from a path (a checkout, ``.``,
``'.[cuda]'``, a built wheel) or from its repository (``git+...``), and any other package it names must be a
dependency ``pyproject.toml`` declares. An extra named on the project must be one it defines.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]["name"]
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])

#: `pip install ...`, `pip3 install`, `python -m pip install`, `uv pip install`, up to the end of the command (not
#: the prose "pip install failed").
INSTALL = re.compile(r"\bpip3?\s+install\s+(?!failed\b)(?P<args>[^\n`\"]*?(?:'[^'\n]*'[^\n`\"]*?)*)(?=[`\"\n#;&|)]|$)")
#: Options of pip install that take a value.
VALUED = {"-r", "-c", "-e", "-t", "-i", "--requirement", "--constraint", "--editable", "--target", "--index-url",
          "--extra-index-url", "-f", "--find-links", "--python", "--prefix", "--root", "--log"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


DECLARED = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
DECLARED |= {_name(r) for reqs in PYPROJECT["project"]["optional-dependencies"].values() for r in reqs}


def documents() -> list[Path]:
    """The README, ``docs/``, and the text of the project's code, scripts, examples and benchmarks."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("cords_vllm", "scripts", "examples", "benchmarks", "tests", "patches"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md") and p.is_file())
    return files


def install_lines(text: str) -> list[str]:
    return [m.group("args").strip() for m in INSTALL.finditer(text)]


def requirements(args: str) -> list[str]:
    """The requirements an install line's arguments name (options and their values dropped)."""
    try:
        words = shlex.split(args)
    except ValueError:
        words = args.split()
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word.startswith((">", "2>", "<", "|", "&")):  # a shell redirection or operator ends the command
            break
        if word in VALUED:
            skip = word not in ("-e", "--editable")  # an editable install's value is a requirement too
            continue
        if word.startswith("-"):
            continue
        out.append(word)
    return out


def problem(requirement: str) -> str | None:
    """Why ``requirement`` may not appear in an install line, or ``None`` when it is allowed."""
    if "$" in requirement or requirement.startswith(("<", "{")):  # a shell variable or a placeholder: not a package
        return None
    path, _, extras = requirement.partition("[")
    if path.startswith((".", "/", "~")) or path.endswith(".whl"):
        unknown = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()} - EXTRAS
        return f"extras {sorted(unknown)} are not defined in pyproject.toml" if unknown else None
    if path.startswith("git+"):
        return None if PROJECT in path else f"{requirement!r} is a repository other than this project's"
    name = _name(requirement)
    if name == PROJECT:
        return f"{requirement!r} names {PROJECT} on a package index, where it is not published: install from a checkout"
    if name not in DECLARED:
        return f"{requirement!r} is not a dependency declared in pyproject.toml"
    return None


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_install_lines_name_what_exists(path):
    if path == Path(__file__):
        return
    bad = [(line, why) for line in install_lines(path.read_text(errors="replace"))
           for req in requirements(line) if (why := problem(req))]
    assert not bad, f"{path.relative_to(ROOT)}: {bad}"


def test_the_readme_installs_the_gpu_build_from_a_checkout():
    lines = install_lines((ROOT / "README.md").read_text())
    assert any("'.[cuda]'" in line for line in lines), lines


@pytest.mark.parametrize(("line", "bad"), [
    ("pip install 'cords-vllm[cuda]'", True),
    ("pip install cords-vllm", True),
    ("pip install '.[cuda]'", False),
    ("pip install '.[gpu]'", True),
    ("python -m pip install -e '.[cpu,dev]'", False),
    ("pip install dist/cords_vllm-0.1.0-py3-none-any.whl", False),
    ("pip install 'git+https://github.com/example/cords-vllm'", False),
    ("pip install matplotlib", False),
    ("pip install --upgrade left-pad", True),
    ("pip install -r requirements.txt flash-attn", False),
])
def test_the_check_itself(line, bad):
    reqs = [r for found in install_lines(line) for r in requirements(found)]
    assert reqs, line
    assert any(problem(r) for r in reqs) is bad, (line, reqs)
