"""Deprecated module names still import, as the module at its new home, with a warning naming it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from cords_vllm._moved import MOVED, new_name


def test_new_names_follow_packages_and_leave_the_rest_alone():
    assert new_name("cords_vllm.synthetic.tiny_model") == "cords_vllm.lab.synthetic.tiny_model"
    assert new_name("cords_vllm.streams.transcript") == "cords_vllm.conversation.transcript"
    assert new_name("cords_vllm.streams.api") == "cords_vllm.integration.api_server.streams.api"
    assert new_name("cords_vllm.demo_requests") == "cords_vllm.lab.demo_requests"
    assert new_name("cords_vllm.integration.patches") == "cords_vllm.integration.patch.table"
    assert new_name("cords_vllm.integration.published") == "cords_vllm.integration.handoff.published"
    assert new_name("cords_vllm.version_guard") == "cords_vllm.integration.patch.version_guard"
    assert new_name("cords_vllm.config") is None and new_name("cords_vllm.client") is None
    for new in MOVED.values():
        assert importlib.util.find_spec(new) is not None, new


@pytest.mark.parametrize("old", ["cords_vllm.inprocess", "cords_vllm.synthetic.tiny_model",
                                 "cords_vllm.streams.registry"])
def test_an_old_name_is_the_new_module_with_a_deprecation_warning(old):
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"import importlib\n"
            f"try:\n    importlib.import_module({old!r})\nexcept DeprecationWarning as w:\n    print('warned', w)\n"
            f"warnings.simplefilter('ignore')\n"
            f"old = importlib.import_module({old!r}); new = importlib.import_module({new_name(old)!r})\n"
            f"print('same', old is new)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    # the first old name imported warns (a submodule's moved package, when the package moved)
    moved = next(o for o in sorted(MOVED, key=len) if old == o or old.startswith(o + "."))
    assert f"warned {moved} moved to {MOVED[moved]}" in out
    assert "same True" in out
