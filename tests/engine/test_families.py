"""Every supported Qwen-VL family keeps the model's math under compression: Qwen2.5-VL and Qwen3-VL.

Tiny fp32 checkpoints of each real architecture (built here, no download) run in the engine and in the HF
reference (:class:`~cords_vllm.lab.reference.hf.HFReference`, positions as vLLM counts them: Qwen2.5-VL's
temporal positions follow absolute time, Qwen3-VL writes each frame's timestamp as text between frames and adds
deepstack features to its first layers). The reference drops exactly the tokens the engine's workers dropped at
the same points and must agree to fp32 rounding, one-shot and over a live stream; a reference without the
evictions must not. Frame granularity keeps or drops whole frames, found from each family's M-RoPE temporal
positions, and only video (or image) tokens and their markers are ever evicted: Qwen3-VL's timestamps stay.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_model
from tests.engine.conftest import (
    BLOCK,
    VIDEO_PROMPT,
    assert_exact_with_control,
    chunks_for,
    evictions_of,
    run_engine,
    run_session,
    video,
)
from tests.engine.test_exactness import TOL, _compare

pytestmark = pytest.mark.engine

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
FPS = 2.0


def clip(frames: np.ndarray, fps: float = FPS) -> tuple[np.ndarray, dict]:
    """A decoded video as the engine takes it: frames plus their metadata (Qwen2.5-VL and Qwen3-VL need it:
    temporal positions and timestamps follow the frames' times)."""
    n = len(frames)
    return frames, {"fps": fps, "duration": n / fps, "total_num_frames": n, "frames_indices": list(range(n)),
                    "video_backend": "opencv", "do_sample_frames": False}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """``(family, checkpoint, HF reference)`` of each family, fp32."""
    from cords_vllm.lab.reference.hf import HFReference

    path = str(build_tiny_model(TinyModelSpec(family=request.param, dtype="float32")))
    yield request.param, path, HFReference(path, fps=FPS)
    settle()


def _dropped(ids: torch.Tensor, events) -> set[int]:
    """Logical ids some compression dropped (from any layer or head)."""
    dropped: set[int] = set()
    for event in events:
        for keep in event.kept_logical:
            dropped |= set(range(event.at_token)) - set(keep.flatten().tolist())
    return dropped


@pytest.mark.parametrize("granularity", ["frame", "token"])
def test_compressed_engine_equals_the_hf_reference(family, granularity):
    name, path, reference = family
    frames = video(48)
    run = run_engine(path, [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": clip(frames)}}], "cords",
                     max_tokens=6, budget=256, slack=64, granularity=granularity)
    assert len(run.events) >= 2, "the prompt must be compressed at least twice"
    assert_exact_with_control(run, reference, VIDEO_PROMPT, frames, TOL)

    ids = reference.encode(VIDEO_PROMPT, frames)[0]
    assert ids.numel() == run.prompt_lens[0]
    cfg = reference.config
    markers = {cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    dropped = _dropped(ids, run.events)
    assert dropped and {int(ids[i]) for i in dropped} <= markers, "only video tokens and their markers are evicted"
    if name == "qwen3_vl":  # text between the frames (each one's timestamp) is there, and never evicted
        pad = ids == cfg.video_token_id
        first, last = pad.nonzero()[[0, -1], 0].tolist()
        between = [i for i in range(first, last) if int(ids[i]) not in markers]
        assert len(between) >= 2 * 23 and not set(between) & dropped
    if granularity == "frame":
        # frames found independently: runs of pads, cut into temporal patches (h*w tokens each); a frame is
        # kept or dropped whole, but for at most one per compression (the last one chosen is cut to the count)
        pad = (ids == cfg.video_token_id).numpy()
        per_frame = _tokens_per_frame(reference)
        starts = [i for i in range(len(pad)) if pad[i] and (i == 0 or not pad[i - 1])]
        frame_sets = [set(range(s + k, s + k + per_frame)) for s in starts
                      for k in range(0, int(np.argmin(np.r_[pad[s:], False])), per_frame)]
        assert len(frame_sets) == 24, "48 frames are 24 temporal patches"
        for n, event in enumerate(sorted(run.events, key=lambda e: e.at_token), start=1):
            kept = set(event.kept_logical[0].flatten().tolist())
            partial = [f for f in frame_sets if max(f) < event.at_token and 0 < len(f & kept) < len(f)]
            assert len(partial) <= n, f"{len(partial)} frames partly kept at token {event.at_token}"


def _tokens_per_frame(reference) -> int:
    """Language-model tokens of one temporal patch of the 224x224 test video in this family."""
    patch = reference.config.vision_config.patch_size * reference.config.vision_config.spatial_merge_size
    return (224 // patch) ** 2


def test_frames_sent_as_images_are_compressed_and_exact(family):
    _, path, reference = family
    images = [Image.fromarray(f) for f in video(12)]
    prompt = ("<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>" * len(images)
              + "What color was the square?<|im_end|>\n<|im_start|>assistant\n")
    run = run_engine(path, [{"prompt": prompt, "multi_modal_data": {"image": images}}], "cords", max_tokens=6,
                     engine_kwargs={"limit_mm_per_prompt": {"image": 16, "video": 1}}, budget=192, slack=64)
    assert len(run.events) >= 2
    evictions = evictions_of(run.events)
    ref = reference.run(prompt, images=images, max_new_tokens=6, chunk_sizes=chunks_for(run.prompt_lens[0], evictions),
                        evictions=evictions, forced_tokens=run.token_ids[0])
    assert _compare(run, ref) < TOL


def test_a_live_stream_is_compressed_across_turns_and_equals_the_reference(family, make_llm):
    """A stream of 8 clips, re-based as it goes: its answer equals the HF reference over the whole stream that
    drops the same tokens at the same points, and closing it returns every block."""
    _, path, reference = family
    llm = make_llm(path, block_size=BLOCK, max_num_batched_tokens=4096, max_num_scheduled_tokens=256,
                   limit_mm_per_prompt={"image": 0, "video": 8}, **kv_policy_args("cords", budget=192, slack=64))
    clips = [video(4, seed=100 + i) for i in range(8)]
    texts = ["<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>"]
    texts += ["<|vision_start|><|video_pad|><|vision_end|>"] * 7
    question = "What color was the square?<|im_end|>\n<|im_start|>assistant\n"
    turns = [{"prompt": t, "multi_modal_data": {"video": clip(f)}} for t, f in zip(texts, clips, strict=True)]
    run = run_session(llm, [*turns, {"prompt": question}])
    answer, events = run.answer, run.events
    assert run.free_after == run.free_before
    assert run.held.evicted_tokens > 0, "the stream was re-based: evicted tokens left its request"
    del llm
    evictions = evictions_of(events)
    assert len(evictions) >= 3
    prompt = "".join(texts) + question
    length = int(reference.encode(prompt, clips)[0].numel())
    ref = reference.run(prompt, clips, max_new_tokens=1, chunk_sizes=chunks_for(length, evictions),
                        evictions=evictions)
    assert ref.token_ids == answer
