"""The CPU-wheel fixes: active in every process of the venv, stable when the set-up runs again."""

import importlib.metadata
import subprocess
import sys

import pytest

from cords_vllm import cpu_fixes

pytestmark = pytest.mark.skipif(not cpu_fixes.pth_path().is_file(), reason="not a CPU venv set up by the project")


def test_rerunning_the_setup_keeps_hiding_broken_wheels():
    before = cpu_fixes.pth_path().read_text()
    hidden = cpu_fixes.probe_broken()  # probed with the fixes active in this very process
    cpu_fixes.write_pth()
    assert cpu_fixes.pth_path().read_text() == before
    for name in hidden:
        assert repr(name) in before


def test_a_fresh_process_imports_what_vllm_needs():
    code = ("import torchvision, transformers.processing_utils, vllm.entrypoints.cli.main, importlib.metadata as m;"
            "print(m.version('vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith("0.32")


def test_version_lookup_falls_back_only_for_vllm():
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("surely-not-installed-distribution")
