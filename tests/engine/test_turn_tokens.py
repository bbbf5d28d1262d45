"""A stream turn's token count, taken in the API server before the turn is sent, equals the engine's.

The count decides the 413 for a push too long for ``--max-model-len`` on its own (a turn one token over would
otherwise reach the engine and end the stream). Checked per family against the prompt length vLLM's own
processing gives the same turn, for clips late in a stream (Qwen3-VL writes each frame's time since the stream
opened as text: ``<83.5 seconds>`` is longer than ``<1.5 seconds>``). Negative control: without the frame text,
Qwen3-VL's count is short.
"""

from __future__ import annotations

import pytest

from cords_vllm.conversation.transcript import Transcript
from cords_vllm.integration.api_server.streams.live import clip_input
from cords_vllm.integration.api_server.streams.turn_tokens import turn_counter, video_processing
from cords_vllm.integration.engine_facts import model_facts_of
from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.integration.inprocess.llm import make_llm
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_model
from tests.engine.conftest import video

pytestmark = pytest.mark.engine

FPS = 2.0


@pytest.fixture(scope="module", params=["qwen2_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.slow), "qwen3_vl"])
def engine(request, tiny_model):
    path = tiny_model if request.param == "qwen2_vl" else str(
        build_tiny_model(TinyModelSpec(family=request.param, dtype="float32")))
    llm = make_llm(path)  # fp32, no policy
    yield request.param, llm
    del llm
    settle()


def _engine_tokens(llm, prompt: str, clip) -> int:
    from vllm import SamplingParams

    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"video": clip}}], SamplingParams(max_tokens=1),
                       use_tqdm=False)
    return len(out[0].prompt_token_ids)


@pytest.mark.parametrize(("frames", "first"), [(8, 0), (6, 166), (12, 2000)])
def test_a_turns_count_is_the_engines(engine, frames, first):
    family, llm = engine
    tokenizer = llm.get_tokenizer()
    vllm_config = llm.llm_engine.vllm_config
    count = turn_counter(lambda t: tokenizer.encode(t, add_special_tokens=False), model_facts_of(vllm_config),
                         video_processing(vllm_config), tokenizer)
    assert count is not None
    transcript = Transcript()
    prompt = transcript.clip() + transcript.question("What color was the square?")
    clip, metadata = clip_input(video(frames), FPS, first)
    tokens, video_tokens = count(prompt, clip, metadata)
    assert tokens == _engine_tokens(llm, prompt, (clip, metadata))
    assert video_tokens > 0
    if family == "qwen3_vl":  # the control: the clip's frame times are text the engine counts
        assert count(prompt, clip, None)[0] < tokens
