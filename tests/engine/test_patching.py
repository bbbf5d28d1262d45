"""The one patch mechanism: signature-checked before anything changes, idempotent, bindings preserved."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from cords_vllm.engine.patching import MARKER, EngineSignatureError, Patch, install, installed

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_module(monkeypatch):
    module = types.ModuleType("fake_vllm_for_patch_tests")

    class Scheduler:
        def schedule(self, throttle_prefills=False):
            return "scheduled"

        @staticmethod
        def add_cli_args(parser):
            return [*parser, "vllm"]

        @classmethod
        def from_cli_args(cls, args):
            return (cls.__name__, args)

    module.Scheduler = Scheduler
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _tagging(tag):
    def make(original):
        def wrapper(*args, **kwargs):
            return (tag, original(*args, **kwargs))
        return wrapper
    return make


def test_plain_static_and_class_methods_keep_their_binding(fake_module):
    patches = [Patch(f"{fake_module.__name__}:Scheduler.schedule", ("self",), _tagging("s"), why="test"),
               Patch(f"{fake_module.__name__}:Scheduler.add_cli_args", ("parser",), _tagging("a"), why="test"),
               Patch(f"{fake_module.__name__}:Scheduler.from_cli_args", ("cls", "args"), _tagging("f"), why="test")]
    install(patches)
    s = fake_module.Scheduler
    assert s().schedule() == ("s", "scheduled")
    assert s.add_cli_args(["x"]) == ("a", ["x", "vllm"])
    assert s.from_cli_args("z") == ("f", ("Scheduler", "z"))
    assert installed(patches) == patches
    install(patches)  # idempotent: nothing is wrapped twice
    assert s().schedule() == ("s", "scheduled") and s.from_cli_args("z") == ("f", ("Scheduler", "z"))
    assert getattr(s.schedule, MARKER) is patches[0]


def test_a_foreign_signature_refuses_before_anything_changes(fake_module):
    good = Patch(f"{fake_module.__name__}:Scheduler.schedule", ("self",), _tagging("s"), why="test")
    foreign = Patch(f"{fake_module.__name__}:Scheduler.from_cli_args", ("cls", "namespace"), _tagging("f"),
                    why="test")
    with pytest.raises(EngineSignatureError, match=r"Scheduler\.from_cli_args"):
        install([good, foreign])
    assert fake_module.Scheduler().schedule() == "scheduled"  # all or nothing
    with pytest.raises(EngineSignatureError, match="reserved_blocks"):
        install([Patch(good.target, ("self",), _tagging("s"), why="test", keywords=("reserved_blocks",))])


def test_the_engine_patch_table_is_installed_and_names_its_upstream_patches():
    from cords_vllm.engine import patches

    patches.install()
    assert installed(patches.ENGINE_PATCHES) == list(patches.ENGINE_PATCHES)
    for patch in patches.ENGINE_PATCHES:
        assert patch.why and (patch.upstream is None or (REPO / patch.upstream).is_file()), patch.upstream
    assert sum(p.upstream is not None for p in patches.ENGINE_PATCHES) == 5  # patches/0001..0005


def test_the_cli_patches_use_the_same_mechanism():
    from cords_vllm.cli_args import CLI_PATCHES
    from cords_vllm.plugin import register

    register()
    assert installed(CLI_PATCHES) == list(CLI_PATCHES)
