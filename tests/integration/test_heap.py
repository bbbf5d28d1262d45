"""The heap between in-process engines (:mod:`cords_vllm.integration.inprocess.heap`): what is unreachable is
collected, what survives is frozen, and a running engine's freeze is left alone."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

from cords_vllm.integration.inprocess.heap import settle, settle_if_thawed


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    """Two nodes that refer to each other and to nothing else: only a collection frees them."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_settle_collects_cycles_then_freezes_what_survives() -> None:
    gc.unfreeze()  # as vLLM's shutdown leaves the heap
    kept = [_Node() for _ in range(1000)]
    gone = _cycle()
    assert gone() is not None and gc.get_freeze_count() == 0
    settle()
    assert gone() is None  # collected before the freeze, not frozen with the survivors
    assert gc.get_freeze_count() >= len(kept)
    assert not any(obj is kept for obj in gc.get_objects())  # frozen: no collection walks it any more
    late = [_Node()]
    assert any(obj is late for obj in gc.get_objects())  # what comes after is collected as usual


def test_settle_if_thawed_leaves_a_running_engines_freeze() -> None:
    gc.unfreeze()
    gc.freeze()  # as vLLM does when an engine starts
    frozen = gc.get_freeze_count()
    gone = _cycle()
    settle_if_thawed()
    assert gc.get_freeze_count() == frozen and gone() is not None  # neither collected nor frozen
    gc.unfreeze()  # the engine shut down
    settle_if_thawed()
    assert gone() is None and gc.get_freeze_count() > 0


def test_a_process_that_settled_exits_with_its_heap_thawed() -> None:
    """Frozen objects escape the final collection at exit (Triton's bindings then report them as leaked): the heap
    is unfrozen before it. An exit handler registered before :func:`settle` runs after its own."""
    script = ("import atexit, gc\n"
              "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
              "from cords_vllm.integration.inprocess.heap import settle\n"
              "settle()\n"
              "print('frozen:', gc.get_freeze_count() > 0)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["frozen: True", "frozen at exit: 0"]
