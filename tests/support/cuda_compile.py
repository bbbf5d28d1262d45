"""Compile the kernels a compression launches for CUDA GPUs, on a machine without one (a CPU stand-in).

Triton's interpreter (how the tests run kernels on CPU) executes a kernel's Python with NumPy: it accepts programs that
Triton's compiler refuses (a branch whose arms give different types, an op the backend lacks, a block too wide for
the registers). :class:`LaunchRecorder` records every launch of the kernels that modules build with their
``compiled(interpret[, kernel])`` during an interpreted run, and :func:`compile_for_cuda` compiles each one, with the
argument types and constants of that launch, through Triton's own CUDA pipeline (TTIR, TTGIR, LLVM IR, PTX and
the ``ptxas`` Triton ships, to a cubin) for given compute capabilities, in a fresh interpreter. Nothing runs on a
device: this proves the kernels compile as launched, not that they are correct (the interpreted tests do that).

:func:`compiled_as_launched` (and :func:`usage_as_launched` for several) goes further for a launch's *shape* on the
GPU: it compiles the launch with Triton's own specialization of its arguments (what the JIT would compile on the
GPU: 16-divisible integers and 16-byte aligned pointers marked so) and reports what the code became, registers and
spilled stack bytes per thread and the widths of its global accesses. An H100 found a 5x slower copy and spilling
row programs that this reads on CPU.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.device_audit import watch_launches

try:
    import triton.language as tl
except ImportError:  # the tests that use this module skip without Triton
    tl = None

#: Triton's pointer element types of torch dtypes.
POINTEE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "i1"}
#: Launch keywords that are compiler options, not kernel arguments.
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas")


@dataclass
class Launch:
    """One launch: the kernel's Python function, its arguments by name, and the compiler options it was given."""

    name: str
    fn: Any
    arguments: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)

    def signature(self) -> tuple[dict[str, str], dict[str, Any]]:
        """Triton's ``(signature, constexprs)`` of this launch: pointer types from the tensors' dtypes, ``i32`` or
        ``i64`` for integers as Triton's launcher picks, ``fp32`` for floats, constants by value."""
        params = inspect.signature(self.fn).parameters
        signature, constants = {}, {}
        for name, value in self.arguments.items():
            if "constexpr" in str(params[name].annotation):
                signature[name] = "constexpr"
                constants[name] = value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + POINTEE[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{self.name}: argument {name} of type {type(value).__name__}")
        return signature, constants

    def key(self) -> tuple:
        signature, constants = self.signature()
        options = tuple(sorted(self.options.items()))
        return self.name, tuple(signature.items()), tuple(sorted(constants.items())), options


class LaunchRecorder:
    """Records the launches of the kernels ``modules`` build with ``compiled(interpret[, kernel])`` (and runs them)."""

    def __init__(self) -> None:
        self.launches: dict[tuple, Launch] = {}

    def watch(self, monkeypatch: Any, *modules: Any) -> None:
        def run(label: str, kernel: Any, grid: Any, args: tuple, kwargs: dict) -> Any:
            names = list(inspect.signature(kernel.fn).parameters)
            arguments = dict(zip(names, args, strict=False))
            arguments.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
            launch = Launch(label, kernel.fn, arguments, {k: v for k, v in kwargs.items() if k in OPTIONS})
            self.launches.setdefault(launch.key(), launch)
            return kernel[grid](*args, **kwargs)

        watch_launches(monkeypatch, modules, run)


def compile_for_cuda(launches: list[Launch], capabilities: tuple[int, ...] = (80, 90)) -> dict[str, str]:
    """Compile every launch for CUDA GPUs of each compute capability (``80``: A100, ``90``: H100) down to a cubin, in a
    fresh interpreter (the running one may have Triton's interpreter on). Returns ``{"<kernel> sm_<cc>": error}``
    for the ones Triton's compiler refused (empty: all compiled)."""
    jobs = []
    for launch in launches:
        signature, constants = launch.signature()
        jobs.append({"name": launch.name, "module": launch.fn.__module__, "function": launch.fn.__name__,
                     "signature": signature, "constants": constants, "options": launch.options})
    return _in_fresh_interpreter({"jobs": jobs, "cc": capabilities})


@dataclass(frozen=True)
class Usage:
    """What a kernel compiled to: registers and stack (spill) bytes per thread, the widths in bits of its global
    loads and stores (``128``: 16 bytes per access), and the length of its longest loop in machine instructions."""

    registers: int
    stack_bytes: int
    load_bits: tuple[int, ...]
    store_bits: tuple[int, ...]
    #: SASS instructions in the body of the kernel's longest loop (:func:`loop_instructions`; 0 without a loop).
    loop_instructions: int = 0
    #: Global loads in that loop whose address comes from a load of the same iteration (:func:`dependent_loads`).
    dependent_loads: int = 0
    #: Warp shuffles in that loop (``SHFL``): a float reduction's five rounds per warp, each waiting on the one before.
    shuffles: int = 0
    #: The lengths of every loop of the kernel (:func:`loop_lengths`), longest first.
    loops: tuple[int, ...] = ()


def compiled_as_launched(kernel: Any, args: tuple, kwargs: dict, capability: int = 90) -> Usage:
    """Compile one launch ``kernel[grid](*args, **kwargs)`` for a CUDA GPU of ``capability`` exactly as Triton's JIT
    would on that GPU (its own specialization of the arguments: integers equal to 1 made constants, 16-divisible
    integers and 16-byte aligned pointers marked so), in a fresh interpreter, and report what it compiled to (read by
    the ``cuobjdump`` Triton ships)."""
    return usage_as_launched([(kernel, args, kwargs)], capability)[0]


def usage_as_launched(launches: list[tuple[Any, tuple, dict]], capability: int = 90) -> list[Usage]:
    """:func:`compiled_as_launched` of several ``(kernel, args, kwargs)`` launches, in one fresh interpreter."""
    from tests.support.specialization import specialization

    jobs = []
    for i, (kernel, args, kwargs) in enumerate(launches):
        params = list(inspect.signature(kernel.fn).parameters)
        fixed, runtime = specialization(kernel, args, kwargs)
        fixed = dict(fixed)
        options = {k: v for k, v in fixed.items() if k in OPTIONS}
        constants = {k: v for k, v in fixed.items() if k not in OPTIONS}
        signature = {name: "constexpr" for name in constants}
        divisible = []
        for name, (kind, key) in runtime:
            signature[name] = kind
            if kind == "constexpr":
                constants[name] = key
            elif key == "D":
                divisible.append(name)
        jobs.append({"name": str(i), "module": kernel.fn.__module__, "function": kernel.fn.__name__,
                     "signature": {name: signature[name] for name in params if name in signature},
                     "constants": constants, "options": options, "divisible": divisible})
    found = _in_fresh_interpreter({"jobs": jobs, "cc": [capability], "usage": True})
    refused = {f"{launches[int(i)][0].fn.__name__} (launch {i})": u["error"] for i, u in found.items() if "error" in u}
    if refused:
        raise RuntimeError(f"Triton's compiler refused: {refused}")
    return [Usage(**{k: tuple(v) if isinstance(v, list) else v for k, v in found[str(i)].items()})
            for i in range(len(launches))]


def _in_fresh_interpreter(request: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(request),
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the compile process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mismatched_branches(x_ptr, n, BLOCK: tl.constexpr):
    """A kernel the interpreter runs and the compiler refuses (its two branches give ``y`` different types): the
    negative control of :func:`compile_for_cuda`."""
    i = tl.arange(0, BLOCK)
    if n > 0:  # noqa: SIM108 (a branch, which is the point)
        y = tl.load(x_ptr + i)
    else:
        y = 0.0
    tl.store(x_ptr + i, y)


def chained_loads(rows_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """A loop whose every step reads rows, then the values they point at (each load's address from a load of the same
    step): the negative control of :func:`dependent_loads`."""
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, n, BLOCK):
        acc += tl.load(x_ptr + tl.load(rows_ptr + j + i))
    tl.store(out_ptr + i, acc)


def float_max_loop(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """A loop whose every step takes a float maximum over the program: the control of the ``shuffles`` count (a warp
    reduces a float by shuffles; an ``int32`` by one ``REDUX``)."""
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    best = tl.zeros([], dtype=tl.float32)
    for _ in range(n):
        best = tl.max(x + best, 0)
    tl.store(out_ptr, best)


def _compile_jobs(request: dict) -> dict[str, str]:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    failures, usage = {}, {}
    for job in request["jobs"]:
        fn = getattr(importlib.import_module(job["module"]), job["function"])
        names = list(inspect.signature(fn).parameters)
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in job.get("divisible", ())}
        for cc in request["cc"]:
            source = ASTSource(fn=JITFunction(fn), signature=job["signature"], constexprs=job["constants"],
                               attrs=attrs)
            try:
                compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(job["options"]))
            except Exception as error:  # report every refusal, not the first
                failures[f"{job['name']} sm_{cc}"] = f"{type(error).__name__}: {error}"[-2000:]
                usage[job["name"]] = {"error": failures[f"{job['name']} sm_{cc}"]}
                continue
            if request.get("usage"):
                usage[job["name"]] = _usage(compiled)
    return usage if request.get("usage") else failures


def _usage(compiled: Any) -> dict:
    """Registers and stack bytes (``cuobjdump --dump-resource-usage`` of the cubin) and global access widths (PTX)."""
    import re
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                                check=True).stdout
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    ptx = compiled.asm["ptx"]

    def bits(op: str) -> list[int]:  # e.g. ld.global.v4.b32: 4 x 32 bits
        widths = set()
        for instruction in re.findall(rf"\b{op}\.global\S*", ptx):
            lanes = re.search(r"\.v(\d)\.", instruction)
            widths.add(int(lanes.group(1) if lanes else 1) * int(re.search(r"\.[bsuf](\d+)$", instruction).group(1)))
        return sorted(widths)

    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2)), "load_bits": tuple(bits("ld")),
            "store_bits": tuple(bits("st")), "loop_instructions": loop_instructions(sass),
            "dependent_loads": dependent_loads(sass),
            "shuffles": sum(_opcode(text).startswith("SHFL") for text in _longest_loop(sass)),
            "loops": loop_lengths(sass)}


