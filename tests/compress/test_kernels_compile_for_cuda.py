"""Every kernel a compression launches compiles for the GPUs the kernels target (A100: sm_80, H100: sm_90), here.

The interpreted tests prove the kernels keep the reference's tokens, but Triton's interpreter runs a kernel's Python
with NumPy and accepts programs the CUDA compiler refuses. So the launches of real compressions (the fused step at
every granularity, joint and per head, with and without the non-finite scan; the greedy kernel and the copy of the
paths the fused step hands back, in every cache dtype) are recorded with their argument types and constants, and each
is compiled through Triton's CUDA pipeline to a cubin (:mod:`tests.support.cuda_compile`). No GPU is needed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cords_vllm.compress.copy_triton as copy_triton
import cords_vllm.compress.step_kernels as step_kernels
import cords_vllm.compress.step_triton as step_triton
import cords_vllm.selection.cords_triton as cords_triton
from tests.compress import test_step_triton as step_tests
from tests.support.cuda_compile import Launch, LaunchRecorder, compile_for_cuda, mismatched_branches

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
                                            options={**launch.options, "num_warps": step_kernels._row_warps(8192)}))
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
    if copy_triton.interpreting():  # interpreted on CPU, it runs (compiled, on a GPU, it would not)
        triton.jit(mismatched_branches)[(1,)](x, 3, BLOCK=16)
    failures = compile_for_cuda([Launch("mismatched", mismatched_branches, {"x_ptr": x, "n": 3, "BLOCK": 16})], (90,))
    assert list(failures) == ["mismatched sm_90"] and "Mismatched type" in failures["mismatched sm_90"]



def _copy_launch(monkeypatch, caches: list[torch.Tensor], num_keep: int) -> tuple:
    """The copy's launch ``(kernel, args, kwargs)`` moving ``num_keep`` rows of ``caches`` (it runs too)."""
    seen = []
    monkeypatch.setattr(copy_triton, "launch", lambda name, kernel, grid, *args, **kwargs: seen.append(
        (kernel, args, kwargs)) or kernel[grid](*args, **kwargs))
    positions = torch.arange(num_keep).view(1, 1, num_keep).expand(1, caches[0].shape[1], num_keep)
    slots = torch.arange(caches[0].shape[0] * caches[0].shape[2])
    copy_triton.copy_kept(caches, positions, [0] * len(caches), slots, slots[:num_keep])
    return seen[0]


