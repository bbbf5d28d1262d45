"""The stream API's pure parts: turn texts, frame decoding, per-stream overrides, and when the routes exist."""

from __future__ import annotations

import argparse
import base64

import numpy as np
import pytest

from cords_vllm.client import encode_frame, frame_data_url
from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError
from cords_vllm.conversation.transcript import ASSISTANT, END, SYSTEM, USER, VIDEO, Transcript
from cords_vllm.integration.api_server.streams.frames import (
    FrameError,
    decode_clip,
    decode_image,
    parse_data_url,
    stack_frames,
)
from cords_vllm.lab.vqa.prompt import build_prompt


def test_a_stream_with_one_clip_and_a_question_is_the_one_shot_prompt():
    t = Transcript()
    text = t.clip() + t.question("What color was the square?")
    assert text == build_prompt("What color was the square?")


def test_turns_after_an_answer_close_it_first():
    t = Transcript()
    assert t.clip() == SYSTEM + USER + VIDEO
    assert t.clip() == VIDEO
    assert t.question("q1") == "q1" + END + ASSISTANT
    assert t.question("q2") == END + USER + "q2" + END + ASSISTANT  # the engine discarded the answer's end token
    assert t.clip() == END + USER + VIDEO


def test_frames_decode_from_jpeg_and_png_data_urls():
    frame = (np.arange(32 * 48 * 3) % 251).astype(np.uint8).reshape(32, 48, 3)
    for fmt in ("png", "jpeg"):
        media, data = parse_data_url(frame_data_url(frame, fmt), "frames[0]", ("image/png", "image/jpeg"))
        decoded = decode_image(data, "frames[0]")
        assert decoded.shape == (32, 48, 3) and media == f"image/{fmt}"
    assert np.array_equal(decode_image(encode_frame(frame, "png"), "f"), frame)  # PNG is lossless


def test_a_jpeg_frame_list_clip_decodes_every_frame():
    frames = np.zeros((3, 28, 28, 3), np.uint8)
    payload = ",".join(base64.b64encode(encode_frame(f)).decode() for f in frames)
    media, data = parse_data_url(f"data:video/jpeg;base64,{payload}", "video", ("video/jpeg",))
    assert decode_clip(media, data, "video").shape == (3, 28, 28, 3)


@pytest.mark.parametrize(("url", "field_message"), [
    ("http://example.com/a.png", "data URL"),
    ("data:image/png,abc", "base64"),
    ("data:image/bmp;base64,AAAA", "not supported"),
    ("data:image/png;base64,!!!!", "valid base64"),
])
def test_bad_data_urls_name_the_field(url, field_message):
    with pytest.raises(FrameError) as err:
        parse_data_url(url, "frames[2]", ("image/png", "image/jpeg"))
    assert err.value.field == "frames[2]" and field_message in err.value.message


def test_frames_of_one_push_share_a_size():
    with pytest.raises(FrameError) as err:
        stack_frames([np.zeros((28, 28, 3), np.uint8), np.zeros((56, 28, 3), np.uint8)], "frames")
    assert err.value.field == "frames[1]"
    with pytest.raises(FrameError):
        decode_image(b"not an image", "frames[0]")


def test_overrides_may_only_narrow_the_servers_policy():
    server = KVPolicyConfig.parse("cords", {"budget": 256, "recent": 64})
    narrowed = server.narrowed({"budget": 128})
    assert (narrowed.budget, narrowed.recent) == (128, 64)
    assert server.narrowed({"budget": 32}).recent == 31  # recent stays below budget
    assert server.narrowed(None) is server
    for bad, key in [({"budget": 512}, "budget"), ({"recent": 128}, "recent"), ({"budget": 0}, "budget"),
                     ({"budget": 64, "recent": 64}, "recent"), ({"slack": 1}, "slack"), ({"budget": "x"}, "budget")]:
        with pytest.raises(KVPolicyConfigError) as err:
            server.narrowed(bad)
        assert err.value.key == key


@pytest.mark.parametrize(("argv", "on"), [
    ([], False), (["--kv-policy", "none"], True), (["--kv-policy", "cords"], True),
    (["--kv-policy", "cords", "--no-kv-streams"], False), (["--kv-streams"], True),
])
def test_the_stream_routes_exist_exactly_when_switched_on(argv, on):
    """Through vLLM's own ``build_app`` path: the patched plugin attachment adds the routes (and the OpenAPI
    entries) when ``--kv-policy`` or ``--kv-streams`` says so."""
    from fastapi import FastAPI
    from vllm.engine.arg_utils import EngineArgs

    import cords_vllm.plugin

    cords_vllm.plugin.register()
    from vllm.entrypoints.launchers import app as app_module

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    app = FastAPI()
    app.state.args = parser.parse_args(argv)
    app_module.attach_endpoint_plugins(app, ("generate",))
    paths = {getattr(r, "path", None) for r in app.routes}
    assert ("/v1/streams/{stream_id}/ask" in paths) == on
    assert ("/v1/streams" in app.openapi()["paths"]) == on


