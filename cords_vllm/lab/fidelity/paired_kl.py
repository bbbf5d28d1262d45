"""A paired, continuous measure of fidelity: per-question KL divergence from full KV, and paired bootstrap intervals.

Accuracy near its ceiling cannot tell two policies apart: most questions are right under both. The KL divergence
of each question's answer distribution from full KV's, ``KL(p_full || p_policy)`` over the whole vocabulary,
moves on every question, and two policies answer the *same* questions, so their per-question KLs pair up: the
difference of two policies is the mean of the per-question differences, and its uncertainty comes from a
**paired bootstrap** (questions resampled with replacement, the same resample for both policies).

A comparison is **decided** only where the 95% interval of the difference excludes zero (:func:`decide`), or,
for "at least as good", excludes the stated non-inferiority margin. :func:`questions_needed` is the power
computation: how many questions a paired comparison needs to detect a difference of a given size.

Pure PyTorch / NumPy; nothing here runs an engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import torch


def kl_from_full(full_logprobs: torch.Tensor, policy_logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(p_full || p_policy)`` per question, in nats.

    ``full_logprobs``, ``policy_logprobs``: ``[N, V]`` log-probabilities of the answer token over the whole
    vocabulary (each row normalised; ``-inf`` where a token has probability 0). Returns ``[N]`` float64, ``>= 0``.
    A token the policy gives probability 0 where full KV does not makes that question's KL ``inf``.
    """
    if full_logprobs.shape != policy_logprobs.shape or full_logprobs.ndim != 2:
        raise ValueError(f"need two [N, V] log-probability tensors of one shape, got {tuple(full_logprobs.shape)} "
                         f"and {tuple(policy_logprobs.shape)}")
    p_log = full_logprobs.double()
    q_log = policy_logprobs.double()
    for name, x in (("full", p_log), ("policy", q_log)):
        mass = torch.logsumexp(x, dim=-1)
        if not torch.allclose(mass, torch.zeros_like(mass), atol=1e-4):
            raise ValueError(f"the {name} rows are not normalised distributions (log total mass up to "
                             f"{mass.abs().max().item():.3g}): pass log-probabilities over the whole vocabulary")
    p = p_log.exp()
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p))
    return terms.sum(dim=-1).clamp_min(0.0)


@dataclass(frozen=True)
class Interval:
    """A paired difference ``mean(first - second)`` and its bootstrap interval at ``level``."""

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def paired_bootstrap(first: np.ndarray | torch.Tensor, second: np.ndarray | torch.Tensor, *, resamples: int = 10_000,
                     level: float = 0.95, seed: int = 0) -> Interval:
    """Percentile bootstrap interval of ``mean(first - second)`` over paired questions.

    ``first``, ``second``: ``[N]`` per-question values of two policies on the same questions (e.g. KL from full
    KV, or 1.0 / 0.0 for right / wrong). Each resample draws ``N`` questions with replacement and takes the
    same questions from both, which keeps the pairing.
    """
    a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(f"need two paired [N] arrays with N >= 2, got {a.shape} and {b.shape}")
    if not np.isfinite(a).all() or not np.isfinite(b).all():
        raise ValueError("paired values must be finite (a KL of inf: a policy gave an answer full KV gives "
                         "probability zero)")
    if not 0 < level < 1 or resamples < 100:
        raise ValueError(f"need 0 < level < 1 and resamples >= 100, got {level}, {resamples}")
    diff = a - b
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(float(diff.mean()), float(low), float(high), len(diff), level)


#: The verdicts of :func:`decide`.
FIRST_BETTER, SECOND_BETTER, NON_INFERIOR, UNDECIDED = "first better", "second better", "non-inferior", "undecided"


def decide(interval: Interval, *, lower_is_better: bool = True, margin: float = 0.0) -> str:
    """The verdict on ``first - second`` from its interval.

    ``lower_is_better``: for a loss such as KL (else, e.g., accuracy). ``first better`` / ``second better``: the
    interval excludes zero on that side. ``non-inferior``: not better, but the interval excludes being worse by
    more than ``margin`` (``margin > 0``, in the measure's units). Otherwise ``undecided``.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    low, high = (interval.low, interval.high) if lower_is_better else (-interval.high, -interval.low)
    if high < 0:
        return FIRST_BETTER
    if low > 0:
        return SECOND_BETTER
    if margin > 0 and high < margin:
        return NON_INFERIOR
    return UNDECIDED


def questions_needed(differences: np.ndarray | torch.Tensor, effect: float | None = None, *, alpha: float = 0.05,
                     power: float = 0.8) -> int | None:
    """Questions a paired two-sided test at ``alpha`` needs to detect a mean difference of ``effect`` with
    ``power``, from the per-question differences' spread: ``n = ((z_{1-alpha/2} + z_power) * sd / effect)^2``.

    ``effect`` defaults to the observed mean difference. ``None`` when the effect is zero (no finite ``n``).
    """
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or len(d) < 2:
        raise ValueError(f"need [N] paired differences with N >= 2, got {d.shape}")
    effect = float(d.mean()) if effect is None else float(effect)
    if effect == 0:
        return None
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return int(np.ceil((z * float(d.std(ddof=1)) / abs(effect)) ** 2))