def test_the_copy_moves_16_bytes_per_access_without_spilling_at_a_7b_models_layout(monkeypatch):
    """The copy compiled for sm_90 as Triton's JIT compiles it there (its own specialization of the arguments; a kept
    count that is no multiple of 16, as most are), at a Qwen2-VL-7B layer's layout (bf16, 4 KV heads x 2 x 128,
    blocks of 16): 16-byte loads and stores, and no register spills. Without its alignment hint the copy moved one
    element per access (and, at its former tile of 256 rows and 8 warps, spilled 2 KB per thread): an H100 timed it
    at 3.1 ms against 0.43 ms with the hint, at that tile. The control compiles the same launch without the hint and
    finds one element per access."""
    if not copy_triton.interpreting():
        pytest.skip("the launch is recorded on CPU under TRITON_INTERPRET=1")
    from tests.support.cuda_compile import compiled_as_launched

    caches = [torch.zeros(24, 4, 16, 256, dtype=torch.bfloat16) for _ in range(3)]
    kernel, args, kwargs = _copy_launch(monkeypatch, caches, num_keep=37)
    assert kwargs["ALIGN"] == 8  # bf16 elements per 16 bytes
    usage = compiled_as_launched(kernel, args, kwargs)
    assert usage.stack_bytes == 0 and max(usage.load_bits) == 128 and usage.store_bits == (128,), usage
    control = compiled_as_launched(kernel, args, {**kwargs, "ALIGN": 1})
    assert control.store_bits == (16,), control


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_the_copy_claims_16_byte_accesses_only_where_every_layer_allows_them(dtype):
    """``alignment``: elements per 16 bytes where every layer's tokens start 16-byte aligned, else 1."""
    size = torch.empty((), dtype=dtype).element_size()
    cache = torch.zeros(8, 2, 4, 64, dtype=dtype)  # torch's allocations are 16-byte aligned
    after = cache.numel() * size  # a second layer's byte offset, right after the first
    assert copy_triton.alignment(cache, [0, after], 64) == 16 // size
    assert copy_triton.alignment(cache, [0, after + size], 64) == 1  # a layer one element off
    assert copy_triton.alignment(cache, [0], 8 // size) == 1  # a chunk of half a word
    assert copy_triton.alignment(cache[..., :63], [0], 64) == 1  # channels of part of a word
    assert copy_triton.alignment(torch.zeros(8, 2, 4, 128, dtype=dtype)[..., ::2], [0], 64) == 1  # strided channels
    assert copy_triton.alignment(torch.zeros(cache.numel() + 1, dtype=dtype)[1:].view(8, 2, 4, 64), [0], 64) == 1


def test_a_step_of_the_units_sum_waits_on_one_load_not_a_chain(monkeypatch):
    """A token's address is three loads, each from the one before (its row, its slot, its channels): the units
    kernel's sum reads the channels of one tile, the slots of the next and the rows of the one after in each step, so
    none of a step's loads waits on another (one memory latency per step; chained, a 256-token frame of 64 steps waited
    on 192 in a row, and that kernel took 0.16 ms of a 1.22 ms frame compression on an H100). Compiled for sm_90 at a
    7B model's 512 lanes (its spills and 16-byte reads at a 7B server's layout: the slow warm-up test). The control:
    a loop that reads rows, then what they point at."""
    if not step_triton.interpreting():
        pytest.skip("the launch is recorded on CPU under TRITON_INTERPRET=1")
    from tests.support.cuda_compile import chained_loads, usage_as_launched

    seen = []
    run = step_triton.launch
    monkeypatch.setattr(step_triton, "launch", lambda name, kernel, grid, *args, **kwargs: (
        name == "units" and seen.append((kernel, args, kwargs))) or run(name, kernel, grid, *args, **kwargs))
    step_tests._compress_twice("triton", 3, "cords", "frame", False, (0, 0, 0), 0.25)
    kernel, args, kwargs = seen[0]
    rows, x = torch.zeros(64, dtype=torch.int32), torch.zeros(64)
    units, chain = usage_as_launched([(kernel, args, {**kwargs, "BLOCK_F": 512, "TILE_T": 4, "ALIGN": 8}),
                                      (triton.jit(chained_loads), (rows, x, torch.zeros(16), 64), {"BLOCK": 16})])
    assert units.loop_instructions > 0 and units.dependent_loads == 0, units
    assert chain.dependent_loads > 0, chain


def _greedy_launch(monkeypatch, units: int, **params) -> tuple:
    """The greedy kernel's launch (``(kernel, args, kwargs)``, recorded, not run) for one problem of ``units`` units
    of a Qwen2-VL-7B model's features (4 KV heads x 128, keys and values), keeping three in four, with ``cords``'s
    defaults but for ``params``."""
    seen = []
    monkeypatch.setattr(cords_triton, "launch", lambda name, kernel, grid, *args, **kwargs: seen.append(
        (kernel, args, kwargs)))
    feats = torch.randn(1, units, 1024)
    keys, values = feats[..., :512], feats[..., 512:]
    keep = units * 3 // 4
    defaults = {"alpha": 0.25, "eta": 0.25, "lam": 0.25, "eps0": 1e-6, "novelty": "max_cosine"} | params
    cords_triton.greedy_from_units(feats, 512, keys.norm(dim=-1), values.norm(dim=-1), (keys + values).norm(dim=-1),
                                   torch.ones(1, units, dtype=torch.int8), torch.tensor([keep]), keep,
                                   cords_triton.GreedyParams(**defaults))
    return seen[0]


def test_a_greedy_step_compiles_to_under_500_instructions_and_reduces_without_shuffles(monkeypatch):
    """The greedy kernel's steps each wait on the one before, and at token granularity one program (one SM) steps
    through 7,744 units 6,144 times: a step takes at least the cycles the SM needs to issue its instructions for 32
    warps (an H100 timed 4.5 us per step, 27.5 ms per compression, when the loop was 672 instructions: 3 us of
    issue at the least), plus the latency of its program-wide reductions. Compiled for sm_90 as Triton's JIT compiles
    it there, the loop of ``cords``'s default step is at most 500 instructions (492 with Triton 3.9; 577 when its
    reductions were of floats, 672 with a boolean pool beside the distances), and no warp shuffles: each warp reduces
    in one ``REDUX`` per value, where a float took five shuffles and five comparisons in a chain. Once the pool fits
    in half the row (the last 2,560 of those steps) the steps go on over the pool alone, in a loop of at most 330
    (314). At block units (480 units, 16 warps), where the reductions' latency is the step, at most 160 (151; 235
    before), in one loop. The controls: the plain D^2 step (``lam = 0``, no novelty) is shorter still, so the count
    follows the work; a loop over a float maximum shuffles."""
    if not cords_triton.interpreting():
        pytest.skip("the launch is recorded on CPU under TRITON_INTERPRET=1")
    from tests.support.cuda_compile import float_max_loop, usage_as_launched

    token, d2 = _greedy_launch(monkeypatch, 7744), _greedy_launch(monkeypatch, 7744, lam=0.0)
    control = (triton.jit(float_max_loop), (torch.zeros(64), torch.zeros(1), 8), {"BLOCK": 64})
    cords, d2, block, floats = usage_as_launched([token, d2, _greedy_launch(monkeypatch, 480), control])
    assert 0 < cords.loop_instructions <= 500 and cords.shuffles == 0, cords
    assert 0 < cords.loops[1] <= 330, cords  # the compacted steps
    assert 0 < block.loop_instructions <= 160 and block.shuffles == 0 and block.loops[1] < 60, block
    assert 0 < d2.loop_instructions < cords.loop_instructions and d2.shuffles == 0, (d2, cords)
    assert floats.shuffles > 0, floats
