"""How the project declares its Triton kernels: ``@kernel(...)`` on a kernel a host launches, ``@device_function``
on a helper kernels call (Triton inlines it into each kernel that calls it). ``grep -rn "@kernel\\|@device_function"``
lists them all (:mod:`cords_vllm.compress.step_kernels`, :mod:`cords_vllm.compress.copy_triton`,
:mod:`cords_vllm.selection.cords_triton`).

``@device_function`` is ``@triton.jit`` where Triton imports (the function as it is where it does not): a kernel
finds its helpers jitted, by name, when it compiles (or runs in the interpreter).

``@kernel(do_not_specialize=..., do_not_specialize_on_alignment=...)`` takes ``triton.jit``'s options (the arguments
Triton must not specialize on their value or alignment, so that a compression of another size compiles nothing) but
defers the jit to first use, :func:`jitted`; it notes the options on the function and returns the function itself.
The jit is deferred because:

* ``triton.jit`` decides when it runs whether a kernel is interpreted (``TRITON_INTERPRET=1`` then: Triton's CPU
  interpreter, how the tests run the kernels without a GPU) or compiled. :func:`jitted` is cached per kernel and per
  mode (each module's ``compiled(interpret[, kernel])`` passes
  :func:`~cords_vllm.kernel_backend.interpreting`'s answer at the launch), so the mode is the one in force when a
  kernel first runs, not when its module was imported;
* Triton may not be installed (the PyTorch path runs without it): the kernels' modules import all the same, and
  nothing is jitted until a kernel launches;
* the module attribute stays the kernel's Python function, which is what Triton's compiler takes
  (``JITFunction(fn)``: how ``tests/support/cuda_compile.py`` compiles a recorded launch for CUDA GPUs in a fresh
  process) and what each module's ``compiled`` builds its jitted kernels from (``tests/support/device_audit.py``
  wraps ``compiled`` to watch the launches).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

try:
    import triton
except ImportError:
    triton = None

F = TypeVar("F", bound=Callable[..., Any])


def kernel(do_not_specialize: Sequence[str] = (), do_not_specialize_on_alignment: Sequence[str] = ()
           ) -> Callable[[F], F]:
    """Declare a Triton kernel, jitted on first use by :func:`jitted` with ``triton.jit``'s options
    ``do_not_specialize`` (integer arguments, by name) and ``do_not_specialize_on_alignment`` (pointer arguments)."""
    def declare(fn: F) -> F:
        fn.jit_options = {"do_not_specialize": tuple(do_not_specialize),  # type: ignore[attr-defined]
                          "do_not_specialize_on_alignment": tuple(do_not_specialize_on_alignment)}
        return fn
    return declare


@functools.cache
def jitted(fn: Callable[..., Any], interpret: bool) -> Any:
    """The kernel ``fn`` (declared with :func:`kernel`) jitted with its options, once per ``interpret`` (whether
    Triton's interpreter is on at the call: ``triton.jit`` reads ``TRITON_INTERPRET`` when it runs)."""
    return triton.jit(fn, **fn.jit_options)


def device_function(fn: F) -> F:
    """Declare a Triton device function (a helper kernels call): ``triton.jit(fn)`` where Triton imports."""
    return fn if triton is None else triton.jit(fn)
