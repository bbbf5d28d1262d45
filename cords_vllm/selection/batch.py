"""From the caller's ``[B, H, N, D]`` cache to the units a policy ranks, and back.

A selection runs ``P`` independent problems: ``P = B`` when the ``H`` KV heads of a token form one
feature (joint scope), ``P = B * H`` when each head selects alone (``per_head``). Each problem has ``M``
*units*: its candidate tokens (token granularity) or groups of consecutive candidate tokens (frames,
paged blocks) represented by their centroids. :func:`build_units` lays a validated input out as a
:class:`UnitBatch` (what a policy sees) and a :class:`UnitLayout` (how chosen units map back to tokens).

The widths it needs on the host (the number of units, the most any problem chooses) are read from the device
(a few synchronisations on a GPU) unless the caller passes them as :class:`HostCounts`: then nothing is read
back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from cords_vllm.selection.features import group_features, token_features
from cords_vllm.selection.granularity import (
    candidate_ranks,
    expand_group_selection,
    group_centroids,
    group_ids,
    labelled_group_ids,
)
from cords_vllm.utils import cdiv

Granularity = Literal["token", "frame", "block"]
GRANULARITIES: tuple[str, ...] = ("token", "frame", "block")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype all selection arithmetic runs in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class HostCounts:
    """What the caller of :meth:`~cords_vllm.selection.base.Selector.select` knows on the host, so that the
    call reads nothing back from the device (no host synchronisation on a GPU).

    Passing it also vouches for the data: keys and values are finite and ``group_index`` is non-decreasing
    along each problem's candidates with at most ``group_size`` candidates per group. Those checks would each
    read a flag back, so they are skipped, and the exact-count check of the policy's output becomes a device
    assertion (``torch._assert_async``).

    Attributes
    ----------
    max_candidates:
        The largest candidate count of any problem; required at token and fixed-group granularity.
    max_groups:
        Labelled groups (frame granularity with ``group_index``): the largest number of groups any problem's
        candidates form; required there.
    """

    max_candidates: int | None = None
    max_groups: int | None = None

    def require(self, name: str, granularity: str) -> int:
        """The count ``name``; ``ValueError`` (naming ``counts``) when it is missing."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"counts: {name} is required at {granularity} granularity")
        return value


@dataclass(frozen=True)
class UnitBatch:
    """``P`` independent selection problems over ``M`` units each, as a policy sees them.

    A unit is a candidate token (token granularity) or the centroid of a group of ``group_size``
    consecutive candidate tokens (frame/block granularity). Problems are padded to a common ``M``;
    ``valid`` says which units exist and may be chosen.

    Attributes
    ----------
    feats:
        ``[P, M, Dk + Dv]`` features in the compute dtype (float32, or float64 for float64 inputs):
        keys in ``feats[..., :key_dim]``, values after them. Joint scope: ``Dk = Dv = H * D``.
    key_dim:
        ``Dk``.
    valid:
        ``bool [P, M]``: selectable units.
    rank:
        ``long [P, M]``: temporal position of each selectable unit among the selectable units of its
        problem (``0`` = oldest), ``-1`` elsewhere.
    count:
        ``long [P]``: number of selectable units per problem.
    k:
        ``long [P]``: number of units the policy must return per problem (``0 <= k <= count``).
    k_max:
        ``max(k)`` as a Python int (the width of the order a policy returns).
    period:
        Rank distance between a unit and the unit at the same spatial position in the next frame:
        ``group_size`` (tokens per frame) at token granularity, if given; ``1`` at frame/block
        granularity (the next group); ``None`` if unknown.
    granularity, group_size:
        As passed to :meth:`~cords_vllm.selection.base.Selector.select`.
    generator:
        The caller's random generator, or ``None``.
    scores:
        ``[P, M]``, attention-scored policies only (``needs_observation``): the mean attention each unit's tokens
        receive from the observation queries (:func:`~cords_vllm.selection.observation.observed_attention`; the
        mean over the KV heads in joint scope, over a group's tokens at frame/block granularity); ``None``
        otherwise.
    """

    feats: torch.Tensor
    key_dim: int
    valid: torch.Tensor
    rank: torch.Tensor
    count: torch.Tensor
    k: torch.Tensor
    k_max: int
    period: int | None
    granularity: str
    group_size: int | None
    generator: torch.Generator | None = None
    scores: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor:
        """``[P, M, Dk]`` view of the key features."""
        return self.feats[..., : self.key_dim]

    @property
    def values(self) -> torch.Tensor:
        """``[P, M, Dv]`` view of the value features."""
        return self.feats[..., self.key_dim:]

    def unit_at_rank(self) -> torch.Tensor:
        """``long [P, M]``: ``out[p, r]`` is the unit whose rank is ``r`` (``-1`` past ``count[p]``)."""
        p_count, m = self.rank.shape
        out = torch.full((p_count, m + 1), -1, dtype=torch.long, device=self.rank.device)
        idx = torch.where(self.valid, self.rank, m)
        units = torch.arange(m, device=self.rank.device).expand(p_count, m)
        out.scatter_(1, idx, units)
        return out[:, :m]

    def empty_order(self) -> torch.Tensor:
        """``long [P, 0]``: the order of a batch in which no problem chooses (``k_max == 0``)."""
        return torch.full((self.valid.shape[0], 0), -1, dtype=torch.long, device=self.valid.device)


