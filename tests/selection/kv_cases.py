"""Random selection problems shared by the selection tests (plain tensors and hypothesis strategies)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from cords_vllm.selection import Observation, Selector


@dataclass(frozen=True)
class Case:
    """One ``select`` call: inputs and options."""

    keys: torch.Tensor
    values: torch.Tensor
    candidates: torch.Tensor | None
    budget: int
    granularity: str
    group_size: int | None
    per_head: bool

    def kwargs(self) -> dict:
        return dict(candidates=self.candidates, granularity=self.granularity, group_size=self.group_size,
                    per_head=self.per_head)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.keys.shape)  # type: ignore[return-value]


def observation_of(keys: torch.Tensor) -> Observation:
    """Observation queries made of ``keys`` (``[B, H, N, D]``): two rows and two query heads per KV head, each
    row a sum over the tokens, so they belong to their problem alone and do not change when its tokens are
    permuted."""
    rows = torch.stack([keys.sum(2), keys.flip(-1).sum(2)], dim=2)  # [B, H, 2, D]
    return Observation(rows.repeat_interleave(2, dim=1))


def policy_inputs(selector: Selector, keys: torch.Tensor) -> dict:
    """What ``selector`` needs besides keys and values: observation queries for attention-scored policies."""
    return {"observation": observation_of(keys)} if selector.needs_observation else {}


def random_kv(seed: int, b: int, h: int, n: int, d: int, dtype: torch.dtype = torch.float64
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Continuous random keys/values ``[b, h, n, d]`` (no exact ties with probability 1)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    values = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    return keys.to(dtype), values.to(dtype)


def random_candidates(seed: int, b: int, n: int, p: float = 0.8) -> torch.Tensor:
    """``bool [b, n]``: each token a candidate with probability ``p``."""
    g = torch.Generator().manual_seed(seed + 7919)
    return torch.rand(b, n, generator=g) < p


@st.composite
def cases(draw: st.DrawFn, *, max_n: int = 24, max_d: int = 5, token_only: bool = False,
          dtype: torch.dtype = torch.float64) -> Case:
    """Hypothesis strategy: a small random problem with random options."""
    b = draw(st.integers(1, 3))
    h = draw(st.integers(1, 3))
    n = draw(st.integers(0, max_n))
    d = draw(st.integers(1, max_d))
    seed = draw(st.integers(0, 2**31 - 1))
    keys, values = random_kv(seed, b, h, n, d, dtype)
    mode = draw(st.sampled_from(["none", "random", "all_protected"]))
    if mode == "none":
        cand = None
    elif mode == "random":
        cand = random_candidates(seed, b, n, draw(st.sampled_from([0.5, 0.8, 1.0])))
    else:
        cand = torch.zeros(b, n, dtype=torch.bool)
    gran = "token" if token_only else draw(st.sampled_from(["token", "frame", "block"]))
    group = draw(st.integers(1, 5)) if gran != "token" else draw(st.one_of(st.none(), st.integers(1, 5)))
    budget = draw(st.integers(0, n + 2))
    per_head = draw(st.booleans())
    return Case(keys, values, cand, budget, gran, group, per_head)


def expected_kept(case: Case) -> torch.Tensor:
    """``long [B]``: the contract's kept count per problem (protected + kept candidates)."""
    b, _, n, _ = case.shape
    cand = torch.ones(b, n, dtype=torch.bool) if case.candidates is None else case.candidates
    n_cand = cand.sum(-1)
    protected = n - n_cand
    if case.granularity == "token":
        kept = torch.clamp(n_cand, max=case.budget)
    else:
        g = case.group_size
        kept = torch.where(n_cand <= case.budget, n_cand, g * (case.budget // g))
    return protected + kept
