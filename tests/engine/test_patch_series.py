"""The patch series in patches/ applies cleanly, in order, to the pinned vLLM release and compiles."""

from __future__ import annotations

import py_compile
import re
import shutil
import subprocess
from pathlib import Path

import vllm

from cords_vllm.integration.version_guard import is_supported

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
    # applying twice must fail: the series really changed these files
    again = subprocess.run(["git", "apply", "--check", "-p1", str(SERIES[0])], cwd=tmp_path, check=False,
                           capture_output=True)
    assert again.returncode != 0
