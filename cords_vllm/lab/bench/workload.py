"""Benchmark workloads: concurrent requests, each a synthetic video plus a short question."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cords_vllm.lab.synthetic import make_video, video_tokens
from cords_vllm.lab.synthetic.video import with_metadata
from cords_vllm.lab.vqa import VideoGeometry, make_split
from cords_vllm.utils import cdiv

#: The prompt the tiny model was built for (no system text): vision placeholder then the question.
PROMPT = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{question}<|im_end|>\n"
          "<|im_start|>assistant\n")
QUESTION = "What color was the square?"


@dataclass(frozen=True)
class BenchRequest:
    """One request: frames ``uint8 [T, H, W, 3]``, its prompt, and when it arrives (seconds from start).

    ``question`` is the text a chat request sends after the video (``prompt`` is the raw prompt the chat
    template renders it to); ``answer`` and ``tag`` (e.g. a question family) are set for questions with a
    known answer.
    """

    request_id: str
    frames: np.ndarray
    prompt: str
    arrival: float
    question: str = QUESTION
    answer: str | None = None
    tag: str = ""
    #: Frame rate the video is sent with (its metadata; Qwen2.5-VL needs it); ``None``: bare frames.
    fps: float | None = None

    def engine_input(self) -> dict:
        video = self.frames if self.fps is None else with_metadata(self.frames, self.fps)
        return {"prompt": self.prompt, "multi_modal_data": {"video": video}}


@dataclass(frozen=True)
class VideoWorkload:
    """``num_requests`` videos of ``frames`` frames at ``size`` x ``size`` pixels.

    ``rate``: Poisson arrivals at this many requests per second; ``None``: all arrive at once. ``fps``: send each
    video with its times at this frame rate (Qwen2.5-VL, Qwen3-VL); ``None``: bare frames.
    """

    num_requests: int = 16
    frames: int = 64
    size: int = 224
    max_tokens: int = 16
    rate: float | None = None
    seed: int = 0
    fps: float | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.frames < 2 or self.frames % 2 or self.size % 28:
            raise ValueError("need num_requests >= 1, an even frames >= 2 and size a multiple of 28, got "
                             f"{self.num_requests}, {self.frames}, {self.size}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")

    @property
    def video_tokens(self) -> int:
        return video_tokens(self.frames, self.size, self.size)

    def requests(self) -> list[BenchRequest]:
        rng = np.random.default_rng(self.seed)
        gaps = rng.exponential(1.0 / self.rate, self.num_requests) if self.rate else np.zeros(self.num_requests)
        arrivals = np.cumsum(gaps) - (gaps[0] if self.rate else 0.0)
        return [BenchRequest(request_id=f"req-{i}", prompt=PROMPT.format(question=QUESTION),
                             frames=make_video(self.frames, self.size, self.size, seed=self.seed + i).frames,
                             arrival=float(arrivals[i]), fps=self.fps)
                for i in range(self.num_requests)]


@dataclass(frozen=True)
class VQAWorkload:
    """``num_requests`` held-out video questions (:mod:`cords_vllm.lab.vqa`) for the trained tiny model.

    All arrive at once; families alternate. ``frames`` frames at 112 x 112 (the training videos had 64;
    the shipped model answers 128-frame videos as well). Answers are one token.
    """

    num_requests: int = 8
    frames: int = 128
    families: tuple[str, ...] = ("colour", "order", "count", "static")
    max_tokens: int = 1
    rate: float | None = None

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.frames < 2 or self.frames % 2:
            raise ValueError(f"need num_requests >= 1 and an even frames >= 2, got {self.num_requests}, "
                             f"{self.frames}")

    @property
    def geometry(self):

        return VideoGeometry(num_frames=self.frames)

    @property
    def video_tokens(self) -> int:
        return self.geometry.num_video_tokens

    def requests(self) -> list[BenchRequest]:

        per_family = cdiv(self.num_requests, len(self.families))
        examples = make_split(self.families, per_family, "heldout", geometry=self.geometry)[: self.num_requests]
        return [BenchRequest(request_id=f"req-{i}", frames=np.array(e.frames), prompt=e.prompt, arrival=0.0,
                             question=e.question, answer=e.answer, tag=e.family)
                for i, e in enumerate(examples)]


@dataclass(frozen=True)
class PolicySpec:
    """A policy to benchmark: a registry name plus its ``kv_policy_config`` and a display label."""

    label: str
    policy: str
    config: dict

    @classmethod
    def parse(cls, text: str, defaults: dict) -> PolicySpec:
        """``name`` or ``name:key=value,key=value`` (lists with ``+``, e.g. ``cords:anchors=0+2``)."""
        name, _, rest = text.partition(":")
        config = {} if name == "none" else dict(defaults)
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"policy variant {text!r}: expected key=value, got {item!r}")
            config[key] = _value(value)
        return cls(label=text, policy=name, config=config)


def _value(text: str):
    if "+" in text:
        return [_value(v) for v in text.split("+")]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)