@dataclass(frozen=True)
class UnitLayout:
    """How the units of a :class:`UnitBatch` map back to the caller's tokens.

    Attributes
    ----------
    candidates:
        ``bool [P, N]``: candidate tokens of every problem (False = protected).
    group:
        ``long [P, N]``: the unit (group) of every candidate token, ``-1`` for protected tokens;
        ``None`` at token granularity (units are tokens).
    keep_all:
        ``bool [P]``: problems whose budget covers every candidate (they keep everything).
    lead:
        ``(B,)`` (joint scope) or ``(B, H)`` (``per_head``): the leading shape of the caller's results.
    """

    candidates: torch.Tensor
    group: torch.Tensor | None
    keep_all: torch.Tensor
    lead: tuple[int, ...]

    def keep(self, chosen: torch.Tensor) -> torch.Tensor:
        """``bool [*lead, N]``: protected tokens, the tokens of the ``chosen`` units (``bool [P, M]``), and
        every token of the problems that keep everything."""
        kept_cand = chosen if self.group is None else expand_group_selection(chosen, self.group)
        keep = ~self.candidates | kept_cand | self.keep_all[:, None]
        return keep.reshape(*self.lead, self.candidates.shape[-1])

    def order(self, order: torch.Tensor) -> torch.Tensor:
        """``long [P, k_max]`` -> ``long [*lead, k_max]``."""
        return order.reshape(*self.lead, order.shape[-1])


@dataclass(frozen=True)
class _Units:
    """The unit structure of a batch before features: see :class:`UnitBatch` and :class:`UnitLayout`."""

    valid: torch.Tensor  # bool [P, M]
    rank: torch.Tensor  # long [P, M]
    count: torch.Tensor  # long [P]
    k: torch.Tensor  # long [P]
    keep_all: torch.Tensor  # bool [P]
    group: torch.Tensor | None  # long [P, N], None at token granularity
    period: int | None


def _per_problem(x: torch.Tensor, h_count: int, per_head: bool) -> torch.Tensor:
    """``[B, N]`` -> ``[P, N]``: repeated for every head when ``per_head`` (``P = B * H``), else as is."""
    if not per_head:
        return x
    b_count, n_tok = x.shape
    return x[:, None, :].expand(b_count, h_count, n_tok).reshape(b_count * h_count, n_tok)


def _token_units(cand: torch.Tensor, rank: torch.Tensor, n_cand: torch.Tensor, budget: int,
                 group_size: int | None) -> _Units:
    """Units are the candidate tokens (``cand``: ``bool [P, N]``; ``rank``, ``n_cand`` from ``candidate_ranks``)."""
    keep_all = n_cand <= budget
    return _Units(valid=cand, rank=rank, count=n_cand, k=torch.where(keep_all, 0, budget), keep_all=keep_all,
                  group=None, period=group_size)


