"""CoRDS: greedy D^2-style coreset selection in joint key-value space with an orthogonal bonus.

The policy (:class:`CoRDSSelector`) and its greedy run, Algorithm 1 of the CoRDS paper (:func:`cords_greedy`), which
two implementations compute alike: :mod:`~cords_vllm.selection.cords_torch`, a greedy step as a fixed list of PyTorch
ops (the reference, and what runs on CPU; its aten ops per step, :data:`OPS_PER_GREEDY_STEP`), and
:mod:`~cords_vllm.selection.cords_triton`, the whole run as one Triton kernel.

Numerics (documented because the brute-force reference applies the same rules):

* arithmetic runs in the compute dtype (float32; float64 for float64 inputs);
* ``d_alpha(i, j)`` is clamped at 0 and *snapped* to exactly 0 when ``<= tol * (base_i + base_j)``;
  a squared residual is snapped to 0 when ``<= tol * |x_i|^2``, and a selected point adds a new
  orthonormal direction only if its (snapped) residual is positive; a cosine ``>= 1 - tol`` counts as
  exactly 1. ``tol`` is :func:`snap_tolerance` of the compute dtype (``1e-4`` for float32, ``1e-12`` for
  float64): it makes duplicated tokens (common once a cache is stored in bf16) and saturated spans
  compare exactly equal, so that exact ties are decided by the tie rule and not by rounding noise;
* zero vectors have cosine 0 with everything;
* tie rule: the next unit is the *lowest-index* unit of the pool whose score is within ``tol`` of the
  pool's best score (the seed: within ``tol`` relative of the largest norm). Scores that tie in exact
  arithmetic (duplicated frames, symmetric configurations) can differ in the last bits depending on
  summation order (device, batch, centroid order); the slack makes such ties resolve the same way
  everywhere. Near-ties closer than ``tol`` are treated as ties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from cords_vllm.kernel_backend import use_triton
from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.cords_torch import OPS_PER_GREEDY_STEP, cords_greedy_torch
from cords_vllm.selection.greedy_params import GreedyParams, snap_tolerance
from cords_vllm.selection.params import hyperparameter
from cords_vllm.selection.registry import register_selector

#: Public names, with those of the modules it builds on that other code imports from here (``GreedyParams``,
#: ``OPS_PER_GREEDY_STEP``, ``snap_tolerance``).
__all__ = ["NOVELTY_VARIANTS", "OPS_PER_GREEDY_STEP", "SPACES", "CoRDSSelector", "GreedyParams", "cords_greedy",
           "normalized_features", "snap_tolerance"]

NOVELTY_VARIANTS: tuple[str, ...] = ("max_cosine", "exact")
#: The joint key/value space the distance is measured in: ``"paper"`` (raw keys and values, Eq. ``dalpha``) or
#: ``"normalized"`` (keys and values each divided by their RMS spread over the problem's units, so ``alpha`` weighs
#: the two spaces and not their units: :func:`normalized_features`).
SPACES: tuple[str, ...] = ("paper", "normalized")


def normalized_features(feats: torch.Tensor, key_dim: int, valid: torch.Tensor) -> torch.Tensor:
    """``feats`` (``[P, M, Dk + Dv]``, keys first) with each problem's keys and values each divided by their RMS
    spread over its valid units (``bool [P, M]``): ``s_K = sqrt(mean_i |k_i - mean(k)|^2)``, likewise ``s_V``; a
    space with no spread is left as it is.

    The mean squared distance between two units of a space is ``2 s^2``, so in these units the keys and the values
    each contribute the same typical distance and ``alpha`` is the keys' share of the joint distance
    ``alpha |k_i - k_j|^2 + (1 - alpha) |v_i - v_j|^2`` on average, whatever their scales. (The norms alone do
    not tell: a space whose vectors share a large common part has large norms but small distances.) Only scaled,
    never shifted, so cosines, and so the max-cosine novelty, do not change. Computed once per run on the device,
    with no host read.
    """
    dtype = feats.dtype if feats.dtype == torch.float64 else torch.float32
    x = feats.to(dtype)
    count = valid.sum(-1, keepdim=True).clamp_min(1).to(dtype).unsqueeze(-1)  # [P, 1, 1]
    mask = valid.unsqueeze(-1)
    scaled = []
    for part in (x[..., :key_dim], x[..., key_dim:]):
        part = torch.where(mask, part, 0.0)
        mean = part.sum(1, keepdim=True) / count  # [P, 1, D]
        spread = torch.where(mask, part - mean, 0.0).square().sum((1, 2), keepdim=True) / count  # [P, 1, 1]
        scale = torch.where(spread > 0, torch.rsqrt(torch.where(spread > 0, spread, 1.0)), 1.0)
        scaled.append(part * scale)
    return torch.cat(scaled, -1)


def cords_greedy(
    feats: torch.Tensor,
    key_dim: int,
    valid: torch.Tensor,
    k: torch.Tensor,
    k_max: int,
    *,
    alpha: float,
    eta: float,
    lam: float,
    eps0: float,
    novelty: str,
) -> torch.Tensor:
    """Algorithm 1 on a batch of problems: greedy selection of ``k[p]`` units per problem.

    Parameters
    ----------
    feats:
        ``[P, M, Dk + Dv]`` features (keys then values) in the compute dtype; ``Dk == Dv`` whenever
        both halves are used (the seed adds them).
    key_dim:
        ``Dk``.
    valid:
        ``bool [P, M]`` selectable units (``valid.sum(-1) >= k``).
    k, k_max:
        ``long [P]`` units to select per problem and ``max(k)``.
    alpha, eta, lam, eps0, novelty:
        See :class:`CoRDSSelector`.

    Returns
    -------
    ``long [P, k_max]``: selected units in greedy order (seed first), ``-1`` after ``k[p]`` entries.

    Notes
    -----
    The seed is ``argmax_i ||k_i + v_i||`` (Algorithm 1); at the endpoints ``alpha = 1`` / ``alpha = 0``,
    where the distance sees only keys / only values, the seed is ``argmax ||k_i||`` / ``argmax ||v_i||``
    so that those endpoints are exactly K-only / V-only D^2 selection. The seed is the first of the
    ``k`` selected units (Algorithm 1's loop adds ``b`` more; we stop at ``b`` in total).
    Terms that cannot change the score are skipped (the values at ``alpha = 1`` when ``eta = 1`` or
    ``lam = 0``, the novelty state when ``lam = 0``); the result is the same.

    Structure: the Triton kernel where :func:`~cords_vllm.kernel_backend.use_triton` says it runs
    (:func:`~cords_vllm.selection.cords_triton.cords_greedy_triton`, unless the problem is past its limits), else the
    PyTorch steps (:func:`~cords_vllm.selection.cords_torch.cords_greedy_torch`).

    Raises
    ------
    ValueError
        ``novelty`` is not one of :data:`NOVELTY_VARIANTS`, or the exact novelty reads keys and values of
        different widths (``Dk != Dv``).
    """
    if novelty not in NOVELTY_VARIANTS:
        raise ValueError(f"novelty: must be one of {', '.join(NOVELTY_VARIANTS)}, got {novelty!r}")
    if k_max == 0:
        return torch.full((feats.shape[0], 0), -1, dtype=torch.long, device=feats.device)
    if use_triton(feats.device):
        from cords_vllm.selection.cords_triton import cords_greedy_triton  # Triton is imported where kernels run

        order = cords_greedy_triton(feats, key_dim, valid, k, k_max, alpha=alpha, eta=eta, lam=lam, eps0=eps0,
                                    novelty=novelty)
        if order is not None:
            return order
    return cords_greedy_torch(feats, key_dim, valid, k, k_max, alpha=alpha, eta=eta, lam=lam, eps0=eps0,
                              novelty=novelty)


@register_selector("cords")
@dataclass(frozen=True)
class CoRDSSelector(Selector):
    """CoRDS: coreset selection in joint KV space with an orthogonal anti-redundancy bonus.

    Idea: keep the subset that best *covers* the cache. Greedy D^2-style farthest-first selection
    under the bicriteria distance ``d_alpha(i, S) = min_{j in S} alpha ||k_i - k_j||^2 + (1 - alpha)
    ||v_i - v_j||^2``, plus a bonus for candidates that add a new direction to the span of the kept keys
    and values. Each step picks ``argmax_i d~(i) + lam * Orth~(i)`` over the not-yet-selected candidates,
    ``~`` being min-max normalisation over that pool: ``(x - min) / (max - min + eps0)``. Seed:
    ``argmax ||k_i + v_i||``. Query-agnostic and training-free.

    Paper: "CoRDS" (this repository's ``paper/``), Algorithm 1, Eqs. ``dalpha``, ``orth-score``,
    ``final-score``; defaults from its implementation details.

    Parameters
    ----------
    alpha:
        Key/value weight of the bicriteria distance, in [0, 1]; 1 = keys only, 0 = values only.
        The paper's accuracy peaks at 0.1-0.25 (value-favouring); it is the one parameter worth tuning.
    eta:
        Key/value weight of the orthogonal novelty, in [0, 1].
    lam:
        Weight ``lambda`` of the orthogonal bonus, ``>= 0``; 0 = pure bicriteria D^2. The paper finds
        [0.1, 0.5] flat and 1 harmful.
    eps0:
        Regulariser of the min-max normalisation, ``> 0`` (numerical only).
    space:
        ``"paper"`` (default): the distance over raw keys and values, as the paper writes it. ``"normalized"``:
        keys and values each divided by their RMS spread over the problem's candidates
        (:func:`normalized_features`), so that ``alpha`` is the keys' share of the distance on average and not a
        weight against their units (on the shipped model at ``alpha = 0.25`` the keys make 25-48% of the raw
        distance, depending on the layer: ``benchmarks/kv_scales.py``). Exact against the brute-force
        reference in both. The default stays the paper's until the accuracy benchmark, tuned on a separate split,
        says otherwise.
    novelty:
        ``"max_cosine"`` (default): ``Orth(i) = eta (1 - max_{j in S} cos(k_i, k_j)) + (1 - eta)
        (1 - max_{j in S} cos(v_i, v_j))``, the surrogate the paper's implementation (and so its
        published accuracy) uses. ``"exact"``: ``Orth(i) = eta ||(I - P_S^K) k_i||^2 + (1 - eta)
        ||(I - P_S^V) v_i||^2`` as written in Algorithm 1, by incremental Gram-Schmidt. The surrogate is
        the default because it reproduces the paper's experiments and keeps discriminating when the
        budget exceeds the feature dimension: the exact residual is identically zero once the kept
        keys span the feature space (after ``H*D`` picks, i.e. for most of the greedy run at realistic
        budgets of thousands of tokens), after which ``exact`` degenerates to ``lam = 0``. Both cost
        one pass over the features per step.

    Notes
    -----
    Ties (scores within :func:`snap_tolerance` of the best) go to the lowest unit index. The paper
    also mentions ``beta = 0.15`` and a follower decay ``gamma`` without defining them; they are not
    exposed.
    """

    alpha: float = hyperparameter(0.25, low=0.0, high=1.0,
                                  help="key/value weight of the bicriteria distance (1 = keys only)")
    eta: float = hyperparameter(0.25, low=0.0, high=1.0, help="key/value weight of the orthogonal novelty")
    lam: float = hyperparameter(0.25, low=0.0, help="weight lambda of the orthogonal bonus (0 = pure D^2)")
    eps0: float = hyperparameter(1e-6, low=0.0, low_open=True, help="min-max normalisation regulariser")
    novelty: str = hyperparameter("max_cosine", choices=NOVELTY_VARIANTS,
                                  help="orthogonal novelty: paper's max-cosine surrogate or exact residual")
    space: str = hyperparameter("paper", choices=SPACES,
                                help="joint space of the distance: raw keys and values (the paper's), or each "
                                     "divided by its RMS spread over the candidates so alpha weighs the spaces")

    batches_problems: ClassVar[bool] = True

    def greedy_params(self) -> GreedyParams | None:
        return GreedyParams(self.alpha, self.eta, self.lam, self.eps0, self.novelty, self.space)

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        feats = units.feats if self.space == "paper" else normalized_features(units.feats, units.key_dim,
                                                                              units.valid)
        return cords_greedy(feats, units.key_dim, units.valid, units.k, units.k_max, alpha=self.alpha,
                            eta=self.eta, lam=self.lam, eps0=self.eps0, novelty=self.novelty)
