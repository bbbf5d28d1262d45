"""Frames from the placeholder's layout (LLaVA-NeXT-Video): labels per frame, and the model facts that give them; the
labels' runs that bound a region's frames."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cords_vllm.compress.frames import frame_sizes, label_runs, layout_labels
from cords_vllm.model_facts import FRAMES_FROM_LAYOUT, ModelFacts, layout_tokens_per_frame


def test_each_frame_is_one_run_of_labels_and_labels_never_decrease():
    inputs = [(3, 10), (14, 4)]  # frames of 4 tokens: 4 + 4 + 2, then 4
    labels = layout_labels(0, 20, inputs, 4)
    assert labels.tolist() == [0, 1, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 13, 14, 14, 14, 14, 18, 19]
    assert bool((labels[1:] >= labels[:-1]).all())
    assert frame_sizes(labels, [(3, 13), (14, 18)]) == [4, 4]
    # a window of the request reads the same labels as the whole request
    assert torch.equal(layout_labels(5, 16, inputs, 4), labels[5:16])
    with pytest.raises(ValueError, match="tokens_per_frame"):
        layout_labels(0, 4, inputs, 0)


def _llava_config(image_size: int, patch_size: int, stride: int = 2) -> SimpleNamespace:
    return SimpleNamespace(model_type="llava_next_video", spatial_pool_stride=stride, video_token_id=7,
                           vision_config=SimpleNamespace(image_size=image_size, patch_size=patch_size))


def test_llava_next_video_facts_find_frames_from_the_layout():
    facts = ModelFacts.from_hf_config(_llava_config(336, 14), uses_mrope=False)  # LLaVA-NeXT-Video-7B
    assert facts.frames_from == FRAMES_FROM_LAYOUT and facts.tokens_per_frame == 144 and facts.finds_frames
    assert facts.rebases_streams and not facts.explicit_positions and facts.placeholder_token_ids == {"video": 7}
    assert layout_tokens_per_frame(_llava_config(80, 8)) == 25
    assert layout_tokens_per_frame(_llava_config(84, 14)) == 9  # ceil(6 / 2) ** 2, as vLLM counts
    assert layout_tokens_per_frame(SimpleNamespace(model_type="llama")) is None
    assert not ModelFacts.from_hf_config(SimpleNamespace(model_type="llama"), uses_mrope=False).finds_frames


def _frames(labels: torch.Tensor) -> int:
    """Frames (runs of equal labels) of a sequence of candidates, as the compress step counts its units."""
    return 0 if labels.numel() == 0 else 1 + int((labels[1:] != labels[:-1]).sum())


@pytest.mark.parametrize("seed", range(20))
def test_label_runs_bound_the_frames_of_any_candidates_of_a_region_of_two_parts(seed):
    """What the fused step's host sizes a frame compression by (``_frames_bound``): the runs of the held rows' labels
    plus the entering rows', each among their video rows, bound the frames of any subsequence of the region's video
    rows (its candidates), whatever the labels' order; text rows (each at its own temporal position) add none."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(2):  # held rows, then entering rows
        n = int(torch.randint(0, 40, (1,), generator=g))
        parts.append((torch.randint(0, 6, (n,), generator=g), torch.rand(n, generator=g) < 0.8))
    labels, video = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    bound = sum(label_runs(lab, vid) for lab, vid in parts)
    for _ in range(10):
        candidates = video & (torch.rand(labels.shape[0], generator=g) < 0.7)
        assert _frames(labels[candidates]) <= bound
    assert label_runs(torch.arange(5), torch.zeros(5, dtype=torch.bool)) == 0  # text alone
    assert label_runs(torch.tensor([3, 3, 9, 4, 4, 5]), torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)) == 3