def _group_units(group: torch.Tensor, count: torch.Tensor, n_groups: int, k: torch.Tensor,
                 keep_all: torch.Tensor) -> _Units:
    """Units are the groups ``0 .. count[p] - 1`` of every problem, padded to ``n_groups`` slots."""
    slots = torch.arange(n_groups, device=count.device)[None, :]
    valid = slots < count[:, None]
    return _Units(valid=valid, rank=torch.where(valid, slots, -1), count=count, k=k, keep_all=keep_all,
                  group=group, period=1)


def _labelled_group_units(labels: torch.Tensor, cand: torch.Tensor, budget: int, group_size: int,
                          counts: HostCounts | None) -> _Units:
    """Units are the runs of candidates sharing a label (``labels``: ``long [P, N]``); every group may be chosen."""
    group, count = labelled_group_ids(labels, cand, group_size, check=counts is None)
    if counts is not None:
        n_groups = counts.require("max_groups", "labelled frame")
    else:
        n_groups = int(count.max()) if count.numel() else 0
    # labelled groups may hold fewer than group_size tokens: the budget covers everything only when it
    # covers every group, otherwise the policy chooses budget // group_size of them
    keep_all = count <= budget // group_size
    return _group_units(group, count, n_groups, torch.where(keep_all, 0, budget // group_size), keep_all)


def _fixed_group_units(rank: torch.Tensor, n_cand: torch.Tensor, budget: int, group_size: int,
                       max_candidates: int) -> _Units:
    """Units are the full runs of ``group_size`` consecutive candidates; a trailing partial run is padding."""
    n_groups = cdiv(max_candidates, group_size)  # ceil: the partial group is a (padded) unit
    keep_all = n_cand <= budget
    return _group_units(group_ids(rank, group_size), n_cand // group_size, n_groups,
                        torch.where(keep_all, 0, budget // group_size), keep_all)


def _require_group_size(group_size: int | None, granularity: str) -> int:
    if group_size is None:
        raise ValueError(f"group_size: required (tokens per {granularity}) at {granularity} granularity")
    return group_size


def build_units(
    keys: torch.Tensor,
    values: torch.Tensor,
    budget: int,
    *,
    candidates: torch.Tensor | None,
    granularity: str,
    group_size: int | None,
    group_index: torch.Tensor | None,
    per_head: bool,
    generator: torch.Generator | None,
    counts: HostCounts | None = None,
    token_scores: torch.Tensor | None = None,
) -> tuple[UnitBatch, UnitLayout]:
    """Lay a (validated) selection input out as units.

    Parameters
    ----------
    keys, values:
        ``[B, H, N, D]``, any floating dtype.
    budget, candidates, granularity, group_size, group_index, per_head, generator:
        As in :meth:`~cords_vllm.selection.base.Selector.select`, already validated
        (:mod:`cords_vllm.selection.validation`); ``group_size`` is required at frame/block granularity.
    counts:
        The host counts the caller knows (:class:`HostCounts`), or ``None``: then the number of units and
        ``k_max`` are read from the device, and labelled groups are checked (host reads).
    token_scores:
        ``[B, H, N]``, optional: a score per token and KV head (observed attention), laid out as
        :attr:`UnitBatch.scores`.

    Returns
    -------
    units:
        The :class:`UnitBatch` of the ``P`` problems. Features are computed only when some problem has to
        choose (``k_max > 0``); otherwise ``feats`` is an expanded zero of the right shape.
    layout:
        The :class:`UnitLayout` that turns chosen units back into a ``keep`` mask.
    """
    b_count, h_count, n_tok, d_head = keys.shape
    key_dim = d_head if per_head else h_count * d_head
    cand_bn = candidates
    if cand_bn is None:
        cand_bn = torch.ones((b_count, n_tok), dtype=torch.bool, device=keys.device)
    cand = _per_problem(cand_bn, h_count, per_head)
    u, k_max = _unit_structure(cand, budget, granularity, group_size, group_index, h_count, per_head, counts)
    # Features only when some problem has to choose (a covering budget keeps everything).
    feats = _unit_features(keys, values, cand_bn, u, k_max, granularity, group_size, group_index, per_head, counts)
    scores = None if token_scores is None else _unit_scores(token_scores, u, per_head)
    units = UnitBatch(feats=feats, key_dim=key_dim, valid=u.valid, rank=u.rank, count=u.count, k=u.k,
                      k_max=k_max, period=u.period, granularity=granularity, group_size=group_size,
                      generator=generator, scores=scores)
    layout = UnitLayout(candidates=cand, group=u.group, keep_all=u.keep_all,
                        lead=(b_count, h_count) if per_head else (b_count,))
    return units, layout


def _unit_structure(cand: torch.Tensor, budget: int, granularity: str, group_size: int | None,
                    group_index: torch.Tensor | None, h_count: int, per_head: bool, counts: HostCounts | None
                    ) -> tuple[_Units, int]:
    """The units of the problems' candidates (``cand``: ``bool [P, N]``) at ``granularity``, and ``k_max``, the
    most units any problem chooses (from ``counts`` where given, else read from the device). ``group_index``:
    ``long [B, N]`` labels (frame granularity), repeated over the ``h_count`` heads when ``per_head``."""
    rank, n_cand = candidate_ranks(cand)
    if granularity == "token":
        u = _token_units(cand, rank, n_cand, budget, group_size)
        k_max = None if counts is None else budget * (counts.require("max_candidates", granularity) > budget)
    elif group_index is not None:
        size = _require_group_size(group_size, granularity)
        u = _labelled_group_units(_per_problem(group_index, h_count, per_head), cand, budget, size, counts)
        k_max = None if counts is None else budget // size * (u.valid.shape[1] > budget // size)
    else:
        size = _require_group_size(group_size, granularity)
        most = int(n_cand.max()) if counts is None else counts.require("max_candidates", granularity)
        u = _fixed_group_units(rank, n_cand, budget, size, most)
        k_max = None if counts is None else budget // size * (most > budget)
    if k_max is None:  # the most any problem chooses: k is where(keeps all, 0, its budget in units)
        k_max = int(u.k.max()) if u.k.numel() else 0
    return u, k_max


def _unit_features(keys: torch.Tensor, values: torch.Tensor, cand_bn: torch.Tensor, u: _Units, k_max: int,
                   granularity: str, group_size: int | None, group_index: torch.Tensor | None, per_head: bool,
                   counts: HostCounts | None) -> torch.Tensor:
    """The units' features, ``[P, M, 2 * key_dim]`` (keys then values, in the compute dtype): the candidate tokens'
    own, or their groups' centroids (labelled groups of ``u.group``, or fixed runs of ``group_size`` candidates of
    ``cand_bn``, ``bool [B, N]``). Where no problem chooses (``k_max == 0``) an expanded zero of that shape."""
    b_count, h_count, _, d_head = keys.shape
    cdt = compute_dtype(keys.dtype)
    n_units = u.valid.shape[1]
    if k_max == 0:
        p_count, key_dim = (b_count * h_count, d_head) if per_head else (b_count, h_count * d_head)
        zero = torch.zeros((), dtype=cdt, device=keys.device)
        return zero.expand(p_count, n_units, 2 * key_dim)
    if u.group is None:
        return token_features(keys, values, per_head, cdt)
    if group_index is not None:
        return group_centroids(token_features(keys, values, per_head, cdt), u.group, n_units)
    return group_features(keys, values, cand_bn, _require_group_size(group_size, granularity), n_units, per_head, cdt,
                          None if counts is None else counts.max_candidates)


def _unit_scores(token_scores: torch.Tensor, u: _Units, per_head: bool) -> torch.Tensor:
    """The units' scores, ``[P, M]``: the tokens' (``token_scores``: ``[B, H, N]``, each head's where ``per_head``,
    else their mean over the heads), or their groups' means."""
    b_count, h_count, n_tok = token_scores.shape
    per_token = token_scores.reshape(b_count * h_count, n_tok) if per_head else token_scores.mean(dim=1)  # [P, N]
    return per_token if u.group is None else group_centroids(per_token[..., None], u.group, u.valid.shape[1])[..., 0]
