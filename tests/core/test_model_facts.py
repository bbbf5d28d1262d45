"""Model facts read from a real HF config: the tiny Qwen2-VL's placeholders, markers and temporal patch."""

from __future__ import annotations

from transformers import AutoConfig

from cords_vllm.model_facts import FRAMES_FROM_MROPE, ModelFacts


def test_qwen2_vl_facts_come_from_its_config(tiny_model):
    config = AutoConfig.from_pretrained(tiny_model)
    facts = ModelFacts.from_hf_config(config, uses_mrope=True)
    assert facts.model_type == "qwen2_vl"
    assert facts.placeholder_token_ids == {"image": config.image_token_id, "video": config.video_token_id}
    assert facts.vision_markers == {config.vision_start_token_id, config.vision_end_token_id}
    assert facts.temporal_patch_size == config.vision_config.temporal_patch_size == 2
    assert facts.frames_per_patch == 2 and ModelFacts(temporal_patch_size=4).frames_per_patch == 4
    assert ModelFacts().frames_per_patch == 2  # no temporal patch named (LLaVA-NeXT-Video): a live stream's 2
    assert facts.frames_from == FRAMES_FROM_MROPE and facts.finds_frames
    assert facts.candidate_token_ids(("video",)) == {config.video_token_id, *facts.vision_markers}
    assert facts.candidate_token_ids(("image", "video")) >= {config.image_token_id, config.video_token_id}


def test_a_model_without_positions_to_find_frames_in_says_so():
    class Plain:
        model_type = "llama"

    facts = ModelFacts.from_hf_config(Plain(), uses_mrope=False)
    assert not facts.finds_frames and facts.placeholder_token_ids == {} and facts.vision_markers == frozenset()
    assert facts.candidate_token_ids(("video",)) == frozenset()
