"""What one compression of one request is given and holds: the region's batch, the setup of its selection and the
tokens each layer holds (:class:`RegionBatch`, :class:`ObservedQueries`, :class:`SelectionSetup`,
:class:`HeldTokens`). Shared by the step's PyTorch path (:mod:`.step`) and its kernel path (:mod:`.step_triton`),
in a module of their own so that neither imports the other for them. Plain data: no device work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cords_vllm.compress.late_read import LateRead
from cords_vllm.compress.tensor_parallel import HeadGather
from cords_vllm.compress.unit_choice import AUTO
from cords_vllm.selection.base import Selector
from cords_vllm.selection.observation import Observation


@dataclass(frozen=True)
class RegionBatch:
    """What one compression of one request needs, as device tensors plus host integers.

    Attributes
    ----------
    src_slots:
        ``long [S]``: slots of the blocks the region holds now, in row order (``S = num_held``).
    dst_slots:
        ``long [num_keep]``: slots the kept tokens are written to (the first source blocks).
    new_ids:
        ``long [N]`` (``N = S - n_prev``): ids of the tokens that entered the region with this compression
        (their index in the stream, as if nothing had been removed from it).
    spans:
        ``long [V, 2]``: video ``[start, end)`` ranges (candidates) over the same ids, covering ``new_ids``.
    new_labels:
        ``long [N]``, frame or auto granularity: the frame label (M-RoPE temporal position) of each entering
        token (kept with the held tokens, so any later compression may select frames); ``None`` otherwise.
    num_keep, num_keep_candidates, num_candidates:
        Tokens kept in the region (protected included), video tokens kept of the candidates, candidates (the
        region's video tokens but the ``num_recent`` newest).
    group_size:
        Tokens per selection group (the largest frame; at ``block`` granularity the block size, or the run length
        ``granularity: "auto"`` chose); ``None`` at token granularity.
    frame_budget:
        Frames to ask the selector for at frame granularity. ``None`` (what the worker passes): the fewest that
        always hold enough, read back with the frame count in the compression's one host read (see
        :func:`~cords_vllm.selection.exact.select_exact`), or on the fused step taken from its plan on the device
        (see :attr:`new_label_runs`); the host cannot know it, since which frames the region still holds, and how
        far one of them was trimmed, was decided on the device.
    frame_tokens:
        Tokens per frame for frame-aware policies at token granularity, or ``None``.
    new_label_runs:
        Runs of equal labels among the entering video tokens (:func:`~cords_vllm.compress.frames.label_runs`),
        counted by the host where the labels are, or ``None``. With the held tokens' runs
        (:attr:`HeldTokens.label_runs`) an upper bound on the frames a frame compression's region holds, so that
        the fused step sizes it without reading the device (:mod:`~cords_vllm.compress.step_triton`).
    observed:
        The observation queries of attention-scored policies (:class:`ObservedQueries`), or ``None``.
    num_recent:
        The region's newest video tokens that belong to the recent window: protected in this compression (kept),
        still video (candidates of later compressions once older ones arrived).
    granularity:
        This compression's unit where the setup's is ``"auto"`` (the worker resolves it with
        :func:`~cords_vllm.compress.unit_choice.compression_unit`); ``None``: the setup's.
    """

    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    new_ids: torch.Tensor
    spans: torch.Tensor
    new_labels: torch.Tensor | None
    num_keep: int
    num_keep_candidates: int
    num_candidates: int
    group_size: int | None = None
    frame_budget: int | None = None
    frame_tokens: int | None = None
    new_label_runs: int | None = None
    observed: ObservedQueries | None = None
    num_recent: int = 0
    granularity: str | None = None

    def unit(self, setup: SelectionSetup) -> str:
        """The unit this compression selects: :attr:`granularity`, else the setup's (never ``"auto"``)."""
        unit = self.granularity or setup.granularity
        if unit == AUTO:
            raise ValueError("granularity 'auto' must be resolved per compression (RegionBatch.granularity)")
        return unit


