"""The selector interface: input validation, feature layout, granularity, and the result type.

Every eviction policy is a :class:`Selector`, a frozen dataclass whose fields are its hyper-parameters.
A policy only implements :meth:`Selector._order_units`, which ranks *units* (tokens, or frame/block
centroids) of a batch of independent problems and returns the units it keeps, in the order it chose
them. Everything that is common to all policies lives here, once:

* validation of the inputs (shapes, dtypes, devices, NaN/inf, budget) with a ``ValueError`` that names
  the offending argument;
* the compute dtype: features are copied to float32 (float64 inputs stay float64) before any
  arithmetic, so bf16/fp16 caches read back from the engine are scored in fp32;
* the feature scope: all KV heads of a layer jointly (one feature of dim ``H*D``) or each head alone;
* the candidate mask: protected tokens are always kept and never counted against the budget;
* granularity: groups of consecutive candidate tokens (frames, paged blocks) represented by centroids,
  and the expansion of chosen groups back to their tokens;
* the exact-count contract the engine relies on (every problem keeps the same, predictable number of
  tokens), checked on every call.

Invariant (the engine's contract): for a problem with ``n`` candidate tokens and ``p`` protected tokens,
the number of kept tokens is ``p + n`` when ``budget >= n``; otherwise ``p + budget`` at token
granularity and ``p + group_size * (budget // group_size)`` at frame/block granularity. It depends only
on ``n``, ``p``, ``budget`` and ``group_size``, never on the features.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import operator
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from cords_vllm.selection.features import group_features, token_features
from cords_vllm.selection.granularity import (
    candidate_ranks,
    expand_group_selection,
    group_centroids,
    group_ids,
    labelled_group_ids,
    units_to_mask,
)
from cords_vllm.utils import cdiv

Granularity = Literal["token", "frame", "block"]
GRANULARITIES: tuple[str, ...] = ("token", "frame", "block")


# --------------------------------------------------------------------------------------------------
# Hyper-parameters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """Description of one hyper-parameter of a selector (what ``--help`` and config references print).

    Attributes
    ----------
    name:
        Field name, also the key accepted by :func:`~cords_vllm.selection.get_selector`.
    type:
        ``float``, ``int`` or ``str``.
    default:
        Default value.
    low, high:
        Inclusive bounds for numbers (``None`` = unbounded); ``low_open``/``high_open`` make them strict.
    choices:
        Allowed values of a ``str`` parameter.
    help:
        One-line description.
    """

    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None

    def allowed(self) -> str:
        """Human-readable allowed values: ``in [0, 1]``, ``an integer in [0, inf)``, ``one of 'a', 'b'``."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        lo = "-inf" if self.low is None else _fmt(self.low)
        hi = "inf" if self.high is None else _fmt(self.high)
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        kind = "an integer in " if self.type is int else "in "
        return f"{kind}{left}{lo}, {hi}{right}"

    def check(self, owner: str, value: Any) -> Any:
        """Validate (and normalise) ``value``; raise ``ValueError`` naming the parameter otherwise."""
        where = f"{owner}: parameter '{self.name}'"
        if self.type is str:
            if not isinstance(value, str) or (self.choices is not None and value not in self.choices):
                raise ValueError(f"{where} must be {self.allowed()}, got {value!r}")
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where} must be a number {self.allowed()}, got {value!r}")
        if self.type is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"{where} must be {self.allowed()}, got {value!r}")
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{where} must be {self.allowed()}, got {value!r}")
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if too_low or too_high:
            raise ValueError(f"{where} must be {self.allowed()}, got {value!r}")
        return value


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def hyperparameter(
    default: Any,
    *,
    help: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """Declare a selector field as a validated hyper-parameter (``dataclasses.field`` with metadata)."""
    meta = {"low": low, "high": high, "low_open": low_open, "high_open": high_open, "choices": choices,
            "help": help}
    return field(default=default, metadata={"cords_param": meta})


# --------------------------------------------------------------------------------------------------
# Data passed to and returned by selectors
# --------------------------------------------------------------------------------------------------


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
        As passed to :meth:`Selector.select`.
    generator:
        The caller's random generator, or ``None``.
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


@dataclass(frozen=True)
class SelectionResult:
    """What a selector kept.

    Attributes
    ----------
    keep:
        ``bool [B, N]`` (joint scope) or ``[B, H, N]`` (``per_head=True``): True for every protected
        token and every kept candidate.
    order:
        ``long [B, k_max]`` or ``[B, H, k_max]``: the units chosen, in the order the policy chose them
        (CoRDS: greedy order, seed first; score-based policies: best first; rule-based policies: by
        rank). Units are token indices into ``N`` at token granularity and group indices (``0`` = the
        oldest group of candidate tokens) at frame/block granularity. Rows are padded with ``-1``;
        a problem whose budget covers all its candidates keeps everything without running the policy
        and has an all ``-1`` row.
    granularity:
        ``"token"``, ``"frame"`` or ``"block"``.
    group_size:
        Tokens per group (``None`` at token granularity unless given).
    per_head:
        Whether each KV head was selected on its own.
    """

    keep: torch.Tensor
    order: torch.Tensor
    granularity: str
    group_size: int | None
    per_head: bool

    @property
    def num_kept(self) -> torch.Tensor:
        """``long [B]`` or ``[B, H]``: kept tokens per problem (protected tokens included)."""
        return self.keep.sum(-1)

    def kept_indices(self) -> torch.Tensor:
        """Sorted kept token indices, ``long [B, n_keep]`` or ``[B, H, n_keep]``.

        Raises ``ValueError`` if problems keep different numbers of tokens (then the result is not
        rectangular; give every problem the same candidate and protected counts).
        """
        counts = self.num_kept
        if counts.numel() == 0:
            return torch.zeros((*self.keep.shape[:-1], 0), dtype=torch.long, device=self.keep.device)
        n_keep = int(counts.max())
        if int(counts.min()) != n_keep:
            raise ValueError(
                "kept_indices: problems keep different numbers of tokens "
                f"(min {int(counts.min())}, max {n_keep}); the result is not rectangular")
        # A stable sort of (not kept) puts kept positions first, in increasing index order.
        dropped = (~self.keep).to(torch.uint8)
        return torch.sort(dropped, dim=-1, stable=True).indices[..., :n_keep]

    def evicted(self) -> torch.Tensor:
        """``bool`` mask of evicted tokens (``~keep``), same shape as ``keep``."""
        return ~self.keep


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype all selection arithmetic runs in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kept_candidate_count(n_candidates: int, budget: int, granularity: str, group_size: int | None) -> int:
    """How many candidate tokens a problem keeps (the exact-count contract, see the module docstring)."""
    if budget >= n_candidates:
        return n_candidates
    if granularity == "token":
        return budget
    assert group_size is not None
    return group_size * (budget // group_size)


# --------------------------------------------------------------------------------------------------
# The selector base class
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selector(abc.ABC):
    """Base class of every KV eviction policy: a frozen dataclass whose fields are hyper-parameters.

    Subclasses declare fields with :func:`hyperparameter` (validated in ``__post_init__``), set
    ``name`` through :func:`~cords_vllm.selection.registry.register_selector`, and implement
    :meth:`_order_units`.

    Class attributes
    ----------------
    name:
        Registry name (the ``--kv-policy`` choice).
    uses_token_order:
        True if the policy depends on where a unit sits in time (uniform, recency, InfiniPot-V); such
        policies are not permutation-equivariant.
    stochastic:
        True if the result depends on a random generator (and so on how problems are batched).
    needs_frame_length:
        True if the policy reads the frame structure: at token granularity ``group_size`` (tokens per
        frame) is then required.
    """

    name: ClassVar[str] = ""
    uses_token_order: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False
    needs_frame_length: ClassVar[bool] = False

    def __post_init__(self) -> None:
        owner = self.name or type(self).__name__
        for spec in self.param_specs().values():
            value = spec.check(owner, getattr(self, spec.name))
            object.__setattr__(self, spec.name, value)

    # -- introspection -----------------------------------------------------------------------------

    @classmethod
    def param_specs(cls) -> dict[str, ParamSpec]:
        """The hyper-parameters of this selector, by name, in declaration order."""
        hints = typing.get_type_hints(cls)
        specs: dict[str, ParamSpec] = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata.get("cords_param")
            if meta is None:
                continue
            hint = hints[f.name]
            typ = hint if hint in (int, float) else str
            specs[f.name] = ParamSpec(name=f.name, type=typ, default=f.default, **meta)
        return specs

    def params(self) -> dict[str, Any]:
        """Current hyper-parameter values, by name."""
        return {name: getattr(self, name) for name in self.param_specs()}

    # -- the main call -----------------------------------------------------------------------------

    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        budget: int,
        *,
        candidates: torch.Tensor | None = None,
        granularity: Granularity = "token",
        group_size: int | None = None,
        group_index: torch.Tensor | None = None,
        per_head: bool = False,
        generator: torch.Generator | None = None,
    ) -> SelectionResult:
        """Choose which tokens of each problem to keep.

        Parameters
        ----------
        keys, values:
            ``[B, H, N, D]``: ``B`` independent problems (requests, layers), ``H`` KV heads, ``N``
            tokens, head dim ``D``; any floating dtype, same dtype and device for both. Arithmetic
            runs in float32 (float64 inputs stay float64).
        budget:
            Number of candidate tokens to keep per problem (per head when ``per_head``); ``>= 0``.
            At frame/block granularity ``budget // group_size`` whole groups are kept.
        candidates:
            ``bool [B, N]``: True = may be evicted, False = protected (always kept, not counted in
            the budget). ``None``: every token is a candidate.
        granularity:
            ``"token"``: select tokens. ``"frame"`` / ``"block"``: split each problem's candidate
            tokens, in order, into consecutive groups of ``group_size`` (frames, paged blocks),
            represent each group by the centroid of its keys and of its values, select groups, and
            keep all tokens of the chosen groups. A trailing partial group (fewer than
            ``group_size`` candidates) is never chosen; it is kept only when the budget covers every
            candidate. Protect it (``candidates=False``) to always keep it.
        group_size:
            Tokens per frame/block; required (``>= 1``) at frame/block granularity. At token
            granularity it is optional and only read by frame-aware policies (``infinipot_v``: tokens
            per frame).
        group_index:
            ``long [B, N]``, optional, frame/block granularity only: the group (e.g. frame number) of
            every token, non-decreasing along each problem's candidates, at most ``group_size``
            candidates per group; values at protected tokens are ignored. Groups are then the runs of
            candidates sharing a value instead of fixed runs of ``group_size``: a frame cut by an
            earlier eviction or by the edge of the candidate region stays one (smaller) group and every
            group may be chosen, so the kept count is *at most* ``group_size * (budget // group_size)``
            (:func:`cords_vllm.selection.exact.select_exact` tops up and trims to an exact count).
        per_head:
            False: the ``H`` KV heads of a token form one feature of dim ``H*D`` and one selection
            per problem (``keep`` is ``[B, N]``). True: each head selects its own ``budget`` tokens
            (``keep`` is ``[B, H, N]``).
        generator:
            Random generator for stochastic policies (``random``); ignored by the others.

        Returns
        -------
        SelectionResult
            ``keep`` holds ``protected + kept candidates`` per problem, exactly as stated in the
            module docstring.
        """
        budget = _check_inputs(keys, values, budget, candidates, granularity, group_size, per_head,
                               generator)
        if group_index is not None:
            _check_group_index(group_index, keys, granularity)
        if self.needs_frame_length and group_size is None:
            raise ValueError(f"group_size: {self.name} needs group_size = tokens per frame at token "
                             "granularity")
        b_count, h_count, n_tok, d_head = keys.shape
        device = keys.device
        cdt = compute_dtype(keys.dtype)

        p_count, key_dim = (b_count * h_count, d_head) if per_head else (b_count, h_count * d_head)
        cand_bn = candidates
        if cand_bn is None:
            cand_bn = torch.ones((b_count, n_tok), dtype=torch.bool, device=device)
        cand = cand_bn
        if per_head:
            cand = cand[:, None, :].expand(b_count, h_count, n_tok).reshape(p_count, n_tok)

        rank, n_cand = candidate_ranks(cand)
        keep_all = n_cand <= budget  # [P]

        if granularity == "token":
            valid, unit_rank, count = cand, rank, n_cand
            k = torch.where(keep_all, 0, budget)
            period = group_size
            gid = None
        elif group_index is not None:
            assert group_size is not None
            labels = group_index
            if per_head:
                labels = labels[:, None, :].expand(b_count, h_count, n_tok).reshape(p_count, n_tok)
            gid, count = labelled_group_ids(labels, cand, group_size)
            n_groups = int(count.max()) if count.numel() else 0
            valid = torch.arange(n_groups, device=device)[None, :] < count[:, None]
            unit_rank = torch.where(valid, torch.arange(n_groups, device=device)[None, :], -1)
            # labelled groups may hold fewer than group_size tokens: the budget covers everything only when it
            # covers every group, otherwise the policy chooses budget // group_size of them
            keep_all = count <= budget // group_size
            k = torch.where(keep_all, 0, budget // group_size)
            period = 1
        else:
            assert group_size is not None
            gid = group_ids(rank, group_size)
            n_groups = cdiv(int(n_cand.max()), group_size)  # ceil: the partial group is a (padded) unit
            count = n_cand // group_size  # full groups only
            valid = torch.arange(n_groups, device=device)[None, :] < count[:, None]
            unit_rank = torch.where(valid, torch.arange(n_groups, device=device)[None, :], -1)
            k = torch.where(keep_all, 0, budget // group_size)
            period = 1
        k_max = int(k.max()) if k.numel() else 0

        # Features only when some problem has to choose (a covering budget keeps everything).
        if k_max == 0:
            zero = torch.zeros((), dtype=cdt, device=device)
            unit_feats = zero.expand(p_count, valid.shape[1], 2 * key_dim)
        elif gid is None:
            unit_feats = token_features(keys, values, per_head, cdt)
        elif group_index is not None:
            unit_feats = group_centroids(token_features(keys, values, per_head, cdt), gid, valid.shape[1])
        else:
            unit_feats = group_features(keys, values, cand_bn, group_size, valid.shape[1], per_head, cdt)

        units = UnitBatch(feats=unit_feats, key_dim=key_dim, valid=valid, rank=unit_rank, count=count,
                          k=k, k_max=k_max, period=period, granularity=granularity, group_size=group_size,
                          generator=generator)
        empty = torch.full((p_count, 0), -1, dtype=torch.long, device=device)
        order = self._order_units(units) if k_max > 0 else empty
        chosen = self._check_order(order, units)

        kept_cand = chosen if gid is None else expand_group_selection(chosen, gid)
        keep = ~cand | kept_cand | keep_all[:, None]

        lead = (b_count, h_count) if per_head else (b_count,)
        return SelectionResult(keep=keep.reshape(*lead, n_tok), order=order.reshape(*lead, order.shape[-1]),
                               granularity=granularity, group_size=group_size, per_head=per_head)

    @abc.abstractmethod
    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        """Choose ``units.k[p]`` distinct valid units of every problem ``p``.

        Returns ``long [P, units.k_max]``: the chosen unit indices in the order chosen, ``-1`` after
        the first ``k[p]`` entries of row ``p``. Break exact ties toward the lowest unit index.
        """

    def _check_order(self, order: torch.Tensor, units: UnitBatch) -> torch.Tensor:
        """Enforce the exact-count contract on a policy's output; returns the chosen-unit mask."""
        p_count, m = units.valid.shape
        if order.shape != (p_count, units.k_max) or order.dtype != torch.long:
            raise RuntimeError(f"{self.name}: policy returned order of shape {tuple(order.shape)} "
                               f"({order.dtype}); expected ({p_count}, {units.k_max}) long")
        chosen = units_to_mask(order, m)
        ok = (order >= 0).sum(-1) == units.k
        ok &= (chosen.sum(-1) == units.k) & ~(chosen & ~units.valid).any(-1)
        if ok.numel() and not bool(ok.all()):
            raise RuntimeError(f"{self.name}: policy broke the exact-count contract "
                               "(wrong count, repeated or invalid units)")
        return chosen


# --------------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------------


def _check_group_index(group_index: Any, keys: torch.Tensor, granularity: str) -> None:
    """Validate ``group_index``'s type, shape and device (its order is checked where groups are built,
    :func:`~cords_vllm.selection.granularity.labelled_group_ids`)."""
    b_count, _, n_tok, _ = keys.shape
    if granularity == "token":
        raise ValueError("group_index: only meaningful at frame/block granularity")
    if not isinstance(group_index, torch.Tensor) or group_index.dtype != torch.long:
        raise ValueError(f"group_index: expected a long torch.Tensor [B, N], got {group_index!r:.80}")
    if tuple(group_index.shape) != (b_count, n_tok) or group_index.device != keys.device:
        raise ValueError(f"group_index: expected shape [B, N] = {(b_count, n_tok)} on {keys.device}, got "
                         f"{tuple(group_index.shape)} on {group_index.device}")


def _check_inputs(
    keys: Any,
    values: Any,
    budget: Any,
    candidates: Any,
    granularity: Any,
    group_size: Any,
    per_head: Any,
    generator: Any,
) -> int:
    """Validate the arguments of :meth:`Selector.select`; return the budget as an int."""
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [B, H, N, D] (problems, KV heads, tokens, "
                             f"head dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if values.shape != keys.shape:
        raise ValueError(f"values: shape {tuple(values.shape)} does not match keys shape {tuple(keys.shape)}")
    if values.dtype != keys.dtype:
        raise ValueError(f"values: dtype {values.dtype} does not match keys dtype {keys.dtype}")
    if values.device != keys.device:
        raise ValueError(f"values: device {values.device} does not match keys device {keys.device}")
    b_count, h_count, n_tok, d_head = keys.shape
    if b_count < 1 or h_count < 1 or d_head < 1:
        raise ValueError(f"keys: B, H and D must be >= 1, got shape {tuple(keys.shape)}")
    for name, t in (("keys", keys), ("values", values)):
        if t.numel():  # min and max propagate NaN and reach +-inf: one cheap pass, no temporary
            lo, hi = torch.aminmax(t)
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                raise ValueError(f"{name}: contains NaN or inf")

    if isinstance(budget, bool):
        raise ValueError(f"budget: expected a non-negative int, got {budget!r}")
    try:
        budget = operator.index(budget)
    except TypeError:
        raise ValueError(f"budget: expected a non-negative int, got {budget!r}") from None
    if budget < 0:
        raise ValueError(f"budget: must be >= 0, got {budget}")

    if candidates is not None:
        if not isinstance(candidates, torch.Tensor):
            raise ValueError(f"candidates: expected a bool torch.Tensor [B, N] or None, got "
                             f"{type(candidates).__name__}")
        if candidates.dtype != torch.bool:
            raise ValueError(f"candidates: expected dtype torch.bool, got {candidates.dtype}")
        if tuple(candidates.shape) != (b_count, n_tok):
            raise ValueError(f"candidates: expected shape [B, N] = {(b_count, n_tok)}, got "
                             f"{tuple(candidates.shape)}")
        if candidates.device != keys.device:
            raise ValueError(f"candidates: device {candidates.device} does not match keys device "
                             f"{keys.device}")

    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: expected a positive int or None, got {group_size!r}")
    elif granularity != "token":
        raise ValueError(f"group_size: required (tokens per {granularity}) at {granularity} granularity")
    if not isinstance(per_head, bool):
        raise ValueError(f"per_head: expected a bool, got {per_head!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    return budget
