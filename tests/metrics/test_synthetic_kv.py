"""The synthetic video KV generator: deterministic, with the structure it promises."""

from __future__ import annotations

import pytest
import torch

from cords_vllm.lab.synthetic.kv import make_synthetic_kv


def test_deterministic_and_shaped() -> None:
    a = make_synthetic_kv(num_frames=20, tokens_per_frame=8, num_heads=3, head_dim=16, batch=2, seed=5)
    b = make_synthetic_kv(num_frames=20, tokens_per_frame=8, num_heads=3, head_dim=16, batch=2, seed=5)
    c = make_synthetic_kv(num_frames=20, tokens_per_frame=8, num_heads=3, head_dim=16, batch=2, seed=6)
    assert a.keys.shape == (2, 3, 160, 16) and a.values.shape == (2, 3, 160, 16)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert not torch.equal(a.keys, c.keys)
    assert not torch.equal(a.keys[0], a.keys[1])  # batch entries are independent draws
    assert a.num_frames == 20 and a.num_tokens == 160 and a.frame_of_token()[-1] == 19


def test_structure() -> None:
    kv = make_synthetic_kv(num_frames=40, tokens_per_frame=16, seed=1, static_fraction=0.5,
                           repeat_fraction=0.1, needle_position=0.5)
    t = kv.tokens_per_frame
    frames_k = kv.keys[0].reshape(kv.keys.shape[1], kv.num_frames, t, -1)
    for f, src in kv.repeated_frames:
        assert torch.equal(frames_k[:, f], frames_k[:, src])
    assert kv.static_scenes, "seed 1 has static scenes"
    for s in kv.static_scenes:
        frames = [f for f, sc in enumerate(kv.frame_scene) if sc == s and f not in kv.needle_frames
                  and f not in {r for r, _ in kv.repeated_frames}]
        for f in frames[1:]:
            assert torch.equal(frames_k[:, f], frames_k[:, frames[0]])
    assert kv.needle_frames == (20,)
    needle = kv.keys[0, :, kv.needle_tokens].permute(1, 0, 2).reshape(int(kv.needle_tokens.sum()), -1)
    rest = kv.keys[0, :, ~kv.needle_tokens].permute(1, 0, 2).reshape(-1, needle.shape[1])
    # The needle is far from everything else: its nearest non-needle token is far away.
    nearest = torch.cdist(needle, rest).min(-1).values
    typical = torch.cdist(rest[:200], rest).topk(2, largest=False).values[:, 1]
    assert float(nearest.min()) > 3 * float(typical.median())
    assert bool(kv.object_tokens.any())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="static_fraction"):
        make_synthetic_kv(static_fraction=1.5)
    with pytest.raises(ValueError, match="needle_position"):
        make_synthetic_kv(needle_position=1.0)
