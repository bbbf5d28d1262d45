"""SnapKV, StreamMem and InfiniPot against brute-force references: scores by loops, pooling by hand, top-k by sort."""

from __future__ import annotations

import math

import pytest
import torch
from kv_cases import random_candidates, random_kv

from cords_vllm.selection import Observation, get_selector, observed_attention


def _scores_by_loops(keys: torch.Tensor, queries: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``[B, H, N]``: mean softmax weight per token over the rows that see any token and the head's query group."""
    b, h, n, d = keys.shape
    group = queries.shape[1] // h
    out = torch.zeros(b, h, n, dtype=torch.float64)
    for p in range(b):
        rows = [w for w in range(queries.shape[2]) if bool(visible[p, w].any())]
        for kv in range(h):
            for g in range(group):
                for w in rows:
                    seen = visible[p, w].nonzero().flatten().tolist()
                    logits = [float(queries[p, kv * group + g, w] @ keys[p, kv, j]) / math.sqrt(d) for j in seen]
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    for j, wt in zip(seen, weights, strict=True):
                        out[p, kv, j] += wt / sum(weights)
            out[p, kv] /= max(len(rows) * group, 1)
    return out


def _problem(seed: int, b: int = 2, h: int = 2, n: int = 30, d: int = 6, w: int = 5):
    keys, values = random_kv(seed, b, h, n, d)
    g = torch.Generator().manual_seed(seed + 1)
    queries = torch.randn(b, 2 * h, w, d, generator=g, dtype=torch.float64)
    visible = torch.rand(b, w, n, generator=g) < 0.7
    visible[:, 0] = False  # a row that sees nothing contributes nothing
    return keys, values, queries, visible


@pytest.mark.parametrize("seed", range(4))
def test_observed_attention_equals_the_loops(seed):
    keys, _, queries, visible = _problem(seed)
    got = observed_attention(keys, Observation(queries, visible), torch.float64)
    assert torch.allclose(got, _scores_by_loops(keys, queries, visible), atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("policy", ["streammem", "infinipot"])
def test_proxy_policies_keep_the_top_scores(seed, per_head, policy):
    keys, values, queries, visible = _problem(seed)
    cand = random_candidates(seed, 2, 30)
    res = get_selector(policy).select(keys, values, 7, candidates=cand, per_head=per_head,
                                      observation=Observation(queries, visible))
    scores = _scores_by_loops(keys, queries, visible)
    for p in range(2):
        for head in range(2) if per_head else [None]:
            s = scores[p, head] if per_head else scores[p].mean(0)
            idx = [i for i in range(30) if bool(cand[p, i])]
            best = sorted(idx, key=lambda i: (-float(s[i]), i))[:7]
            want = set(best) | {i for i in range(30) if not bool(cand[p, i])}
            keep = res.keep[p, head] if per_head else res.keep[p]
            assert set(keep.nonzero().flatten().tolist()) == want


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_snapkv_keeps_the_top_pooled_scores(seed, kernel):
    keys, values, queries, visible = _problem(seed)
    cand = random_candidates(seed, 2, 30)
    res = get_selector("snapkv", kernel_size=kernel).select(keys, values, 9, candidates=cand,
                                                            observation=Observation(queries, visible))
    scores = _scores_by_loops(keys, queries, visible).mean(1)
    for p in range(2):
        idx = [i for i in range(30) if bool(cand[p, i])]  # candidates in time order
        raw = [float(scores[p, i]) for i in idx]
        half = kernel // 2
        pooled = [sum(raw[j] for j in range(r - half, r + half + 1) if 0 <= j < len(raw)) / kernel
                  for r in range(len(raw))]
        best = sorted(range(len(idx)), key=lambda r: (-pooled[r], r))[:9]
        want = {idx[r] for r in best} | {i for i in range(30) if not bool(cand[p, i])}
        assert set(res.keep[p].nonzero().flatten().tolist()) == want


def test_frames_score_the_mean_of_their_tokens():
    keys, values, queries, _ = _problem(9, b=1, n=24)
    res = get_selector("streammem").select(keys, values, 8, granularity="frame", group_size=4,
                                           observation=Observation(queries))
    scores = _scores_by_loops(keys, queries, torch.ones(1, 5, 24, dtype=torch.bool)).mean(1)[0]
    frame = scores.view(6, 4).mean(-1)
    best = sorted(range(6), key=lambda f: (-float(frame[f]), f))[:2]
    assert set(res.keep[0].nonzero().flatten().tolist()) == {4 * f + t for f in best for t in range(4)}


def test_missing_or_misshaped_queries_are_refused():
    keys, values = random_kv(1, 2, 2, 10, 4)
    with pytest.raises(ValueError, match="observation"):
        get_selector("snapkv").select(keys, values, 3)
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        get_selector("streammem").select(keys, values, 3, observation=Observation(torch.randn(2, 3, 4, 4)))
    with pytest.raises(ValueError, match="kernel_size"):
        get_selector("snapkv", kernel_size=4)
