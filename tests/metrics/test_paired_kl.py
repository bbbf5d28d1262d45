"""The paired fidelity measure (:mod:`cords_vllm.lab.fidelity.paired_kl`) against brute-force references: KL by
its definition in plain Python, the bootstrap interval's coverage of a known difference, the verdicts, and the
power computation against a simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cords_vllm.lab.fidelity.paired_kl import (
    FIRST_BETTER,
    NON_INFERIOR,
    SECOND_BETTER,
    UNDECIDED,
    Interval,
    decide,
    kl_from_full,
    paired_bootstrap,
    questions_needed,
)


def test_kl_matches_its_definition_and_is_zero_for_equal_distributions() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 11, generator=g) * 3, dim=-1)
    q = torch.log_softmax(torch.randn(5, 11, generator=g) * 3, dim=-1)
    kl = kl_from_full(p, q)
    for i in range(5):
        want = sum(math.exp(a) * (a - b) for a, b in zip(p[i].tolist(), q[i].tolist(), strict=True))
        assert kl[i].item() == pytest.approx(want, rel=1e-9)
    assert torch.equal(kl_from_full(p, p), torch.zeros(5, dtype=torch.float64))
    assert (kl > 0).all()


def test_kl_takes_zero_probability_tokens_and_refuses_partial_distributions() -> None:
    p = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    q = torch.log(torch.tensor([[0.25, 0.25, 0.5]]))
    assert kl_from_full(p, q).item() == pytest.approx(math.log(2))  # the p = 0 token adds nothing
    assert math.isinf(kl_from_full(q, p).item())  # full KV gives mass where the policy gives none
    with pytest.raises(ValueError, match="not normalised"):
        kl_from_full(torch.log(torch.tensor([[0.5, 0.3]])), torch.log(torch.tensor([[0.5, 0.5]])))
    with pytest.raises(ValueError, match="one shape"):
        kl_from_full(torch.zeros(2, 3), torch.zeros(3, 3))


def test_the_paired_interval_covers_a_known_difference_and_keeps_the_pairing() -> None:
    rng = np.random.default_rng(1)
    hits = 0
    for trial in range(40):
        base = rng.exponential(1.0, 200)  # the questions' own difficulty, shared by both policies
        first, second = base + 0.1 + rng.normal(0, 0.05, 200), base + rng.normal(0, 0.05, 200)
        iv = paired_bootstrap(first, second, resamples=2000, seed=trial)
        hits += iv.low <= 0.1 <= iv.high
        assert iv.n == 200 and iv.low < iv.mean < iv.high
    assert hits >= 34  # about 95% of 40
    # pairing: the shared difficulty cancels, so the interval is as narrow as the per-question noise
    assert iv.high - iv.low < 0.05
    with pytest.raises(ValueError, match="finite"):
        paired_bootstrap(np.array([1.0, np.inf]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="paired"):
        paired_bootstrap(np.ones(3), np.ones(4))


@pytest.mark.parametrize(("low", "high", "lower_is_better", "margin", "verdict"), [
    (-0.3, -0.1, True, 0.0, FIRST_BETTER),
    (0.1, 0.3, True, 0.0, SECOND_BETTER),
    (-0.1, 0.02, True, 0.05, NON_INFERIOR),
    (-0.1, 0.08, True, 0.05, UNDECIDED),
    (-0.1, 0.02, True, 0.0, UNDECIDED),
    (0.1, 0.3, False, 0.0, FIRST_BETTER),  # accuracy: higher is better
    (-0.02, 0.1, False, 0.05, NON_INFERIOR),
])
def test_a_comparison_is_decided_only_where_the_interval_excludes_zero_or_the_margin(
        low, high, lower_is_better, margin, verdict) -> None:
    assert decide(Interval((low + high) / 2, low, high, 100), lower_is_better=lower_is_better,
                  margin=margin) == verdict


def test_the_power_computation_matches_a_simulation() -> None:
    rng = np.random.default_rng(2)
    effect, sd = 0.2, 1.0
    n = questions_needed(rng.normal(effect, sd, 100_000), effect)
    assert n == pytest.approx(((1.959964 + 0.841621) * sd / effect) ** 2, rel=0.02)
    # at that n a paired z-test detects the effect about 80% of the time
    trials = rng.normal(effect, sd, (2000, n))
    z = trials.mean(axis=1) / (trials.std(axis=1, ddof=1) / math.sqrt(n))
    assert 0.76 < np.mean(np.abs(z) > 1.959964) < 0.84
    assert questions_needed(np.array([1.0, -1.0])) is None  # no effect: no finite sample size
