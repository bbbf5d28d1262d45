"""The per-push rules on a push's headers (:mod:`...streams.push_bounds`) and the API server's decoded-bytes budget
(:mod:`...streams.decode_budget`), against brute force: the largest count a refusal names is the largest that
passes, and a budget never holds more than its capacity however many pushes ask at once."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from cords_vllm.integration.api_server.streams.decode_budget import DecodeBudget
from cords_vllm.integration.api_server.streams.frames import FrameError, PushMedia
from cords_vllm.integration.api_server.streams.push_bounds import PushBounds

FACTOR, MAX_RATIO = 28, 200


def qwen2_vl_tokens(width: int, height: int, frames: int, max_pixels: int = 448 * 448) -> int:
    """Qwen2-VL's video tokens with its ``smart_resize`` rule (refusing an aspect ratio of 200 or more)."""
    if max(width, height) / min(width, height) > MAX_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_RATIO}")
    h, w = max(FACTOR, round(height / FACTOR) * FACTOR), max(FACTOR, round(width / FACTOR) * FACTOR)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / FACTOR) * FACTOR, math.floor(width / beta / FACTOR) * FACTOR
    return math.ceil(frames / 2) * (h // 14) * (w // 14) // 4


def media(count: int, width: int, height: int) -> PushMedia:
    return PushMedia("frames", count, width, height, images=tuple((b"", f"frames[{i}]") for i in range(count)))


def passes(bounds: PushBounds, push: PushMedia, held: int = 0) -> bool:
    try:
        bounds.check(push, held)
    except FrameError:
        return False
    return True


def test_a_frame_shape_the_processor_refuses_names_the_frame():
    bounds = PushBounds(1 << 30, max_clip_tokens=2048, video_tokens=qwen2_vl_tokens)
    for count in (1, 2):
        with pytest.raises(FrameError) as refused:
            bounds.check(media(count, 5880, 28))
        assert (refused.value.status, refused.value.field) == (400, "frames[0]")
        assert "aspect ratio" in str(refused.value)
    with pytest.raises(FrameError) as clip:
        bounds.check(PushMedia("video", 4, 5880, 28, clip=("video/mp4", b"")))
    assert clip.value.field == "video"
    assert bounds.largest_push(5880, 28) is None
    bounds.check(media(2, 5600, 28))  # a ratio of exactly 200 is allowed


@pytest.mark.parametrize("seed", range(6))
def test_the_largest_count_a_refusal_names_is_the_largest_that_passes(seed):
    rng = random.Random(seed)
    for _ in range(20):
        width, height = rng.randint(28, 1920), rng.randint(28, 1080)
        if max(width, height) / min(width, height) > MAX_RATIO:
            continue
        bounds = PushBounds(rng.choice([1 << 20, 16 << 20, 256 << 20]), max_clip_tokens=rng.choice([512, 2048]),
                            video_tokens=qwen2_vl_tokens)
        held = rng.choice([0, 1])
        brute = max(n for n in range(0, 600) if n == 0 or passes(bounds, media(n, width, height), held))
        assert bounds.largest_push(width, height, held) == brute, (width, height, held)
        if brute < 599:
            with pytest.raises(FrameError) as refused:
                bounds.check(media(brute + 1, width, height), held)
            assert refused.value.status == 413 and refused.value.field == "frames"
            assert f"at most {brute} frames of this size" in str(refused.value)


def test_decoded_bytes_alone_bound_a_push_without_a_model():
    bounds = PushBounds(100 * 100 * 3 * 5)
    bounds.check(media(5, 100, 100))
    with pytest.raises(FrameError, match="at most 5 frames"):
        bounds.check(media(6, 100, 100))
    assert bounds.largest_push(100, 100) == 5


def test_a_budget_never_holds_more_than_its_capacity():
    budget = DecodeBudget(100)
    sizes = [random.Random(i).randint(1, 100) for i in range(40)]

    async def push(nbytes: int) -> None:
        async with budget.reserve(nbytes):
            assert budget.used <= budget.capacity
            await asyncio.sleep(0.001)

    async def run() -> None:
        await asyncio.gather(*(push(n) for n in sizes))

    asyncio.run(run())
    assert budget.used == 0 and max(sizes) <= budget.peak <= 100
    with pytest.raises(ValueError, match="can never fit"):
        asyncio.run(push(101))


def test_a_waiting_push_runs_once_room_is_given_back():
    budget = DecodeBudget(10)
    order: list[str] = []

    async def hold(name: str, nbytes: int, seconds: float) -> None:
        async with budget.reserve(nbytes):
            order.append(name)
            await asyncio.sleep(seconds)

    async def run() -> None:
        first = asyncio.create_task(hold("first", 8, 0.05))
        await asyncio.sleep(0.01)
        await asyncio.gather(hold("second", 5, 0), first)

    asyncio.run(run())
    assert order == ["first", "second"] and budget.peak == 8