def _loops(sass: str) -> list[list[str]]:
    """The instructions (text, predicate included) of each loop of a kernel's SASS, longest first: from the target of
    a backward branch to the branch, both included."""
    import re

    address = [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = []
    for at, text in address:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) <= at:
            spans.append((int(target.group(1), 16), at))
    loops = [[text for at, text in address if start <= at <= end] for start, end in spans]
    return sorted(loops, key=len, reverse=True)


def _longest_loop(sass: str) -> list[str]:
    """The instructions of the longest loop of a kernel's SASS (:func:`_loops`); empty where no branch goes back."""
    loops = _loops(sass)
    return loops[0] if loops else []


def loop_lengths(sass: str) -> tuple[int, ...]:
    """The length in machine instructions of every loop of a kernel's SASS, longest first."""
    return tuple(len(loop) for loop in _loops(sass))


def _opcode(text: str) -> str:
    """An instruction's opcode (``SHFL.BFLY``), past its predicate (``@!P0``) if it has one."""
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def _registers(operand: str, wide: bool) -> set[str]:
    """General registers an operand names: ``R12``, a pair ``R12.64`` (or any register of a 64-bit op), a vector's
    base ``R12`` of a 128-bit access (four), the address registers of ``desc[UR4][R12.64+0x8]``."""
    import re

    found = set()
    for base, suffix in re.findall(r"\bR(\d+)(\.64|\.128)?", operand):
        width = 4 if suffix == ".128" else 2 if suffix == ".64" or wide else 1
        found |= {f"R{int(base) + i}" for i in range(width)}
    return found


