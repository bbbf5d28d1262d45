"""Triton's own specialization of a kernel launch: what decides whether a launch compiles a new variant.

Triton compiles a kernel once per set of constexprs and compiler options and per *specialization* of its other
arguments: every integer told apart at the value 1 and at multiples of 16, every pointer at 16-byte alignment, but
those a kernel leaves unspecialized (``do_not_specialize``, ``do_not_specialize_on_alignment``). Shared by the tests
of the kernels' variants and of the start-up warm-up.
"""

from __future__ import annotations

import inspect
from typing import Any

#: Launch keywords that are compiler options, not kernel arguments.
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas")


def specialization(kernel: Any, args: tuple, kwargs: dict, everything: bool = False) -> tuple[tuple, tuple]:
    """``(constexprs and options, runtime specialization)`` of one launch, as Triton's JIT computes them (with
    ``everything``: as it would with no argument left unspecialized)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    params = inspect.signature(kernel.fn).parameters
    given = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k not in OPTIONS}
    jit_args = getattr(kernel, "kwargs", None) or vars(kernel)
    sizes = set(jit_args.get("do_not_specialize") or ())
    pointers = set(jit_args.get("do_not_specialize_on_alignment") or ())
    fixed, runtime = [], []
    for name, value in given.items():
        if "constexpr" in str(params[name].annotation):
            fixed.append((name, value))
        else:
            runtime.append((name, native_specialize_impl(BaseBackend, value, False, everything or name not in sizes,
                                                         everything or name not in pointers)))
    fixed += sorted((k, v) for k, v in kwargs.items() if k in OPTIONS)
    return tuple(fixed), tuple(runtime)
