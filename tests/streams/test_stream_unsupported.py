"""Which models the stream API writes turns for, and the 501 it answers for the others.

A stream's turns are written in the served family's chat markup: the Qwen-VL families' ChatML (found by their
vision markers) or LLaVA-NeXT-Video's ``USER: <video>\\n... ASSISTANT:``; LLaVA-NeXT-Video streams are served
(over HTTP: ``tests/streams/test_stream_families.py``). A model with no known markup or no video placeholder (a
text-only Llama, an image-only LLaVA-NeXT) is still served one-shot, while ``POST /v1/streams`` answers 501
saying why: checked here on the route itself, in process (no engine is needed to refuse).
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlavaNextConfig, LlavaNextVideoConfig, Qwen2VLConfig

from cords_vllm.conversation.transcript import CHATML, LLAVA
from cords_vllm.model_facts import ModelFacts


def _facts(config, uses_mrope: bool = False) -> ModelFacts:
    return ModelFacts.from_hf_config(config, uses_mrope=uses_mrope)


def test_each_family_gets_its_chat_markup_and_the_others_none():
    qwen = _facts(Qwen2VLConfig(vision_start_token_id=1, vision_end_token_id=2, video_token_id=3, image_token_id=4),
                  uses_mrope=True)
    llava = _facts(LlavaNextVideoConfig())
    assert (qwen.chat_markup, qwen.streams_unsupported) == (CHATML, None)
    assert (llava.chat_markup, llava.streams_unsupported) == (LLAVA, None)
    assert llava.rebases_streams and not llava.explicit_positions, "1-D positions: re-based with an offset"
    # negative controls: no video placeholder (text only), or an image-only LLaVA-NeXT
    for other in (_facts(LlamaConfig()), _facts(LlavaNextConfig())):
        assert other.chat_markup is None
        assert "chat markup" in other.streams_unsupported and "/v1/chat/completions" in other.streams_unsupported


@pytest.mark.parametrize("config", [LlamaConfig(), LlavaNextVideoConfig()], ids=["text-only", "llava-next-video"])
def test_open_answers_501_only_for_a_model_without_a_chat_markup(config):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from cords_vllm.integration.api_server.streams.api import STATE_KEY, APIError, router
    from cords_vllm.integration.api_server.streams.registry import StreamLimits, StreamRegistry

    facts = _facts(config)
    app = FastAPI()
    app.include_router(router)
    app.add_exception_handler(APIError, lambda _request, exc: exc.response())
    registry = StreamRegistry(engine=None, limits=StreamLimits())
    registry.unsupported, registry.markup = facts.streams_unsupported, facts.chat_markup
    setattr(app.state, STATE_KEY, registry)
    answer = TestClient(app).post("/v1/streams", json={})
    if facts.chat_markup is None:
        assert answer.status_code == 501
        error = answer.json()["error"]
        assert error["type"] == "NotImplementedError" and error["message"] == facts.streams_unsupported
        assert not registry.streams
    else:  # the stream is opened (nothing reaches an engine before its first push), in the family's markup
        assert answer.status_code == 201, answer.text
        (stream,) = registry.streams.values()
        assert stream.transcript.clip() == "USER: <video>\n"
