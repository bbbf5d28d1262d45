"""Frames sent as images are candidates: each image is one frame, text stays protected, the math is kept.

Clients such as lmms-eval and VLMEvalKit decode a video themselves and send its frames as images. With the
default ``modalities`` (image and video) those prompts are compressed like a video, and a prompt that mixes
text, images and videos is one stream of frames in prompt order. The HF reference, fed the same images and
video and dropping the logical tokens the engine's workers dropped at the same points, must agree with the
compressed engine; only image and video tokens (and their vision markers) may ever be evicted.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.engine.conftest import chunks_for, evictions_of, run_engine, video
from tests.engine.test_exactness import TOL, _compare

pytestmark = pytest.mark.engine

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
QUESTION = "What color was the square?<|im_end|>\n<|im_start|>assistant\n"
MANY_IMAGES = {"limit_mm_per_prompt": {"image": 16, "video": 1}}


def _frames_as_images(count: int, seed: int = 3) -> list[Image.Image]:
    """``count`` 224x224 frames of a synthetic video, as PIL images (64 tokens each after merging)."""
    return [Image.fromarray(f) for f in video(count, seed=seed)]


def _evicted_token_ids(prompt_ids: torch.Tensor, events) -> set[int]:
    """Token ids of every logical token some compression dropped (from any layer or head)."""
    dropped: set[int] = set()
    for event in events:
        for keep in event.kept_logical:
            held = set(range(event.at_token))
            dropped |= held - set(keep.flatten().tolist())
    return {int(prompt_ids[i]) for i in dropped}


def _check_against_reference(model, hf_reference, prompt: str, images, frames=None, **config):
    mm = {"image": images} | ({"video": frames} if frames is not None else {})
    run = run_engine(model, [{"prompt": prompt, "multi_modal_data": mm}], "cords", max_tokens=6,
                     engine_kwargs=MANY_IMAGES, **{"budget": 256, "slack": 64, **config})
    evictions = evictions_of(run.events)
    ref = hf_reference.run(prompt, frames, images=images, max_new_tokens=6,
                           chunk_sizes=chunks_for(run.prompt_lens[0], evictions), evictions=evictions,
                           forced_tokens=run.token_ids[0])
    assert _compare(run, ref) < TOL
    ids = hf_reference.encode(prompt, frames, images=images)[0]
    assert ids.numel() == run.prompt_lens[0]
    return run, ids


def test_images_are_compressed_like_frames(tiny_model, hf_reference):
    images = _frames_as_images(12)
    prompt = "<|im_start|>user\n" + IMAGE * len(images) + QUESTION
    run, ids = _check_against_reference(tiny_model, hf_reference, prompt, images, granularity="frame")
    assert len(run.events) >= 2, "12 images of 64 tokens against a budget of 256 must compress at least twice"
    vocab = hf_reference.config
    allowed = {vocab.image_token_id, vocab.vision_start_token_id, vocab.vision_end_token_id}
    assert _evicted_token_ids(ids, run.events) <= allowed
    # frame granularity: an image is kept or dropped whole (its 64 tokens share one M-RoPE time), but for at
    # most one per compression: the last frame chosen is cut to the exact count of kept tokens
    image_runs = [set(range(s, s + 64)) for s in range(len(ids)) if int(ids[s]) == vocab.image_token_id
                  and (s == 0 or int(ids[s - 1]) != vocab.image_token_id)]
    for n, event in enumerate(sorted(run.events, key=lambda e: e.at_token), start=1):
        kept = set(event.kept_logical[0].flatten().tolist())
        partial = [r for r in image_runs if max(r) < event.at_token and 0 < len(r & kept) < len(r)]
        assert len(partial) <= n, f"{len(partial)} images partly kept at token {event.at_token}"


def test_mixed_text_images_and_video_keep_text(tiny_model, hf_reference):
    images = _frames_as_images(4, seed=5)
    frames = video(16, seed=7)
    prompt = ("<|im_start|>user\nFirst look at these.\n" + IMAGE * 2 + "Then the clip:\n" + VIDEO
              + "And these two.\n" + IMAGE * 2 + QUESTION)
    run, ids = _check_against_reference(tiny_model, hf_reference, prompt, images, frames)
    assert len(run.events) >= 1
    vocab = hf_reference.config
    evicted = _evicted_token_ids(ids, run.events)
    assert vocab.image_token_id in evicted and vocab.video_token_id in evicted
    assert evicted <= {vocab.image_token_id, vocab.video_token_id, vocab.vision_start_token_id,
                       vocab.vision_end_token_id}


def test_modalities_video_only_protects_images(tiny_model, hf_reference):
    images = _frames_as_images(4, seed=5)
    frames = video(16, seed=7)
    prompt = "<|im_start|>user\n" + IMAGE * 2 + VIDEO + IMAGE * 2 + QUESTION
    run, ids = _check_against_reference(tiny_model, hf_reference, prompt, images, frames,
                                        modalities=["video"], budget=128, slack=32)
    assert len(run.events) >= 1
    vocab = hf_reference.config
    evicted = _evicted_token_ids(ids, run.events)
    assert vocab.image_token_id not in evicted and vocab.video_token_id in evicted
