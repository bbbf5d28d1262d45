"""Frames from the placeholder's layout (LLaVA-NeXT-Video): labels per frame, and the model facts that give them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cords_vllm.compress.frames import frame_sizes, layout_labels
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