@dataclass(frozen=True)
class ObservedQueries:
    """The observation queries of one request, as the engine captured them on its anchor layers.

    Attributes
    ----------
    queries:
        ``[A, Hq, W, D]``: per anchor layer, the ``W`` captured query rows of every query head (rotary applied), in
        the cache's device.
    ids:
        ``long [W]``: each row's token id (the ids of :class:`HeldTokens`); ``-1``: a row not captured (yet).
    causal:
        Whether a row sees only the tokens up to its own id (a window of the newest tokens); ``False``: every row
        sees every held token (a proxy placed before them).
    """

    queries: torch.Tensor
    ids: torch.Tensor
    causal: bool

    def observation(self, token_ids: torch.Tensor, num_kv_heads: int, per_head: bool) -> Observation:
        """The selector's :class:`~cords_vllm.selection.observation.Observation` over the held tokens of each
        anchor, ``token_ids``: ``long [A, T]``. Per head (problems ``[A * H]``), each KV head's query group is the
        observation of its own problem."""
        rows = self.ids >= 0  # [W]
        visible = rows[None, :, None].expand(token_ids.shape[0], -1, token_ids.shape[1])
        if self.causal:
            visible = visible & (token_ids[:, None, :] <= self.ids[None, :, None])
        queries = finite_features(self.queries)
        if per_head:
            a, hq, w, d = queries.shape
            queries = queries.reshape(a * num_kv_heads, hq // num_kv_heads, w, d)
            visible = visible.repeat_interleave(num_kv_heads, dim=0)
        return Observation(queries, visible)


@dataclass(frozen=True)
class SelectionSetup:
    """How a model's layers select: the policy, its unit, per-head or joint, and each layer's anchor.

    ``gather_heads``: under tensor parallelism, this rank's collective that turns its anchors' keys and values,
    ``[2, A, H_local, T, D]``, into all heads', ``[2, A, H, T, D]`` in the model's head order
    (:func:`~cords_vllm.compress.tensor_parallel.head_gatherer`); joint selection then runs on every head on every
    rank and keeps the same tokens as one rank holding all heads. ``None`` (one rank, or per-head selection, which
    never reads another rank's heads): selection sees the local heads only.

    ``kernels``: ``"auto"``, ``"triton"`` or ``"torch"`` (:mod:`cords_vllm.kernel_backend`), in force for the
    compressions of this setup; ``None``: the environment's choice.
    """

    selector: Selector
    granularity: str
    per_head: bool
    anchor_of: tuple[int, ...]
    gather_heads: HeadGather | None = None
    kernels: str | None = None

    @property
    def anchors(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.anchor_of)))


@dataclass(frozen=True)
class HeldTokens:
    """The tokens one layer's region holds, per KV head, in row order, with what selection needs of each.

    ``ids``: ``long [H, n]``, each token's index in the stream (as if nothing had been removed from it);
    ``candidates``: ``bool [H, n]``, whether it may be evicted (video); ``labels``: ``long [H, n]``, its frame
    label (frame granularity), or ``None``. All on the KV cache's device. ``label_runs``: where the fused step made
    them, the runs of equal labels in each of its problems' rows (:class:`~cords_vllm.compress.late_read.LateRead`,
    on their way to the host), else ``None``.
    """

    ids: torch.Tensor
    candidates: torch.Tensor
    labels: torch.Tensor | None
    label_runs: LateRead | None = field(default=None, compare=False, repr=False)

    def gather(self, index: torch.Tensor) -> HeldTokens:
        """The tokens at ``index`` (``long [H, m]``) of each head."""
        return HeldTokens(torch.gather(self.ids, 1, index), torch.gather(self.candidates, 1, index),
                          None if self.labels is None else torch.gather(self.labels, 1, index))


def finite_features(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and +-inf read as 0 (a copy; the cache is never written), so selection never fails on them."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
