"""The GPU check's steps other than the servers: the tiny model, the device, HF exactness, the CUDA-gated tests
and the two kernel benchmarks, each run in a child process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from cords_vllm.lab.gpu_check.processes import REPO, first_error, python_env
from cords_vllm.lab.gpu_check.rows import Fail, Row, Skip, timed


def build_model() -> str:
    """The tests' tiny Qwen2-VL (bf16), built once per machine; returns its directory."""
    from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_qwen2vl

    return str(build_tiny_qwen2vl(TinyModelSpec(dtype="bfloat16")))


def exactness_row(model_dir: str, out: Path, compressed_layers: int | None = None) -> Row:
    """Run :mod:`cords_vllm.lab.reference.exactness` in its own process (it builds an in-process engine);
    ``compressed_layers``: the layer-selective form (the lowest layers compressed, the others whole)."""

    def check() -> str:
        env = {**python_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CORDS_VLLM_TRACE": "1"}
        scope = [] if compressed_layers is None else ["--compressed-layers", str(compressed_layers)]
        proc = subprocess.run([sys.executable, "-m", "cords_vllm.lab.reference.exactness", model_dir, "--json", *scope],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
        log = "exactness.log" if compressed_layers is None else f"exactness_layers_{compressed_layers}.log"
        (out / log).write_text(proc.stdout + proc.stderr)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise Fail(f"exit status {proc.returncode}: {first_error(proc.stderr)}")
        result = json.loads(lines[-1])
        if not result["passed"]:
            raise Fail(result["summary"])
        return result["summary"]

    if compressed_layers is None:
        return timed("HF exactness (fp32, compressed engine = HF reference)", check)
    return timed(f"HF exactness, layers 0..{compressed_layers - 1} compressed, the others whole", check)


def cuda_gated_tests(root: Path = REPO) -> list[str]:
    """``tests/compress`` and every other test file with a test skipped without CUDA."""
    gated = {"tests/compress"}
    for path in sorted((root / "tests").rglob("test_*.py")):
        if re.search(r"skipif\(\s*not\s+torch\.cuda\.is_available\(\)", path.read_text()):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith("tests/compress/"):
                gated.add(rel)
    return sorted(gated)


def pytest_row(cpu: bool, out: Path) -> Row:
    """pytest on :func:`cuda_gated_tests` (SKIP in ``--cpu`` mode)."""

    def run() -> str:
        if cpu:
            raise Skip("no CUDA device in --cpu mode (the CPU stand-ins run in the default suite)")
        files = cuda_gated_tests()
        import importlib.util

        workers = ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []  # one GPU, four processes
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *workers,
                               *files],
                              cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=3600, check=False)
        (out / "pytest-cuda.log").write_text(proc.stdout + proc.stderr)
        last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
        if proc.returncode != 0:
            raise Fail(f"pytest exit status {proc.returncode}: {last[0]} (see pytest-cuda.log)")
        return f"{' '.join(files)}: {last[0]}"

    return timed("CUDA-gated tests (pytest)", run)


def compress_step_row(cpu: bool, out: Path) -> Row:
    """``benchmarks/compress_step.py`` (the compress step: Triton kernels vs the PyTorch path vs the copy floor;
    SKIP in ``--cpu`` mode). FAIL when a kernel keeps other tokens than the PyTorch path; the speed targets are
    reported, not enforced."""

    def run() -> str:
        if cpu:
            raise Skip("no CUDA device in --cpu mode (the kernels run under TRITON_INTERPRET=1 in the default suite)")
        proc = subprocess.run([sys.executable, "benchmarks/compress_step.py", "--out", str(out / "compress_step")],
                              cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=1800, check=False)
        (out / "compress_step.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise Fail(f"exit status {proc.returncode}: {first_error(proc.stdout + proc.stderr)} "
                       "(see compress_step.log)")
        result = json.loads((out / "compress_step" / "compress_step.json").read_text())
        met = [t for t in result["targets"] if t["met"]]
        return f"same kept ids; {len(met)} of {len(result['targets'])} speed targets met (compress_step/*.md)"

    return timed("compress-step benchmark (kernels vs PyTorch)", run)


def step_together_row(cpu: bool, out: Path) -> Row:
    """``benchmarks/step_together.py --granularity token`` (a step's compressions together against one after another,
    Triton kernels and PyTorch path; SKIP in ``--cpu`` mode). FAIL when together keeps other tokens or leaves other
    caches than alone; the speed-up is reported."""

    def run() -> str:
        if cpu:
            raise Skip("no CUDA device in --cpu mode (compress_regions is tested in the default suite)")
        result_dir = out / "step_together"
        proc = subprocess.run([sys.executable, "benchmarks/step_together.py", "--granularity", "token", "--out",
                               str(result_dir)], cwd=REPO, env=python_env(), capture_output=True, text=True,
                              timeout=1800, check=False)
        (out / "step_together.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise Fail(f"exit status {proc.returncode}: {first_error(proc.stdout + proc.stderr)} "
                       "(see step_together.log)")
        rows = json.loads((result_dir / "step_together.json").read_text())["rows"]
        most = max(r["requests"] for r in rows)
        gains = ", ".join(f"{r['kernels']} {r['speedup']:.2f}x" for r in rows if r["requests"] == most)
        return f"same tokens and caches; {most} compressions together vs alone: {gains}"

    return timed("a step's compressions together (token granularity)", run)


def cuda_device_row() -> Row:
    """The CUDA device vLLM will use (FAIL without one: the check needs ``--cpu`` then)."""

    def probe() -> str:
        code = ("import torch, vllm; assert torch.cuda.is_available(), 'torch sees no CUDA device'; "
                "print(torch.cuda.get_device_name(0), 'CUDA', torch.version.cuda, 'torch', torch.__version__, "
                "'vLLM', vllm.__version__)")
        proc = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True, text=True,
                              timeout=300, check=False)
        if proc.returncode != 0:
            raise Fail(f"{first_error(proc.stderr)} (on a machine without a GPU, run with --cpu)")
        return proc.stdout.strip().splitlines()[-1]

    return timed("CUDA device", probe)
