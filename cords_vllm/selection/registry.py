"""Policies by name: the ``--kv-policy`` choices.

A policy registers itself with :func:`register_selector` in its own module; importing
:mod:`cords_vllm.selection` imports every built-in policy module, so the registry is complete as soon as
the package is imported. ``none`` (no compression) is not a selector and is added by the CLI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from cords_vllm.selection.base import Selector
from cords_vllm.selection.params import ParamSpec

_REGISTRY: dict[str, type[Selector]] = {}

S = TypeVar("S", bound=type[Selector])


def register_selector(name: str) -> Callable[[S], S]:
    """Class decorator: register a :class:`Selector` subclass under ``name`` (sets ``cls.name``)."""

    def deco(cls: S) -> S:
        if not name.isidentifier() or name != name.lower():
            raise ValueError(f"selector name must be a lower-case identifier, got {name!r}")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"selector {name!r} is already registered ({_REGISTRY[name].__qualname__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_selectors() -> list[str]:
    """Sorted names of the registered selectors."""
    return sorted(_REGISTRY)


def selector_class(name: str) -> type[Selector]:
    """The class registered under ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV selection policy {name!r}; valid policies: "
                         f"{', '.join(available_selectors())}") from None


def selector_params(name: str) -> dict[str, ParamSpec]:
    """Hyper-parameters of the selector ``name``: ``{param: ParamSpec(type, default, range, help)}``."""
    return selector_class(name).param_specs()


def get_selector(name: str, **params: Any) -> Selector:
    """Build the selector ``name`` with the given hyper-parameters (the others keep their defaults).

    Raises
    ------
    ValueError
        Unknown name (the message lists the valid names), unknown parameter (names it and lists the
        allowed ones), or a value of the wrong type / out of range (names it and the allowed range).
    """
    cls = selector_class(name)
    specs = cls.param_specs()
    for key in params:
        if key not in specs:
            allowed = ", ".join(specs) if specs else "none"
            raise ValueError(f"{name}: unknown parameter {key!r}; allowed parameters: {allowed}")
    return cls(**params)
