"""The compress step: read a request's held region, select what to keep, compact it in place (pure torch).

One call carries out one :class:`~cords_vllm.compress.plan.CompressionPlan` on the paged KV cache of every
layer, as a function of tensors only (no vLLM object), so any engine adapter, model family or kernel can
drive it:

1. ``held ++ new``: the region's tokens per layer and head, in row order (the previously kept tokens, then
   the tokens that entered the region with this compression), each with what the step needs to know of it:
   its id, whether it is a candidate (video) and its frame label (:class:`HeldTokens`). The previously kept
   ones carry theirs from the compression that kept them, so the step never looks at the request's history
   (a re-based stream has none left).
2. Anchor layers read those tokens (:class:`~cords_vllm.compress.kv_access.KVAccessor`), decode them
   (:class:`~cords_vllm.compress.kv_codec.KVCodec`: an fp8 cache with its scales) and run
   :func:`~cords_vllm.selection.exact.select_exact` on their candidates (the rest is protected).
3. Every layer copies the tokens at its anchor's positions, as stored (raw elements: no re-quantisation), into
   the first ``num_keep / block_size`` source blocks, in logical order. A layer's sources are read in full
   before it is written, so kept blocks may overlap sources.

:func:`compress_regions` carries out an engine step's compressions (one per request) in one call: each exactly as
:func:`compress_region` would, with the greedy orders of every request computed in one policy call
(:mod:`~cords_vllm.selection.together`), which on a CPU costs about what one request's order costs.

Everything lives on the caches' device; the host supplies only the plan's integers (in
:class:`RegionBatch`), so the step itself never reads a tensor back to the host, and it passes those integers
on (the candidate count, through :func:`~cords_vllm.selection.exact.select_exact`) so that the selection reads
back only what no host integer gives.

Budgets (:data:`HOST_SYNCS_PER_COMPRESSION`, enforced on CPU by ``tests/compress/test_host_syncs.py`` with an
aten-level counter, for every registered policy at its default settings, joint or per head, first or later
compression): host synchronisations per call, whatever the number of layers, anchors or kept tokens:

* token and block granularity: **0**;
* frame granularity: **1**, the read of the most frames a problem's candidates form and of the frame budget
  (both data-dependent: earlier compressions chose on the device which frames the region still holds, and
  trimmed one of them);
* blocking host-to-device uploads: **0** (constants are Python scalars or device fills, the random policy's
  host draw is copied from pinned memory without blocking).

The one exception is an ablation setting: CoRDS with ``novelty="exact"`` reads its saturation flag once per
greedy step from step ``H * D`` until its residuals vanish (once in the tests' random caches).

Tensor parallelism: joint selection gathers the anchors' keys and values of every rank's KV heads once per call
(:attr:`SelectionSetup.gather_heads`; bytes in :mod:`cords_vllm.compress.tensor_parallel`), so every rank keeps
the same tokens as one rank holding all heads would; per-head selection exchanges nothing.

Kernel launches (this PyTorch path): a fixed list per greedy step of the greedy policies
(:data:`~cords_vllm.selection.cords.OPS_PER_GREEDY_STEP`: 30 for CoRDS, 22 for k_only / v_only), one step per
kept token at token granularity, per kept block or frame otherwise, plus a few hundred per call. Where Triton runs,
the policies and caches :mod:`~cords_vllm.compress.step_triton` covers take its fused step instead: 7 launches
(8 with an fp8 cache) whatever the granularity, layer count or anchor count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cords_vllm.compress.kv_access import KVAccessor, PagedAccessor, run_view
from cords_vllm.compress.kv_codec import KVCodec, PlainCodec
from cords_vllm.compress.region import HeldTokens, RegionBatch, SelectionSetup, finite_features
from cords_vllm.kernel_backend import describe, kernels_in_force, use_triton
from cords_vllm.selection.exact import select_exact_steps
from cords_vllm.selection.together import SelectionSteps, driven_alone, run_alone, run_together

#: Host synchronisations one :func:`compress_region` call makes at most, per granularity (see the module
#: docstring): measured on CPU by counting ``_local_scalar_dense`` / ``is_nonzero`` / ``nonzero`` / masked
#: indexing / ``equal`` and the like per call.
HOST_SYNCS_PER_COMPRESSION: dict[str, int] = {"token": 0, "block": 0, "frame": 1}


def video_mask(logical_ids: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """``bool``, shape of ``logical_ids``: True where the id lies in one of ``spans`` (``long [V, 2]``)."""
    ids = logical_ids[..., None]
    return ((ids >= spans[:, 0]) & (ids < spans[:, 1])).any(-1)


def region_tokens(held: HeldTokens | None, batch: RegionBatch, num_heads: int) -> HeldTokens:
    """The tokens a layer's region holds for this compression: ``held`` (``None`` before the first), then the
    entering ones."""
    def expand(x: torch.Tensor) -> torch.Tensor:
        return x.expand(num_heads, -1)

    new = HeldTokens(expand(batch.new_ids), expand(video_mask(batch.new_ids, batch.spans)),
                     None if batch.new_labels is None else expand(batch.new_labels))
    if held is None:
        return new
    labels = None if new.labels is None or held.labels is None else torch.cat([held.labels, new.labels], dim=1)
    return HeldTokens(torch.cat([held.ids, new.ids], dim=1), torch.cat([held.candidates, new.candidates], dim=1),
                      labels)


def select_positions_steps(setup: SelectionSetup, keys: torch.Tensor, values: torch.Tensor, tokens: HeldTokens,
                           batch: RegionBatch, generator: torch.Generator | None = None
                           ) -> SelectionSteps[torch.Tensor]:
    """Kept positions into the held tokens of each anchor layer and head, as a generator
    (:mod:`~cords_vllm.selection.together`); :func:`select_positions` runs it alone.

    ``keys``/``values``: ``[A, H, T, D]`` of the ``A`` anchors; ``tokens``: theirs, each field ``[A, H, T]``.
    Returns ``long [A, H, num_keep]``, increasing along the last dim. Joint selection under tensor parallelism
    (``setup.gather_heads``) selects on every rank's heads, ``[A, H_all, T, D]``, and returns the common positions
    for this rank's ``H``.
    """
    a, h, t, d = keys.shape
    unit = batch.unit(setup)
    candidates = tokens.candidates  # [A, H, T]
    labels = tokens.labels if unit == "frame" else None  # [A, H, T]
    if setup.per_head:
        k, v, cand = keys.reshape(a * h, 1, t, d), values.reshape(a * h, 1, t, d), candidates.reshape(a * h, t)
        labels = None if labels is None else labels.reshape(a * h, t)
    else:  # joint selection: every head of a layer holds the same tokens
        k, v, cand = keys, values, candidates[:, 0]
        labels = None if labels is None else labels[:, 0]
        if setup.gather_heads is not None:  # one collective: keys and values of every anchor together
            k, v = setup.gather_heads(torch.stack([keys, values])).unbind(0)
    observation = None
    if setup.selector.needs_observation:
        if batch.observed is None:
            raise ValueError(f"{setup.selector.name} scores tokens by observed attention: the batch carries no "
                             "observation queries")
        if setup.gather_heads is not None:
            raise ValueError(f"{setup.selector.name}: joint selection under tensor parallelism needs every rank's "
                             "queries, which the compress step does not gather; select per head")
        observation = batch.observed.observation(tokens.ids[:, 0], h, setup.per_head)
    positions = yield from select_exact_steps(
        setup.selector, k, v, batch.num_keep_candidates, candidates=cand, granularity=unit,
        group_size=batch.group_size, group_index=labels,
        num_candidates=batch.num_candidates, frame_budget=batch.frame_budget, frame_tokens=batch.frame_tokens,
        generator=generator, observation=observation)
    return positions.reshape(a, h, -1) if setup.per_head else positions[:, None, :].expand(a, h, -1)


select_positions = driven_alone(select_positions_steps, "select_positions", """Kept positions into the held tokens
    of each anchor layer and head: :func:`select_positions_steps` driven to its result alone (same arguments and
    result, documented there).""")


@torch.inference_mode()
def compress_region(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor],
                    held: Sequence[HeldTokens | None], batch: RegionBatch, setup: SelectionSetup,
                    generator: torch.Generator | None = None, nonfinite: torch.Tensor | None = None,
                    codecs: Sequence[KVCodec] | None = None) -> list[HeldTokens]:
    """Compact one request's region in every layer; returns the tokens each layer now holds there.

    Non-finite keys or values (an overflowed or corrupted cache entry) never stop a compression: selection reads
    them as 0 (such a token is scored like an all-zero one), and the entries are copied as they are.

    Parameters
    ----------
    caches, accessors:
        One KV cache tensor and its accessor per layer (all on one device).
    codecs:
        Per layer, what its stored elements mean (``None``: a floating cache, :class:`PlainCodec`); only the
        anchors' are used.
    held:
        Per layer, the :class:`HeldTokens` (``n_prev`` per head) the region held after the previous
        compression, or ``None`` before the first one.
    batch, setup:
        This compression (:class:`RegionBatch`) and the model's selection setup.
    nonfinite:
        Optional ``long []`` counter on the caches' device, raised by one when the anchors' keys or values held
        NaN or inf, read from their sums (values whose sum overflows float32 count too; no host read: the caller
        reads it when it publishes).

    Returns
    -------
    list[HeldTokens]
        Per layer, ``num_keep`` per head: the tokens now held in the region, in row order.
    """
    with kernels_in_force(setup.kernels):
        return run_alone(compress_region_steps(caches, accessors, held, batch, setup, generator, nonfinite, codecs))


@dataclass(frozen=True)
class RegionCompression:
    """One request's compression in :func:`compress_regions`: :func:`compress_region`'s per-request arguments."""

    held: Sequence[HeldTokens | None]
    batch: RegionBatch
    generator: torch.Generator | None = None


@torch.inference_mode()
def compress_regions(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor],
                     compressions: Sequence[RegionCompression], setup: SelectionSetup,
                     nonfinite: torch.Tensor | None = None,
                     codecs: Sequence[KVCodec] | None = None) -> list[list[HeldTokens] | Exception]:
    """Several requests' compressions (an engine step's) on the same caches, their greedy orders computed together.

    Each compression is exactly :func:`compress_region`'s (same kept tokens, same caches after it): requests hold
    disjoint blocks, and a policy that :attr:`~cords_vllm.selection.base.Selector.batches_problems` orders the units
    of every request in one call (:func:`~cords_vllm.selection.together.run_together`), which on a CPU costs about
    what one request's order costs (the greedy run's cost there is its per-step kernel overhead).

    Returns, per compression, what :func:`compress_region` returns, or the exception it raised: a failure is that
    request's alone (the caller ends it; the others are compressed).
    """
    with kernels_in_force(setup.kernels):
        return run_together([compress_region_steps(caches, accessors, c.held, c.batch, setup, c.generator,
                                                   nonfinite, codecs) for c in compressions])


def compress_region_steps(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor],
                          held: Sequence[HeldTokens | None], batch: RegionBatch, setup: SelectionSetup,
                          generator: torch.Generator | None, nonfinite: torch.Tensor | None,
                          codecs: Sequence[KVCodec] | None) -> SelectionSteps[list[HeldTokens]]:
    """:func:`compress_region` as a generator (:mod:`~cords_vllm.selection.together`): it yields where its policy
    orders units."""
    if _fused(caches, accessors, codecs, setup):
        from cords_vllm.compress import step_triton

        done = yield from step_triton.compress_region_fused_steps(caches, held, batch, setup, nonfinite, codecs)
        if done is not None:
            return done
    heads = accessors[0].num_kv_heads
    # Layers that share a held object (the layers of one anchor, see below) share their region's tokens too.
    tokens_of: dict[int, HeldTokens] = {}
    for h in held:
        if id(h) not in tokens_of:
            tokens_of[id(h)] = region_tokens(h, batch, heads)
    tokens = [tokens_of[id(h)] for h in held]
    anchors = setup.anchors
    read = {a: accessors[a].read(caches[a], batch.src_slots) for a in anchors}  # [T, H, D] each, as stored
    decoded = {a: (codecs[a] if codecs is not None else PlainCodec()).features(*read[a]) for a in anchors}
    keys = torch.stack([decoded[a][0].transpose(0, 1) for a in anchors])
    values = torch.stack([decoded[a][1].transpose(0, 1) for a in anchors])
    if nonfinite is not None:  # a NaN or inf anywhere makes the sums non-finite (two reductions, no mask)
        nonfinite += ~torch.isfinite(keys.sum() + values.sum())
    keys, values = finite_features(keys), finite_features(values)
    anchor_tokens = [tokens[a] for a in anchors]
    candidates = torch.stack([t.candidates for t in anchor_tokens])
    if batch.num_recent:  # the newest video tokens are the recent window's: protected this time
        candidates = candidates & (candidates.flip(-1).cumsum(-1).flip(-1) > batch.num_recent)
    stacked = HeldTokens(torch.stack([t.ids for t in anchor_tokens]), candidates,
                         None if batch.new_labels is None else torch.stack([t.labels for t in anchor_tokens]))
    positions = yield from select_positions_steps(setup, keys, values, stacked, batch, generator)  # [A, H, keep]
    row_of = {a: i for i, a in enumerate(anchors)}
    anchor_row = [row_of[setup.anchor_of[layer]] for layer in range(len(accessors))]
    if _copy_in_one_launch(caches, accessors):
        from cords_vllm.compress.copy_triton import copy_kept

        copy_kept(caches, positions, anchor_row, batch.src_slots, batch.dst_slots)
    else:
        move_kept(caches, accessors, positions, anchor_row, batch)
    # Every layer of one anchor held the same tokens and keeps the same positions: one object for them all, so
    # that the next compression builds their region's tokens once.
    kept: dict[tuple[int, int], HeldTokens] = {}
    for layer, row in enumerate(anchor_row):
        if (id(tokens[layer]), row) not in kept:
            kept[id(tokens[layer]), row] = tokens[layer].gather(positions[row])
    return [kept[id(tokens[layer]), row] for layer, row in enumerate(anchor_row)]


def move_kept(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor], positions: torch.Tensor,
              anchor_row: Sequence[int], batch: RegionBatch) -> None:
    """The copy on the PyTorch path: in every layer, the token at kept row ``positions[anchor_row[l], h, i]`` of the
    region (``long [A, H, num_keep]``) goes to ``batch.dst_slots[i]``, head by head, element for element.

    Per layer and part of a token (:meth:`~cords_vllm.compress.kv_access.KVAccessor.token_runs`: keys and values
    together, or each alone), a gather of the kept tokens' runs of contiguous elements, then a scatter of what it
    read (so kept blocks may overlap sources). The runs are computed once per layout and anchor, and only the kept
    tokens are read.

    Each request is copied alone, also where a step's compressions run together (:func:`compress_regions`): its
    sources and destinations share blocks, which stay in cache between the gather and the scatter (one gather and
    one scatter of 8 requests' tokens per layer took 1.3x as long as 8 of each, at a 7B model's shape on a CPU).
    """
    heads = positions.shape[1]
    dst = batch.dst_slots.expand(heads, -1)
    runs: dict[tuple, list[tuple[torch.Tensor, int]]] = {}
    for layer, (cache, accessor) in enumerate(zip(caches, accessors, strict=True)):
        key, row = accessor.layout_key(cache), anchor_row[layer]
        if key not in runs:
            runs[key] = accessor.token_runs(cache, dst)
        if (key, row) not in runs:
            runs[key, row] = accessor.token_runs(cache, batch.src_slots[positions[row]])
        for (to, r), (source, _) in zip(runs[key], runs[key, row], strict=True):
            rows = run_view(cache, r)
            if r == 1:  # single elements: a 1-D gather is faster than one of rows of one
                rows = rows.view(-1)
            rows.index_copy_(0, to.reshape(-1), rows.index_select(0, source.reshape(-1)))


def _fused(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor], codecs: Sequence[KVCodec] | None,
           setup: SelectionSetup) -> bool:
    """Whether the whole step runs on :mod:`~cords_vllm.compress.step_triton`'s kernels: Triton runs on the caches'
    device and the policy, caches and setup are ones it covers."""
    if not use_triton(caches[0].device):
        return False
    from cords_vllm.compress.step_triton import covers

    return covers(setup.selector, accessors, caches, codecs, setup.anchor_of)


def describe_path(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor], codecs: Sequence[KVCodec] | None,
                  setup: SelectionSetup) -> str:
    """The start-up line's account of what runs a compression: the implementation
    (:func:`~cords_vllm.kernel_backend.describe`) and, where Triton runs, whether the fused step does
    (:mod:`~cords_vllm.compress.step_triton`) or why not."""
    device = caches[0].device
    with kernels_in_force(setup.kernels):
        line = describe(device)
        if not use_triton(device):
            return line
        from cords_vllm.compress.step_triton import not_covered

        why = not_covered(setup.selector, accessors, caches, codecs, setup.anchor_of)
    return f"{line}; fused step: " + ("yes (a fixed number of launches per compression)" if why is None else
                                       f"no, the greedy kernel and the copy ({why})")


def _copy_in_one_launch(caches: Sequence[torch.Tensor], accessors: Sequence[KVAccessor]) -> bool:
    """Whether the copy runs as :mod:`~cords_vllm.compress.copy_triton`'s kernel: Triton runs on the caches'
    device (:func:`~cords_vllm.kernel_backend.use_triton`) and every layer is a paged view it addresses."""
    return use_triton(caches[0].device) and all(isinstance(a, PagedAccessor) for a in accessors)
