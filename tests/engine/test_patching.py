"""The one patch mechanism: signature-checked before anything changes, idempotent, bindings preserved."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from cords_vllm.integration.patch.mechanism import (
    MARKER,
    Call,
    Drains,
    EngineSignatureError,
    Field,
    Patch,
    install,
    installed,
)

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


def test_calls_fields_and_drains_are_checked_before_anything_changes(fake_module):
    fake_module.Scheduler.steps = None

    def update_from_output(self):
        return self.error_reqs

    fake_module.Scheduler.update_from_output = update_from_output
    good = Patch(f"{fake_module.__name__}:Scheduler.schedule", ("self",), _tagging("s"), why="test")
    field = Field(f"{fake_module.__name__}:Scheduler.plans", (), why="test")
    for bad in (Call(f"{fake_module.__name__}:Scheduler.schedule", ("self", "budget"), why="test"),
                Drains(f"{fake_module.__name__}:Scheduler.update_from_output", "mismatch_reqs", why="test")):
        with pytest.raises(EngineSignatureError, match="Scheduler"):
            install([good, field, bad])
        assert fake_module.Scheduler().schedule() == "scheduled" and not hasattr(fake_module.Scheduler, "plans")
    install([good, field, Call(f"{fake_module.__name__}:Scheduler.schedule", ("self",), why="test"),
             Drains(f"{fake_module.__name__}:Scheduler.update_from_output", "error_reqs", why="test")])
    assert fake_module.Scheduler.plans == () and fake_module.Scheduler().schedule() == ("s", "scheduled")
    assert installed([good, field]) == [good, field]


def test_one_table_holds_every_vllm_function_the_plugin_wraps_or_calls():
    from cords_vllm.integration.patch import table

    table.install_all()  # every entry of every platform matches this vLLM
    wrapped = [e for e in table.TABLE if isinstance(e, Patch | Field)]
    assert installed(table.TABLE) == wrapped
    for entry in table.TABLE:
        assert entry.why, entry.target
        upstream = getattr(entry, "upstream", None)
        assert upstream is None or (REPO / upstream).is_file(), upstream
    assert len({e.upstream for e in table.patches() if e.upstream}) == 5  # patches/0001..0005
    private = {e.target for e in table.TABLE
               if isinstance(e, Call) and e.target.partition(":")[2].rsplit(".", 1)[-1].startswith("_")}
    assert "vllm.v1.core.kv_cache_utils:_pool_bytes_per_block" in private
    assert [e for g in table.GROUPS for e in g.entries] == list(table.TABLE)
    # a policy's groups are the only ones an engine under none leaves out
    assert {g.name for g in table.GROUPS if not g.under_none} == {"engine core: policy", "workers: policy"}
    assert {e.platform for e in table.TABLE} == {None, "cpu"}


def test_entries_are_installed_when_their_module_is_imported_and_never_import_it(tmp_path, monkeypatch):
    from cords_vllm.integration.patch import import_hooks
    from cords_vllm.integration.patch.mechanism import install_when_imported

    (tmp_path / "late_vllm_module.py").write_text("class Runner:\n    def step(self):\n        return 'stepped'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = Patch("late_vllm_module:Runner.step", ("self",), _tagging("t"), why="test")
    install_when_imported([entry])
    assert "late_vllm_module" not in sys.modules and "late_vllm_module" in import_hooks.watched()
    import late_vllm_module

    assert late_vllm_module.Runner().step() == ("t", "stepped")
    assert "late_vllm_module" not in import_hooks.watched()
    assert late_vllm_module.__loader__.get_source("late_vllm_module").startswith("class Runner")
    install_when_imported([entry])  # already imported: installed at once, and only once
    assert late_vllm_module.Runner().step() == ("t", "stepped")
    monkeypatch.delitem(sys.modules, "late_vllm_module")


def test_a_policy_announced_none_defers_the_policy_groups_until_one_is_enabled(monkeypatch):
    from cords_vllm.integration.handoff import engine_policy

    monkeypatch.setenv(engine_policy.ENV, "none")
    ran = []
    engine_policy.unless_none(lambda: ran.append("policy hooks"))
    assert ran == [] and engine_policy.deferred() == 1
    engine_policy.announce("none")
    assert ran == []
    engine_policy.announce("cords")
    assert ran == ["policy hooks"] and engine_policy.deferred() == 0
    engine_policy.unless_none(lambda: ran.append("again"))
    assert ran == ["policy hooks", "again"]


def test_the_plugin_installs_nothing_but_the_one_table():
    """No module of the runtime calls the install mechanism except the table itself."""
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "cords_vllm").rglob("*.py")
                 if "install_entries(" in p.read_text() and p.name != "table.py"]
    assert offenders == []
