"""Every kernel a compression launches compiles for the GPUs the kernels target (A100: sm_80, H100: sm_90), here.

The interpreted tests prove the kernels keep the reference's tokens, but Triton's interpreter runs a kernel's Python
with NumPy and accepts programs the CUDA compiler refuses. So the launches of real compressions (the fused step at
every granularity, joint and per head, with and without the non-finite scan; the greedy kernel and the copy of the
paths the fused step hands back, in every cache dtype) are recorded with their argument types and constants, and each
is compiled through Triton's CUDA pipeline to a cubin (:mod:`tests.compress.cuda_compile`). No GPU is needed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cords_vllm.compress.copy_triton as copy_triton
import cords_vllm.compress.step_triton as step_triton
import cords_vllm.selection.cords_triton as cords_triton
from tests.compress import test_step_triton as step_tests
from tests.compress.cuda_compile import Launch, LaunchRecorder, compile_for_cuda, mismatched_branches

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")


def _recorded(monkeypatch) -> list[Launch]:
    """Launches covering every specialisation: the fused step's three modes, joint and per head, with and without the
    non-finite scan, floating and both fp8 caches, either novelty, the normalized space, a head gather; the greedy
    kernel and the copy of the path the fused step hands back (an anchor layer that follows another anchor)."""
    recorder = LaunchRecorder()
    recorder.watch(monkeypatch, step_triton, cords_triton, copy_triton)
    runs = [("token", False, (0, 0), "bfloat16"), ("block", True, None, "bfloat16"), ("frame", False, None, "fp8_e5m2"),
            ("frame", True, (0, 0), "fp8_e4m3"), ("token", True, None, "fp8_e4m3")]
    for granularity, per_head, nan_at, kv_dtype in runs:
        step_tests._compress_twice("triton", 3, "cords", granularity, per_head, (0, 0, 2), 0.25, nan_at, kv_dtype)
    step_tests._compress_twice("triton", 3, "k_only", "token", False, (0, 0, 0), 0.25)
    step_tests._compress_twice("triton", 3, "cords_exact", "token", False, (0, 0, 0), 0.25)
    step_tests._compress_twice("triton", 3, "cords_exact_values", "frame", True, (0, 0, 0), 0.25)
    step_tests._compress_twice("triton", 3, "cords_normalized", "block", False, (0, 0, 0), 0.25)
    # a head gather (tensor parallelism; here one rank's): the units' norms made again over the gathered heads
    step_tests._compress_twice("triton", 3, "cords", "frame", False, (0, 0, 0), 0.25, gather_heads=lambda x: x)
    for kv_dtype in ("bfloat16", "fp8_e4m3"):  # an anchor that follows an anchor: the greedy kernel and the copy
        step_tests._compress_twice("triton", 3, "cords", "token", False, (0, 0, 1), 0.25, kv_dtype=kv_dtype)
    return list(recorder.launches.values())


def _at_7b_widths(launches: list[Launch]) -> list[Launch]:
    """The row-wide programs again at a 7B model's region (7,744 tokens: 8,192 lanes, their warps) and head width
    (4 heads x 128: 512 lanes), and the greedy kernel at its token units, which the interpreted runs' small shapes do
    not reach."""
    wide = []
    for launch in launches:
        if launch.name in ("step_triton:plan", "step_triton:finish"):
            wide.append(dataclasses.replace(launch, arguments={**launch.arguments, "BLOCK_T": 8192},
                                            options={**launch.options, "num_warps": step_triton._row_warps(8192)}))
        elif launch.name == "step_triton:units":
            wide.append(dataclasses.replace(launch, arguments={**launch.arguments, "BLOCK_F": 512}))
        elif launch.name == "cords_triton":  # token units of a 7B region, 512-wide components (joint selection)
            widths = cords_triton.tiles(7680, 512)
            warps = widths.pop("num_warps")
            wide.append(dataclasses.replace(launch, arguments={**launch.arguments, **widths},
                                            options={**launch.options, "num_warps": warps}))
    return wide


def test_every_launched_kernel_compiles_for_sm80_and_sm90(monkeypatch):
    launches = _recorded(monkeypatch)
    names = {launch.name for launch in launches}
    assert names == {"step_triton:plan", "step_triton:units", "step_triton:finish", "step_triton:normalize",
                     "cords_triton", "copy_triton"}
    assert len(launches) >= 12  # distinct specialisations: modes, scopes, scans, dtypes
    assert compile_for_cuda(launches) == {}


@pytest.mark.slow
def test_the_row_wide_kernels_compile_at_a_7b_models_widths(monkeypatch):
    """About a minute on 2 cores (the GPU compiles them once per width, cached on disk): in the slow suite."""
    assert compile_for_cuda(_at_7b_widths(_recorded(monkeypatch))) == {}


def test_a_kernel_the_compiler_refuses_is_reported():
    """Negative control: the check reports what the interpreter lets through."""
    x = torch.zeros(16)
    triton.jit(mismatched_branches)[(1,)](x, 3, BLOCK=16)  # interpreted on CPU: runs
    failures = compile_for_cuda([Launch("mismatched", mismatched_branches, {"x_ptr": x, "n": 3, "BLOCK": 16})], (90,))
    assert list(failures) == ["mismatched sm_90"] and "Mismatched type" in failures["mismatched sm_90"]
