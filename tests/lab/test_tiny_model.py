import json

import pytest

from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_qwen2vl


def test_geometry_is_a_parameter_and_builds_are_cached(tmp_path):
    spec = TinyModelSpec(num_layers=2, num_kv_heads=1, num_heads=2, head_dim=32, vocab_size=2000,
                         tokenizer_vocab=1700)
    path = build_tiny_qwen2vl(spec, cache_dir=tmp_path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["num_hidden_layers"] == 2
    assert text["num_key_value_heads"] == 1
    assert text["hidden_size"] // text["num_attention_heads"] == 32
    assert text["vocab_size"] == 2000
    assert sum(text["rope_parameters"]["mrope_section"]) == 16
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_qwen2vl(spec, cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert build_tiny_qwen2vl(TinyModelSpec(num_layers=3, num_heads=2, num_kv_heads=1, head_dim=32,
                                            vocab_size=2000, tokenizer_vocab=1700),
                              cache_dir=tmp_path) != path


def test_build_is_deterministic(tmp_path):
    spec = TinyModelSpec(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, vocab_size=2000,
                         tokenizer_vocab=1700)
    a = build_tiny_qwen2vl(spec, cache_dir=tmp_path / "a")
    b = build_tiny_qwen2vl(spec, cache_dir=tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tokenizer_and_config_agree(tiny_model):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = AutoConfig.from_pretrained(tiny_model)
    assert tok.convert_tokens_to_ids("<|video_pad|>") == cfg.video_token_id
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg.vision_start_token_id
    assert len(tok) <= cfg.text_config.vocab_size


@pytest.mark.parametrize("kwargs", [{"head_dim": 40}, {"num_heads": 3}, {"num_layers": 0},
                                    {"vocab_size": 100}, {"dtype": "float16"}, {"family": "llama"}])
def test_bad_spec_is_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        TinyModelSpec(**kwargs)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_each_family_builds_its_real_architecture(tmp_path, family):
    from transformers import AutoConfig, AutoProcessor

    from cords_vllm.lab.synthetic import build_tiny_model

    spec = TinyModelSpec(family=family, num_layers=1, dtype="float32")
    path = build_tiny_model(spec, cache_dir=tmp_path)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == family
    assert path.name.startswith(f"tiny-{family.replace('_', '')}-")
    assert TinyModelSpec(family=family).cache_key() != TinyModelSpec().cache_key()
    processor = AutoProcessor.from_pretrained(path)
    assert processor.tokenizer.convert_tokens_to_ids("<|video_pad|>") == config.video_token_id
