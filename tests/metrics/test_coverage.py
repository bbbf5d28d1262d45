"""Coverage CDFs of nearest-kept cosine distance, and CoRDS's coverage on structured synthetic KV."""

from __future__ import annotations

import pytest
import torch

from cords_vllm.lab.fidelity import (
    coverage_cdf,
    coverage_curves,
    dominates,
    max_cdf_gap,
    nearest_kept_cosine_distance,
    plot_coverage_cdfs,
)
from cords_vllm.lab.synthetic.kv import make_synthetic_kv
from cords_vllm.selection import get_selector


def rand_kv(seed: int, b: int = 2, h: int = 2, n: int = 40, d: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=g, dtype=torch.float64), torch.randn(b, h, n, d, generator=g,
                                                                                    dtype=torch.float64)


def test_distances_match_a_brute_force() -> None:
    k, v = rand_kv(0)
    keep = torch.rand(2, 40, generator=torch.Generator().manual_seed(1)) < 0.3
    keep[:, 0] = True
    for space in ("joint", "k", "v"):
        dist = nearest_kept_cosine_distance(k, v, keep, space=space)
        kf = k.permute(0, 2, 1, 3).reshape(2, 40, -1)
        vf = v.permute(0, 2, 1, 3).reshape(2, 40, -1)
        for b in range(2):
            kept = keep[b].nonzero().flatten()
            for i in range(40):
                ck = torch.nn.functional.cosine_similarity(kf[b, i][None], kf[b, kept], dim=-1)
                cv = torch.nn.functional.cosine_similarity(vf[b, i][None], vf[b, kept], dim=-1)
                sim = {"joint": (ck + cv) / 2, "k": ck, "v": cv}[space]
                want = 0.0 if bool(keep[b, i]) else float(1 - sim.max())
                assert abs(float(dist[b, i]) - want) < 1e-9


def test_per_head_distances_and_cdf() -> None:
    k, v = rand_kv(2)
    keep = torch.zeros(2, 2, 40, dtype=torch.bool)
    keep[..., ::5] = True
    dist = nearest_kept_cosine_distance(k, v, keep, space="k")
    assert dist.shape == (2, 2, 40) and bool((dist[keep] == 0).all())
    cdf = coverage_cdf(dist)
    assert bool((cdf.cdf[1:] >= cdf.cdf[:-1]).all()) and float(cdf.cdf[-1]) == 1.0
    assert float(cdf.cdf[0]) >= 0.2  # the kept fifth sits at distance 0
    only_dropped = coverage_cdf(dist, ~keep)
    assert float(only_dropped.cdf[0]) == 0.0


def test_keeping_everything_is_perfect_coverage() -> None:
    k, v = rand_kv(3)
    curves = coverage_curves(k, v, torch.ones(2, 40, dtype=torch.bool))
    for c in curves.values():
        assert bool((c.cdf == 1.0).all())
    gap, _ = max_cdf_gap(curves["joint"], curves["k"])
    assert gap == 0.0 and dominates(curves["joint"], curves["k"])


@pytest.fixture(scope="module")
def video_kv():
    return make_synthetic_kv(num_frames=48, tokens_per_frame=16, num_heads=2, head_dim=32, seed=0)


@pytest.fixture(scope="module")
def video_curves(video_kv):
    budget = video_kv.num_tokens // 8
    out = {}
    for name in ("cords", "uniform", "infinipot_v", "recency"):
        res = get_selector(name).select(video_kv.keys, video_kv.values, budget,
                                        group_size=video_kv.tokens_per_frame)
        out[name] = coverage_curves(video_kv.keys, video_kv.values, res.keep)
    return out


@pytest.mark.parametrize("other", ["uniform", "infinipot_v", "recency"])
def test_cords_coverage_dominates_baselines_on_synthetic_video_kv(video_curves, other: str) -> None:
    for space in ("joint", "k", "v"):
        ours, theirs = video_curves["cords"][space], video_curves[other][space]
        assert dominates(ours, theirs, atol=0.02), (space, max_cdf_gap(theirs, ours))
        assert max_cdf_gap(ours, theirs)[0] > 0.05 or space == "v"


def test_cords_keeps_the_needle_and_beats_infinipot_v_at_frame_granularity(video_kv) -> None:
    budget = video_kv.num_tokens // 8
    kw = dict(granularity="frame", group_size=video_kv.tokens_per_frame)
    ours = get_selector("cords").select(video_kv.keys, video_kv.values, budget, **kw)
    theirs = get_selector("infinipot_v").select(video_kv.keys, video_kv.values, budget, **kw)
    assert bool((ours.keep[0] & video_kv.needle_tokens).any())
    a = coverage_curves(video_kv.keys, video_kv.values, ours.keep)
    b = coverage_curves(video_kv.keys, video_kv.values, theirs.keep)
    for space in ("joint", "k", "v"):
        assert dominates(a[space], b[space], atol=0.02)


def test_plot_writes_a_png(video_curves, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_coverage_cdfs(video_curves, tmp_path / "sub" / "cdf.png", reference=("cords", "infinipot_v"),
                             title="synthetic", max_distance=0.6)
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_name_the_argument() -> None:
    k, v = rand_kv(4)
    keep = torch.ones(2, 40, dtype=torch.bool)
    with pytest.raises(ValueError, match="space"):
        nearest_kept_cosine_distance(k, v, keep, space="kv")
    with pytest.raises(ValueError, match="keep"):
        nearest_kept_cosine_distance(k, v, keep[:, :5])
    with pytest.raises(ValueError, match="keep"):
        nearest_kept_cosine_distance(k, v, torch.zeros(2, 40, dtype=torch.bool))
    with pytest.raises(ValueError, match="per_head"):
        nearest_kept_cosine_distance(k, v, torch.ones(2, 2, 40, dtype=torch.bool), per_head=False)
