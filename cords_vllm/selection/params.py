"""Hyper-parameters of a selector: declaration (:func:`hyperparameter`), description and validation.

A selector is a frozen dataclass whose hyper-parameters are fields declared with :func:`hyperparameter`.
:func:`param_specs_of` reads them back as :class:`ParamSpec` (what ``--help`` and config references print)
and :func:`check_params` validates and normalises their values when the selector is built.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

#: Key of the field metadata that marks a dataclass field as a hyper-parameter.
_META_KEY = "cords_param"


@dataclass(frozen=True)
class ParamSpec:
    """Description of one hyper-parameter of a selector (what ``--help`` and config references print).

    Attributes
    ----------
    name:
        Field name, also the key accepted by :func:`~cords_vllm.selection.get_selector`.
    type:
        ``float``, ``int`` or ``str``.
    default:
        Default value.
    low, high:
        Inclusive bounds for numbers (``None`` = unbounded); ``low_open``/``high_open`` make them strict.
    choices:
        Allowed values of a ``str`` parameter.
    help:
        One-line description.
    """

    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None

    def allowed(self) -> str:
        """Human-readable allowed values: ``in [0, 1]``, ``an integer in [0, inf)``, ``one of 'a', 'b'``."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        lo = "-inf" if self.low is None else _fmt(self.low)
        hi = "inf" if self.high is None else _fmt(self.high)
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        kind = "an integer in " if self.type is int else "in "
        return f"{kind}{left}{lo}, {hi}{right}"

    def check(self, owner: str, value: Any) -> Any:
        """Validate (and normalise) ``value``; raise ``ValueError`` naming the parameter otherwise."""
        where = f"{owner}: parameter '{self.name}'"
        if self.type is str:
            if not isinstance(value, str) or (self.choices is not None and value not in self.choices):
                raise ValueError(f"{where} must be {self.allowed()}, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where} must be a number {self.allowed()}, got {value!r}")
        if self.type is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"{where} must be {self.allowed()}, got {value!r}")
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{where} must be {self.allowed()}, got {value!r}")
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if too_low or too_high:
            raise ValueError(f"{where} must be {self.allowed()}, got {value!r}")
        return value


def _fmt(x: float) -> str:
    """A bound as printed by :meth:`ParamSpec.allowed`: ``1`` rather than ``1.0``, ``0.5`` as is."""
    return str(int(x)) if float(x).is_integer() else repr(x)


def hyperparameter(
    default: Any,
    *,
    help: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """Declare a selector field as a validated hyper-parameter (``dataclasses.field`` with metadata)."""
    meta = {"low": low, "high": high, "low_open": low_open, "high_open": high_open, "choices": choices,
            "help": help}
    return field(default=default, metadata={_META_KEY: meta})


def param_specs_of(cls: type) -> dict[str, ParamSpec]:
    """The hyper-parameters of the dataclass ``cls`` (fields declared with :func:`hyperparameter`).

    Returns
    -------
    dict[str, ParamSpec]
        By field name, in declaration order. A field annotated ``int`` or ``float`` is a number of that
        type; any other annotation is a ``str`` parameter.
    """
    hints = typing.get_type_hints(cls)
    specs: dict[str, ParamSpec] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META_KEY)
        if meta is None:
            continue
        hint = hints[f.name]
        typ = hint if hint in (int, float) else str
        specs[f.name] = ParamSpec(name=f.name, type=typ, default=f.default, **meta)
    return specs


def check_params(obj: Any, owner: str) -> None:
    """Validate every hyper-parameter of the dataclass instance ``obj`` and store its normalised value.

    Works on frozen dataclasses (the value is written with ``object.__setattr__``). Raises ``ValueError``
    naming ``owner`` and the parameter (see :meth:`ParamSpec.check`).
    """
    for spec in param_specs_of(type(obj)).values():
        value = spec.check(owner, getattr(obj, spec.name))
        object.__setattr__(obj, spec.name, value)