def _registry(policy: str, config: dict | None, pool_blocks: int, max_streams: int = 64):
    from cords_vllm.integration.api_server.streams.registry import StreamLimits, StreamRegistry

    return StreamRegistry(engine=None, limits=StreamLimits(max_streams=max_streams),
                          policy=KVPolicyConfig.parse(policy, config), block_size=32, pool_blocks=pool_blocks,
                          max_model_len=4096)


def test_streams_are_admitted_while_their_footprints_fit_the_pool():
    """Opening a stream touches no engine; admission is pure bookkeeping over footprints."""
    from cords_vllm.compress.plan import BudgetSettings, stream_footprint_blocks
    from cords_vllm.integration.api_server.streams.registry import TooManyStreams

    config = {"budget": 256, "recent": 64, "slack": 64, "max_text_tokens": 128}
    reg = _registry("cords", config, pool_blocks=60)
    footprint = stream_footprint_blocks(128, BudgetSettings(256, 64, 64), 32)
    assert reg.footprint_blocks() == footprint == 16
    assert reg.capacity()["max_streams"] == 60 // footprint == 3
    opened = [reg.open() for _ in range(3)]
    with pytest.raises(TooManyStreams, match="KV pool"):
        reg.open()
    small = reg.footprint_blocks({"budget": 64, "recent": 16})
    assert small < footprint and 3 * footprint + small <= 60
    reg.open(overrides={"budget": 64, "recent": 16})  # a narrower stream still fits
    opened[0].ended = "closed"  # an ended stream commits nothing
    assert reg.committed_blocks() == 2 * footprint + small


def test_under_none_a_stream_is_admitted_as_a_max_model_len_request():
    from cords_vllm.integration.api_server.streams.registry import TooManyStreams

    reg = _registry("none", None, pool_blocks=300)
    assert reg.footprint_blocks() == 4096 // 32
    reg.open()
    reg.open()
    with pytest.raises(TooManyStreams):
        reg.open()


def test_the_cap_on_open_streams_applies_first():
    from cords_vllm.integration.api_server.streams.registry import TooManyStreams

    reg = _registry("cords", {"budget": 64, "max_text_tokens": 64}, pool_blocks=1000, max_streams=2)
    reg.open()
    reg.open()
    with pytest.raises(TooManyStreams, match="--kv-stream-max-open"):
        reg.open()


def test_frames_may_be_openai_image_parts():
    from cords_vllm.integration.api_server.streams.frames import FrameLimits, decode_push, read_push

    limits = FrameLimits(max_frames=8, max_pixels=0)
    url = frame_data_url(np.full((56, 56, 3), 200, np.uint8), "png")
    media = read_push([{"type": "image_url", "image_url": {"url": url}}, url], None, limits)
    assert (media.count, media.width, media.height, media.decoded_bytes) == (2, 56, 56, 2 * 56 * 56 * 3)
    frames = decode_push(media)
    assert frames.shape == (2, 56, 56, 3) and int(frames[1, 0, 0, 0]) == 200
    with pytest.raises(FrameError) as err:
        read_push([url, {"type": "image_url", "image_url": {}}], None, limits)
    assert err.value.field == "frames[1]"


def test_llava_turns_are_its_chat_template_and_count_their_text():
    """LLaVA-NeXT-Video's stream turns concatenate to what the checkpoint's chat template renders for the same
    conversation (clips, a question, an answer, more clips, a question), and the protected-token count of a turn
    leaves out its ``<video>`` placeholders only (the engine's candidates); ChatML turns do not match (control)."""
    from transformers import AutoProcessor

    from cords_vllm.conversation.text_budget import protected_token_counter
    from cords_vllm.conversation.transcript import CHATML, LLAVA
    from cords_vllm.lab.synthetic.tiny_llava import VIDEO_TOKEN, build_tiny_llava_next_video

    processor = AutoProcessor.from_pretrained(str(build_tiny_llava_next_video()))
    video, answer = {"type": "video"}, "It was red."
    messages = [{"role": "user", "content": [video, video, {"type": "text", "text": "q1?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                {"role": "user", "content": [video, {"type": "text", "text": "q2?"}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True)

    def stream_text(markup) -> str:
        t = Transcript(markup)
        # the engine keeps the answer it generated after "ASSISTANT:" (its end token discarded)
        return t.clip() + t.clip() + t.question("q1?") + " " + answer + t.clip() + t.question("q2?")

    assert stream_text(LLAVA) == rendered
    assert stream_text(CHATML) != rendered
    tokenizer = processor.tokenizer
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    count = protected_token_counter(encode, [tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)])
    t = Transcript(LLAVA)
    assert count(t.clip()) == len(encode("USER: ")) + len(encode("\n")) and count(t.clip()) == len(encode("\n"))
