"""The patch series in patches/ applies cleanly, in order, to the pinned vLLM release, and the patched modules
import (a hunk can compile and still break a module: a decorator landing on the wrong definition)."""

from __future__ import annotations

import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path

import vllm

from cords_vllm.integration.patch.version_guard import is_supported

SERIES = sorted((Path(__file__).resolve().parents[2] / "patches").glob("*.patch"))


def test_series_applies_to_the_pinned_release(tmp_path):
    assert is_supported(vllm.__version__)
    assert [p.name[:4] for p in SERIES] == ["0001", "0002", "0003", "0004", "0005"]
    site = Path(vllm.__file__).resolve().parents[1]
    touched = sorted({m for p in SERIES for m in re.findall(r"^\+\+\+ b/(\S+)$", p.read_text(), re.MULTILINE)})
    for rel in touched:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / rel, tmp_path / rel)
    for patch in SERIES:
        subprocess.run(["git", "apply", "--check", "-p1", str(patch)], cwd=tmp_path, check=True)
        subprocess.run(["git", "apply", "-p1", str(patch)], cwd=tmp_path, check=True)
        assert (Path(str(patch).replace(".patch", ".md"))).is_file(), f"{patch.name} has no README"
    for rel in touched:
        py_compile.compile(str(tmp_path / rel), doraise=True)
    _import_patched(tmp_path, touched)
    # applying twice must fail: the series really changed these files
    again = subprocess.run(["git", "apply", "--check", "-p1", str(SERIES[0])], cwd=tmp_path, check=False,
                           capture_output=True)
    assert again.returncode != 0


#: Run in a fresh interpreter: each patched module is executed under its own name over the installed vLLM.
_IMPORT_PATCHED = """
import dataclasses, importlib.util, sys
import vllm
for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
utils = sys.modules["vllm.v1.worker.utils"]
assert dataclasses.is_dataclass(utils.AttentionGroup), "AttentionGroup lost its @dataclass"
assert not dataclasses.is_dataclass(utils._compact_null_blocks)
print("imported", len(sys.argv) // 2)
"""


def _import_patched(root: Path, touched: list[str]) -> None:
    """Execute every patched file as its module (dependencies first: vLLM's own import order)."""
    order = sorted(touched, key=lambda rel: ("worker" in rel, rel.count("/"), rel))
    argv = [x for rel in order for x in (rel[:-3].replace("/", "."), str(root / rel))]
    done = subprocess.run([sys.executable, "-c", _IMPORT_PATCHED, *argv], capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(touched)}" in done.stdout
