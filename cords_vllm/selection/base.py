"""The selector interface: :class:`Selector`, the base class of every KV eviction policy.

Every eviction policy is a :class:`Selector`, a frozen dataclass whose fields are its hyper-parameters.
A policy only implements :meth:`Selector._order_units`, which ranks *units* (tokens, or frame/block
centroids) of a batch of independent problems and returns the units it keeps, in the order it chose
them. Everything that is common to all policies is done once, by :meth:`Selector.select`, with the
helpers of its sibling modules:

* :mod:`~cords_vllm.selection.params`: hyper-parameter declaration and validation;
* :mod:`~cords_vllm.selection.validation`: validation of the inputs (shapes, dtypes, devices, NaN/inf,
  budget) with a ``ValueError`` that names the offending argument;
* :mod:`~cords_vllm.selection.batch`: the compute dtype (features are copied to float32, float64 inputs
  stay float64, so bf16/fp16 caches read back from the engine are scored in fp32), the feature scope (all
  KV heads of a layer jointly, one feature of dim ``H*D``, or each head alone), the candidate mask
  (protected tokens are always kept and never counted against the budget) and granularity (groups of
  consecutive candidate tokens, frames or paged blocks, represented by centroids, and the expansion of
  chosen groups back to their tokens);
* :mod:`~cords_vllm.selection.result`: the result type and the exact-count contract the engine relies on
  (every problem keeps the same, predictable number of tokens), checked here on every call.

Invariant (the engine's contract): for a problem with ``n`` candidate tokens and ``p`` protected tokens,
the number of kept tokens is ``p + n`` when ``budget >= n``; otherwise ``p + budget`` at token
granularity and ``p + group_size * (budget // group_size)`` at frame/block granularity. It depends only
on ``n``, ``p``, ``budget`` and ``group_size``, never on the features.

Host synchronisation: by default :meth:`Selector.select` checks its data (finite keys and values, labelled
groups in order) and reads the widths it needs (units, ``k_max``) from the device, a few host reads. A caller
that knows those counts on the host passes them as :class:`~cords_vllm.selection.batch.HostCounts`, which also
vouches for the data: then the call reads nothing back (what the compress step does, through
:func:`~cords_vllm.selection.exact.select_exact`).

The names of the sibling modules that other code imports from here (``GRANULARITIES``, ``compute_dtype``,
``SelectionResult``, ...) are re-exported (see ``__all__``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from cords_vllm.selection.batch import (
    GRANULARITIES,
    Granularity,
    HostCounts,
    UnitBatch,
    build_units,
    compute_dtype,
)
from cords_vllm.selection.granularity import units_to_mask
from cords_vllm.selection.greedy_params import GreedyParams
from cords_vllm.selection.observation import Observation, observed_attention
from cords_vllm.selection.params import ParamSpec, check_params, hyperparameter, param_specs_of
from cords_vllm.selection.result import SelectionResult, kept_candidate_count
from cords_vllm.selection.together import SelectionSteps, UnitsToOrder, driven_alone
from cords_vllm.selection.validation import check_group_index, check_select_inputs

__all__ = [
    "GRANULARITIES",
    "Granularity",
    "HostCounts",
    "Observation",
    "ParamSpec",
    "SelectionResult",
    "Selector",
    "UnitBatch",
    "compute_dtype",
    "hyperparameter",
    "kept_candidate_count",
]


@dataclass(frozen=True)
class Selector(abc.ABC):
    """Base class of every KV eviction policy: a frozen dataclass whose fields are hyper-parameters.

    Subclasses declare fields with :func:`~cords_vllm.selection.params.hyperparameter` (validated in
    ``__post_init__``), set ``name`` through :func:`~cords_vllm.selection.registry.register_selector`, and
    implement :meth:`_order_units`.

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
    needs_observation:
        True if the policy scores tokens by the attention of observation queries (SnapKV, StreamMem): an
        :class:`~cords_vllm.selection.observation.Observation` is then required, and the policy reads
        :attr:`UnitBatch.scores`.
    observation_source:
        Where an engine takes the observation queries from, for ``needs_observation`` policies:
        ``"newest_candidates"`` (the newest video tokens, each seeing only the tokens before it) or
        ``"prompt_before_candidates"`` (the text right before the first video, seeing every held token) or
        ``"prompt_at_newest"`` (the same rows, rotated to the position after the newest token); the policy's
        ``window`` says how many rows. ``None`` otherwise.
    engine_defaults:
        ``kv_policy_config`` engine keys (``anchors``, ``per_head``, ``granularity``, ...) this policy defaults to,
        where they are part of its rule (e.g. a per-layer, per-head variant); the user's configuration overrides
        them. Empty for most policies.
    batches_problems:
        True if :meth:`_order_units` reads only ``feats``, ``key_dim``, ``valid``, ``k`` and ``k_max``, orders
        every problem alone and is unchanged by invalid units appended to a problem: the orders of several
        selections may then be computed in one call (:mod:`~cords_vllm.selection.together`; what the engine does
        for a step's compressions).
    """

    name: ClassVar[str] = ""
    uses_token_order: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False
    needs_frame_length: ClassVar[bool] = False
    needs_observation: ClassVar[bool] = False
    observation_source: ClassVar[str | None] = None
    engine_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    batches_problems: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_params(self, self.name or type(self).__name__)

    # -- introspection -----------------------------------------------------------------------------

    @classmethod
    def param_specs(cls) -> dict[str, ParamSpec]:
        """The hyper-parameters of this selector, by name, in declaration order."""
        return param_specs_of(cls)

    def params(self) -> dict[str, Any]:
        """Current hyper-parameter values, by name."""
        return {name: getattr(self, name) for name in self.param_specs()}

    # -- the main call -----------------------------------------------------------------------------

    def select_steps(self, keys: torch.Tensor, values: torch.Tensor, budget: int, *,
                     candidates: torch.Tensor | None = None, granularity: Granularity = "token",
                     group_size: int | None = None, group_index: torch.Tensor | None = None, per_head: bool = False,
                     generator: torch.Generator | None = None, counts: HostCounts | None = None,
                     observation: Observation | None = None) -> SelectionSteps[SelectionResult]:
        """Choose which tokens of each problem to keep, as a generator: yields the units it needs ordered
        (:class:`UnitsToOrder`, when this policy :attr:`batches_problems`) and receives their order, so that a caller
        may order several selections together (:func:`~cords_vllm.selection.together.run_together`); :meth:`select`
        runs it alone.

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
        counts:
            What the caller knows on the host (:class:`~cords_vllm.selection.batch.HostCounts`): the call then
            reads nothing back from the device, skips the data checks the counts vouch for, and checks the
            policy's output with a device assertion. ``None``: checked and read from the device.
        observation:
            The observation queries of every problem
            (:class:`~cords_vllm.selection.observation.Observation`): required by the attention-scored policies
            (``needs_observation``), ignored by the others.

        Returns
        -------
        SelectionResult
            ``keep`` holds ``protected + kept candidates`` per problem, exactly as stated in the
            module docstring.
        """
        budget = check_select_inputs(keys, values, budget, candidates, granularity, group_size, per_head,
                                     generator, check_finite=counts is None)
        if group_index is not None:
            check_group_index(group_index, keys, granularity)
        token_scores = self._token_scores(keys, group_size, observation)
        units, layout = build_units(keys, values, budget, candidates=candidates, granularity=granularity,
                                    group_size=group_size, group_index=group_index, per_head=per_head,
                                    generator=generator, counts=counts, token_scores=token_scores)
        if units.k_max == 0:
            order = units.empty_order()
        elif self.batches_problems:
            order = yield UnitsToOrder(self, units)
        else:
            order = self._order_units(units)
        chosen = self._check_order(order, units, on_device=counts is not None)
        return SelectionResult(keep=layout.keep(chosen), order=layout.order(order), granularity=granularity,
                               group_size=group_size, per_head=per_head)

    def _token_scores(self, keys: torch.Tensor, group_size: int | None,
                      observation: Observation | None) -> torch.Tensor | None:
        """What this policy reads besides the keys and values (``[B, H, N, D]``), checked: ``group_size`` (tokens per
        frame, for :attr:`needs_frame_length`) and the ``observation`` queries (for :attr:`needs_observation`), whose
        attention scores every token (returned, ``[B, H, N]``; ``None`` for the other policies)."""
        if self.needs_frame_length and group_size is None:
            raise ValueError(f"group_size: {self.name} needs group_size = tokens per frame at token "
                             "granularity")
        if not self.needs_observation:
            return None
        if observation is None:
            raise ValueError(f"observation: {self.name} scores tokens by the attention of observation queries; "
                             "pass observation=Observation(queries=[B, Hq, W, D])")
        observation.check(keys)
        return observed_attention(keys, observation, compute_dtype(keys.dtype))

    select = driven_alone(select_steps, "select", """Choose which tokens of each problem to keep: :meth:`select_steps`
        driven to its result alone (same arguments and result, documented there).""", method=True)

    @abc.abstractmethod
    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        """Choose ``units.k[p]`` distinct valid units of every problem ``p``.

        Returns ``long [P, units.k_max]``: the chosen unit indices in the order chosen, ``-1`` after
        the first ``k[p]`` entries of row ``p``. Break exact ties toward the lowest unit index.
        """

    def greedy_params(self) -> GreedyParams | None:
        """The greedy D^2 run's constants when this policy is that run as the kernels compute it (CoRDS with
        either novelty, in either space, k_only, v_only), so the compress step may run it on its fused
        kernel path (:mod:`cords_vllm.compress.step_triton`); ``None`` (every other policy): it may not."""
        return None

    def _check_order(self, order: torch.Tensor, units: UnitBatch, on_device: bool = False) -> torch.Tensor:
        """Enforce the exact-count contract on a policy's output; returns the chosen-unit mask ``bool [P, M]``.

        Raises ``RuntimeError`` if ``order`` is not ``long [P, k_max]`` or does not list exactly ``k[p]``
        distinct valid units in every row ``p``. ``on_device``: the count check is a device assertion
        (``torch._assert_async``: no host read; on a GPU a failure surfaces as a device-side assert).
        """
        p_count, m = units.valid.shape
        if order.shape != (p_count, units.k_max) or order.dtype != torch.long:
            raise RuntimeError(f"{self.name}: policy returned order of shape {tuple(order.shape)} "
                               f"({order.dtype}); expected ({p_count}, {units.k_max}) long")
        chosen = units_to_mask(order, m)
        ok = (order >= 0).sum(-1) == units.k
        ok &= (chosen.sum(-1) == units.k) & ~(chosen & ~units.valid).any(-1)
        message = f"{self.name}: policy broke the exact-count contract (wrong count, repeated or invalid units)"
        if on_device:
            torch._assert_async(ok.all(), message)
        elif ok.numel() and not bool(ok.all()):
            raise RuntimeError(message)
        return chosen