def dependent_loads(sass: str) -> int:
    """Global loads in the longest loop of a kernel's SASS whose address depends on a value a global load of the same
    iteration brought: each such load waits for the other to return before it can even issue, so an iteration that
    chains ``n`` of them waits ``n`` memory latencies. Registers written by a load are followed through every
    instruction that reads them (to their destinations) down the loop body; values carried in from the iteration
    before count as independent. ``0``: every load of an iteration can be in flight at once."""
    tainted: set[str] = set()
    chained = 0
    for text in _longest_loop(sass):
        words = text.split(None, 2) if text.startswith("@") else ["", *text.split(None, 1)]
        op, operands = words[1], words[2] if len(words) > 2 else ""
        parts = [p.strip() for p in operands.split(",")] if operands else []
        if not parts or op.startswith(("ST", "BRA", "BAR", "RED", "ATOM", "ISETP", "FSETP", "HSETP")):
            continue  # no general register written (stores, branches, barriers, predicate sets)
        wide = ".64" in op or ".WIDE" in op
        load = op.startswith(("LDG", "LD."))
        width = 4 if ".128" in op else 2 if ".64" in op else 1
        dest = {f"R{int(r[1:]) + i}" for r in _registers(parts[0], False) for i in range(width if load else 1)}
        if wide and not load:
            dest |= _registers(parts[0], True)
        sources = set().union(*(_registers(p, wide) for p in parts[1:]))
        if load:
            chained += bool(sources & tainted)
            tainted |= dest
        elif sources & tainted:
            tainted |= dest
        else:
            tainted -= dest
    return chained


def loop_instructions(sass: str) -> int:
    """Machine instructions in the body of the longest loop of a kernel's SASS (``cuobjdump -sass``): from the target
    of a backward branch to the branch, both included; 0 where no branch goes back.

    A loop whose every iteration waits on the one before (the greedy kernel's steps) takes at least the cycles its SM
    needs to issue the body for all warps, one instruction per cycle per scheduler for ``num_warps / 4`` warps each:
    the body's length is a floor on its time that a machine without a GPU can read (latency adds to it)."""
    return len(_longest_loop(sass))


if __name__ == "__main__":
    print(json.dumps(_compile_jobs(json.loads(sys.stdin.read()))))
