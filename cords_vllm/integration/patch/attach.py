"""Plugin state attached to vLLM engine objects, without writing into their ``__dict__``.

The scheduler, the model runner and its attention groups get the plugin's state the first time a patched
method sees them. Each kind of state is one typed :class:`Attached` slot, keyed by object identity and dropped
when the object is garbage-collected (vLLM's ``AttentionGroup`` is an unhashable dataclass, so a
``WeakKeyDictionary`` cannot hold it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Attached(Generic[T]):
    """One kind of plugin state, attached to engine objects by identity.

    Parameters
    ----------
    name:
        What the state is, for error messages (``"scheduler hooks"``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._values: dict[int, T] = {}

    def set(self, obj: Any, value: T) -> None:
        """Attach ``value`` to ``obj`` (replacing any earlier value) until ``obj`` is collected."""
        key = id(obj)
        if key not in self._values:
            weakref.finalize(obj, self._values.pop, key, None)
        self._values[key] = value

    def get(self, obj: Any) -> T | None:
        """The value attached to ``obj``, or ``None``."""
        return self._values.get(id(obj))

    def get_or_create(self, obj: Any, create: Callable[[], T]) -> T:
        """The value attached to ``obj``; ``create()`` attaches it on first use."""
        key = id(obj)
        if key in self._values:
            return self._values[key]
        value = create()
        self.set(obj, value)
        return value
