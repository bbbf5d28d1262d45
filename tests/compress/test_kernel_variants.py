"""A compression of another size compiles nothing: one variant of each fused-step kernel, whatever the sizes.

Triton compiles a kernel once per *specialization* of its arguments: besides the constexprs, every integer is told
apart at the value 1 and at multiples of 16, and every pointer at 16-byte alignment. The fused step's sizes change
from one compression to the next (region tokens, held tokens, unit counts, budgets, kept tokens, rows of a step's
shared buffers), so on a GPU every new combination of those classes would stop the engine's step for a compile of
seconds, long after start-up. Each kernel is jitted with those arguments unspecialized
(``step_kernels.NOT_SPECIALIZED``, ``cords_triton.NOT_SPECIALIZED``, ``copy_triton.NOT_SPECIALIZED``).

Checked here with Triton's own specialization function on every launch of many compressions (first and second
ones, alone and a step's together, at every unit), under the interpreter: within one set of constexprs, every
launch of a kernel has the same specialization. The control: the same launches specialized on every argument, as
Triton's default would, give several variants, so the sizes do vary.
"""

from __future__ import annotations

import pytest
import torch

from cords_vllm.compress import copy_triton, step_triton
from cords_vllm.compress.kv_access import PagedAccessor
from cords_vllm.compress.step import RegionBatch, RegionCompression, SelectionSetup, compress_region, compress_regions
from cords_vllm.selection import cords_triton, get_selector
from tests.support.device_audit import watch_launches
from tests.support.regions import first_batches, later_batch
from tests.support.specialization import specialization as _specialization

pytest.importorskip("triton")

LAYERS, HEADS, D, BS, FRAME, BLOCKS = 4, 2, 8, 4, 6, 96
#: Per request: protected text tokens, frames, kept blocks (regions of 40-56 tokens: one row width for the kernels).
REQUESTS = ((5, 6, 4), (6, 7, 5), (8, 8, 7), (7, 6, 6))


def _batches(granularity: str) -> list[RegionBatch]:
    return first_batches([(text, frames, keep, granularity) for text, frames, keep in REQUESTS], FRAME, BS, BLOCKS)


@pytest.mark.parametrize("granularity", ["token", "block", "frame"])
def test_each_kernel_compiles_once_whatever_the_sizes(monkeypatch, granularity):
    if not copy_triton.interpreting():
        pytest.skip("the launches are recorded on CPU under TRITON_INTERPRET=1")
    launches: list[tuple[str, tuple, tuple, tuple]] = []

    def run(label, kernel, grid, args, kwargs):
        fixed, runtime = _specialization(kernel, args, kwargs, everything=False)
        launches.append((label, fixed, runtime, _specialization(kernel, args, kwargs, everything=True)[1]))
        return kernel[grid](*args, **kwargs)

    watch_launches(monkeypatch, (step_triton, cords_triton, copy_triton), run)
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(BLOCKS, HEADS, BS, 2 * D, generator=g) for _ in range(LAYERS)]
    accessors = [PagedAccessor.of(caches[0], D)] * LAYERS
    setup = SelectionSetup(get_selector("cords"), granularity, False, (0, 0, 2, 2), kernels="triton")
    batches = _batches(granularity)
    texts = [text for text, _, _ in REQUESTS]
    held = [compress_region(caches, accessors, [None] * LAYERS, b, setup) for b in batches[:2]]  # alone
    for h, b, text in zip(held, batches, texts, strict=False):
        compress_region(caches, accessors, h, later_batch(b, text, BS), setup)
    held = compress_regions(caches, accessors, [RegionCompression([None] * LAYERS, b) for b in batches[1:]], setup)
    compress_regions(caches, accessors, [RegionCompression(h, later_batch(b, text, BS)) for h, b, text in
                                         zip(held, batches[1:], texts[1:], strict=True)], setup)

    labels = {label for label, *_ in launches}
    assert {"step_triton:plan", "step_triton:units", "cords_triton", "step_triton:finish", "copy_triton"} <= labels
    variants: dict[tuple, set] = {}
    default: dict[tuple, set] = {}
    for label, fixed, runtime, everything in launches:
        variants.setdefault((label, fixed), set()).add(runtime)
        default.setdefault((label, fixed), set()).add(everything)
    assert {key: len(v) for key, v in variants.items() if len(v) > 1} == {}
    # The control: specialized on every argument, as Triton's default, the same launches compile several variants.
    for label in ("step_triton:plan", "step_triton:finish", "copy_triton"):
        assert sum(len(v) for (name, _), v in default.items() if name == label) > sum(
            len(v) for (name, _), v in variants.items() if name == label), label
