"""The fast HF inputs of the video-QA task equal the HF processor's, and positions follow vLLM's rule."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cords_vllm.lab.vqa import FAMILIES, VideoGeometry, make_example, shipped_checkpoint  # noqa: E402
from cords_vllm.lab.vqa.hf import HFEncoder, answer_logits, fast_vision_attention, patchify  # noqa: E402
from cords_vllm.lab.vqa.positions import mrope_positions  # noqa: E402
from cords_vllm.lab.vqa.prompt import build_prompt  # noqa: E402

GEOMETRY = VideoGeometry(num_frames=8, size=56)


@pytest.fixture(scope="module")
def processor():
    return transformers.AutoProcessor.from_pretrained(shipped_checkpoint())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_encoder_matches_processor(processor, family: str) -> None:
    ex = make_example(family, 0, geometry=GEOMETRY)
    ref = processor(text=[ex.prompt], videos=[np.array(ex.frames)], return_tensors="pt")
    batch = HFEncoder(processor.tokenizer).encode([ex])
    assert torch.equal(ref["input_ids"][0], batch.input_ids[0])
    assert torch.equal(ref["video_grid_thw"], batch.video_grid_thw)
    torch.testing.assert_close(ref["pixel_values_videos"], batch.pixel_values_videos, atol=1e-5, rtol=0)
    assert int((batch.input_ids == HFEncoder(processor.tokenizer).video_pad_id).sum()) == \
        GEOMETRY.num_video_tokens


def test_encoder_matches_processor_for_frames_as_images(processor) -> None:
    """Every frame its own image: the image processor's patches and grids, the prompt with one expanded
    ``<|image_pad|>`` per frame, and vLLM's M-RoPE ids (each image its own temporal position)."""
    ex = make_example("count", 1, geometry=GEOMETRY)
    frames = [np.array(f) for f in ex.frames]
    ref = processor(text=[build_prompt(ex.question, images=len(frames))], images=frames, return_tensors="pt")
    encoder = HFEncoder(processor.tokenizer)
    batch = encoder.encode([ex], "images")
    assert batch.pixel_values_videos is None and batch.video_grid_thw is None
    assert torch.equal(ref["input_ids"][0], batch.input_ids[0])
    assert torch.equal(ref["image_grid_thw"], batch.image_grid_thw)
    torch.testing.assert_close(ref["pixel_values"], batch.pixel_values, atol=1e-5, rtol=0)
    layout = encoder.layout(ex.question, GEOMETRY, "images")
    per_image = GEOMETRY.tokens_per_patch
    pads = (batch.input_ids[0] == encoder.image_pad_id).nonzero().flatten()
    assert len(pads) == GEOMETRY.num_frames * per_image
    assert (layout.video_start, layout.video_stop) == (int(pads[0]), int(pads[-1]) + 1)
    # image k starts one past the previous image's largest position plus its two markers (end, start)
    starts = batch.position_ids[0, 0, pads[::per_image]]
    side = GEOMETRY.size // 28
    assert torch.equal(starts.diff(), torch.full((GEOMETRY.num_frames - 1,), side + 2))
    with pytest.raises(ValueError, match="inputs must be one of"):
        encoder.encode([ex], "audio")


def test_positions_follow_vllm_rule() -> None:
    pos = mrope_positions(3, (2, 2, 3), 2)
    assert pos.shape == (3, 3 + 12 + 2)
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    # video token (t, h, w) -> 3 + (t, h, w); text after the video continues at max + 1
    assert pos[:, 3].tolist() == [3, 3, 3] and pos[:, 3 + 11].tolist() == [4, 4, 5]
    assert pos[:, 15:].tolist() == [[6, 7]] * 3


def test_positions_equal_vllm_get_mrope_input_positions(processor) -> None:
    """vLLM's own ``get_mrope_input_positions`` (called with a stub for its grid iterator) gives the same ids.

    (HF transformers' ``get_rope_index`` differs after the video in 5.19: it is not the reference here, the
    engine that serves the model is.)
    """
    qwen2_vl = pytest.importorskip("vllm.model_executor.models.qwen2_vl")
    ex = make_example("colour", 1, geometry=GEOMETRY)
    batch = HFEncoder(processor.tokenizer).encode([ex])
    layout = HFEncoder(processor.tokenizer).layout(ex.question, GEOMETRY)

    class _Stub:
        def iter_mm_grid_thw(self, mm_features):
            yield (layout.video_start, *GEOMETRY.llm_grid, 1.0)

    ids = batch.input_ids[0].tolist()
    positions, _ = qwen2_vl.Qwen2VLForConditionalGeneration.get_mrope_input_positions(_Stub(), ids, [])
    assert torch.equal(positions.long(), batch.position_ids[:, 0])


def test_mixed_batch_equals_single_rows_and_fast_attention_is_exact(processor) -> None:
    config = transformers.AutoConfig.from_pretrained(shipped_checkpoint())
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).float().eval()
    encoder = HFEncoder(processor.tokenizer)
    exs = [make_example(f, 2, geometry=GEOMETRY) for f in sorted(FAMILIES)]
    batch = encoder.encode(exs)
    assert len(set(batch.last_index.tolist())) > 1  # questions of different lengths: padded rows
    with torch.no_grad():
        mixed = answer_logits(model, batch)
        single = torch.cat([answer_logits(model, encoder.encode([e])) for e in exs])
        with fast_vision_attention():
            fast = answer_logits(model, batch)
    torch.testing.assert_close(mixed, single, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed, fast, atol=1e-5, rtol=1e-5)


def test_patchify_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        patchify(np.zeros((1, 3, 56, 56, 3), np.uint8))
    with pytest.raises(ValueError):
        patchify(np.zeros((1, 2, 42, 56, 3), np.uint8))


def test_qwen2_5_vl_training_inputs_equal_the_reference_and_its_processor(tmp_path) -> None:
    """Training a Qwen2.5-VL video-QA model: the fast encoder's ids, patches and time-scaled M-RoPE positions
    (``video_t_factor``) equal the HF reference's, which takes them from the processor given the videos' fps."""
    from cords_vllm.lab.reference.hf import HFReference
    from cords_vllm.lab.vqa.hf import video_t_factor
    from cords_vllm.lab.vqa.model import build_base_model

    path = build_base_model(tmp_path, family="qwen2_5_vl")
    reference = HFReference(str(path), fps=2.0)
    assert video_t_factor(reference.config, 2.0) == 2.0 and video_t_factor(reference.config, 4.0) == 1.0
    ex = make_example("order", 2, geometry=GEOMETRY)
    encoder = HFEncoder(reference.processor.tokenizer, video_t_factor(reference.config, 2.0))
    batch = encoder.encode([ex])
    ids, _, positions, _ = reference.encode(ex.prompt, np.array(ex.frames))
    assert torch.equal(ids, batch.input_ids[0])
    assert torch.equal(positions, batch.position_ids[:, 0])
    assert int(positions[0].max()) > int(HFEncoder(reference.processor.tokenizer).encode([ex]).position_ids[0].max())
