"""A process's heap between in-process engines: collected once, then frozen.

vLLM freezes the garbage collector's heap when an engine starts (``gc.freeze()``, so that its collections skip the
start-up objects) and unfreezes it when the engine shuts down. A process that starts engines one after another
(the tests, the benchmarks' policies) holds some 740,000 tracked objects of torch, transformers and vLLM after
each shutdown: every full collection walks them all (about 0.4 s on 2 CPU cores), and an engine's life made five
(two while its model loads, one before it freezes, two at its shutdown), more than half of a short engine test.

:func:`settle` collects what the last engine left once and freezes the survivors, so the next engine's
collections walk only what was allocated since. Frozen objects are never collected, so only what is still alive
after a full collection is frozen, and vLLM's next shutdown unfreezes the heap again. A server, which starts one
engine, needs none of this.
"""

from __future__ import annotations

import atexit
import functools
import gc


def settle() -> None:
    """Collect everything unreachable, then freeze what remains (``gc.freeze``), and thaw the heap at exit."""
    _thaw_at_exit()
    gc.collect()
    gc.freeze()


@functools.cache
def _thaw_at_exit() -> None:
    """Unfreeze the heap when the process exits, so that its final collection finalizes what was frozen as usual
    (native bindings such as Triton's otherwise report their frozen objects as leaked)."""
    atexit.register(gc.unfreeze)


def settle_if_thawed() -> None:
    """:func:`settle` where nothing is frozen (at the start, or after an engine's shutdown unfroze the heap); where a
    running engine's freeze holds, leave it."""
    if gc.get_freeze_count() == 0:
        settle()
