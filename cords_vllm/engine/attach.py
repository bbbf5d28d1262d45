"""Plugin state attached to vLLM engine objects, without writing into their ``__dict__``.

The scheduler, model runner and attention groups get a compressor (or ``None`` for ``--kv-policy none``)
the first time a patched method sees them. The state lives here, keyed by object identity and dropped when
the object is garbage-collected (vLLM's ``AttentionGroup`` is an unhashable dataclass, so a
``WeakKeyDictionary`` cannot hold it).
"""

from __future__ import annotations

import weakref
from typing import Any

_MISSING: Any = object()
_state: dict[int, Any] = {}


def attach(obj: Any, value: Any) -> None:
    """Attach ``value`` to ``obj`` (replacing any earlier value) until ``obj`` is collected."""
    key = id(obj)
    if key not in _state:
        weakref.finalize(obj, _state.pop, key, None)
    _state[key] = value


def attached(obj: Any, default: Any = _MISSING) -> Any:
    """The value attached to ``obj``; ``default`` (or ``KeyError`` without one) if there is none."""
    value = _state.get(id(obj), _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise KeyError(f"no cords-vllm state attached to {type(obj).__name__}")
        return default
    return value
