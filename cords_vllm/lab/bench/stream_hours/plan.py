"""What one hours-long stream run streams: its settings (:class:`HoursConfig`), its questions with known answers
and the video with their marks drawn in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cords_vllm.compress.positions import Grid
from cords_vllm.lab.vqa.stream_task import clip_mark, timestamp
from cords_vllm.lab.vqa.video import COLOUR_NAMES, TEMPORAL_PATCH, TOKEN_PIXELS, VideoGeometry

#: Questions of the two kinds (their families' fixed questions) and the marks they are about.
QUESTIONS: dict[str, str] = {"recent": "What color is the dot?", "old": "What color was the square?"}
#: Text tokens one clip turn adds around its video (the vision markers), counted in rotary positions.
MARKERS = 2


@dataclass(frozen=True)
class HoursConfig:
    """What one run streams and how each server is sized.

    Attributes
    ----------
    hours, fps, clip_frames, size:
        Video length, frame rate, frames per push (even) and frame side in pixels (a multiple of 28).
    ask_every_min, old_event_min:
        Minutes of video between checkpoints, and how long before a checkpoint its old event is shown.
    old_after_recent:
        Ask a checkpoint's old question after its recent event (the dot) is shown, with the recent question;
        otherwise (default) it is asked two pushes earlier, before the dot. Either way it is about an event
        ``old_event_min`` minutes back; after the dot, naming the latest mark is wrong, so the model must also tell a
        square from a newer dot (the stream task's hard case), not only remember.
    budget, recent, slack, max_text_tokens:
        ``--kv-policy-config`` of a policy other than ``none`` (video tokens; protected text tokens).
    block_size, max_positions:
        KV block size, and the rotary range the model is served with (``max_position_embeddings``).
    cords_max_model_len:
        ``--max-model-len`` under a policy; ``None``: what the stream holds at once (text, budget, slack) plus
        one push, rounded up to 1,024. ``none`` uses ``max_positions``.
    pool_footprints:
        KV pool under a policy, in streams' footprints (``none``: one ``--max-model-len`` request).
    dtype, answer_tokens:
        ``--dtype`` of the model and KV cache (``float32`` for the tiny checkpoints; ``auto`` for a served
        Qwen2-VL), and tokens an answer may take (the tiny checkpoints answer one word; a chat model writes a
        sentence, scored by the first colour it names: :func:`named_colour`).
    mm_cache_gb:
        ``--mm-processor-cache-gb``; ``None``: vLLM's default (4 GiB). Off by default: a live stream never sends
        the same clip twice, so the cache only fills (the engine core's copy by about one processed clip a push,
        up to the cap) and its growth would hide the engine's own.
    seed:
        Seed of the video and the events.
    """

    hours: float = 2.05
    fps: float = 2.0
    clip_frames: int = 8
    size: int = 448
    ask_every_min: float = 15.0
    old_event_min: float = 5.0
    old_after_recent: bool = False
    budget: int = 2048
    recent: int = 512
    slack: int = 512
    max_text_tokens: int = 1024
    block_size: int = 32
    max_positions: int = 32768
    cords_max_model_len: int | None = None
    pool_footprints: float = 2.0
    mm_cache_gb: float | None = 0.0
    dtype: str = "float32"
    answer_tokens: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.clip_frames <= 0 or self.clip_frames % TEMPORAL_PATCH:
            raise ValueError(f"clip_frames must be a positive multiple of {TEMPORAL_PATCH}, got {self.clip_frames}")
        if self.size <= 0 or self.size % TOKEN_PIXELS:
            raise ValueError(f"size must be a positive multiple of {TOKEN_PIXELS}, got {self.size}")
        if self.hours <= 0 or self.fps <= 0:
            raise ValueError("hours and fps must be positive")
        if not 0 < self.old_event_min < self.ask_every_min:
            raise ValueError("old_event_min must be positive and shorter than ask_every_min")

    @property
    def clip_seconds(self) -> float:
        """Seconds of video one push covers."""
        return self.clip_frames / self.fps

    @property
    def pushes(self) -> int:
        """Pushes of the whole run."""
        return max(1, round(self.hours * 3600 / self.clip_seconds))

    @property
    def geometry(self) -> VideoGeometry:
        """One clip's geometry."""
        return VideoGeometry(num_frames=self.clip_frames, size=self.size)

    @property
    def clip_tokens(self) -> int:
        """Video tokens of one clip (the processor keeps the frame size: ``max_pixels`` is set to it)."""
        return self.geometry.num_video_tokens

    @property
    def policy_max_model_len(self) -> int:
        """``--max-model-len`` under a policy (:attr:`cords_max_model_len`, or derived)."""
        if self.cords_max_model_len is not None:
            return self.cords_max_model_len
        held = self.max_text_tokens + self.budget + self.slack + 2 * self.block_size
        return -(-(held + self.clip_tokens + MARKERS) // 1024) * 1024

    @property
    def clip_positions(self) -> int:
        """Rotary positions one clip turn takes: its grid's extent and its two vision markers."""
        t, h, w = self.geometry.llm_grid
        return Grid(offset=0, t=t, h=h, w=w).extent + MARKERS



@dataclass(frozen=True)
class Question:
    """One question with a known answer: asked after push ``ask_push`` about an event in push ``event_push``."""

    checkpoint: int
    kind: str
    ask_push: int
    event_push: int
    answer: str

    @property
    def text(self) -> str:
        return QUESTIONS[self.kind]


def plan_questions(cfg: HoursConfig) -> list[Question]:
    """Two questions (recent, old) per checkpoint that the run reaches; colours differ from the previous
    checkpoint's (and a checkpoint's dot from its square). The recent question is asked after the push that
    reaches the checkpoint, about the push before it; the old one two pushes earlier, before the dot is shown
    (:attr:`HoursConfig.old_after_recent`: with the recent one)."""
    rng = np.random.default_rng([cfg.seed, 0x5EC])
    per_checkpoint = cfg.ask_every_min * 60 / cfg.clip_seconds
    old_back = max(3, round(cfg.old_event_min * 60 / cfg.clip_seconds))
    questions: list[Question] = []
    previous = {"recent": None, "old": None}
    k = 1
    while (ask := round(k * per_checkpoint) - 1) < cfg.pushes:
        square = str(rng.choice([c for c in COLOUR_NAMES if c != previous["old"]]))
        dot = str(rng.choice([c for c in COLOUR_NAMES if c not in (previous["recent"], square)]))
        old_ask = ask if cfg.old_after_recent else ask - 2
        old = Question(k, "old", old_ask, old_ask - old_back, square)
        if old.event_push < 0:
            raise ValueError(f"old_event_min {cfg.old_event_min:g} is too close to ask_every_min "
                             f"{cfg.ask_every_min:g}: the first old event would come before the stream starts")
        recent = Question(k, "recent", ask, ask - 1, dot)
        questions += [recent, old] if cfg.old_after_recent else [old, recent]
        previous = {"recent": dot, "old": square}
        k += 1
    return questions


class StreamVideo:
    """The run's clips as JPEG data URLs: a looping background (``scenes`` scenes of ``scene_clips`` clips of the
    VQA tasks' redundant video) with the questions' marks drawn into their clips.

    ``unique``: every clip also carries a small timestamp (the push number as a row of black and white cells in
    its bottom-left corner), so no two pushes send the same bytes, as with a real camera (vLLM's multimodal caches
    see a new input every push); otherwise background clips are encoded once and repeat every
    ``scenes * scene_clips`` pushes.
    """

    def __init__(self, cfg: HoursConfig, questions: Sequence[Question], *, unique: bool = True, scenes: int = 2,
                 scene_clips: int = 8) -> None:
        from cords_vllm.lab.vqa.video import noise_bank, render_background

        self.cfg = cfg
        self.unique = unique
        scene = VideoGeometry(num_frames=cfg.clip_frames * scene_clips, size=cfg.size)
        clips: list[np.ndarray] = []
        for s in range(scenes):
            video = np.clip(render_background(np.random.default_rng([cfg.seed, s]), scene), 0, 255).astype(np.uint8)
            clips += [video[i * cfg.clip_frames:(i + 1) * cfg.clip_frames] for i in range(scene_clips)]
        noise_bank.cache_clear()
        self.clips = clips
        self.background = None if unique else [_data_urls(c) for c in clips]
        self.events = {q.event_push: q for q in questions}

    def frames(self, push: int) -> np.ndarray:
        """``uint8 [clip_frames, S, S, 3]`` of push ``push``: its background, its timestamp (``unique``) and its
        event's mark if any."""
        clip = self.clips[push % len(self.clips)]
        if self.unique:
            clip = timestamp(clip, push)
        question = self.events.get(push)
        if question is None:
            return clip
        return draw_event(clip, question, np.random.default_rng([self.cfg.seed, push]))

    def urls(self, push: int) -> list[str]:
        """Push ``push``'s frames as JPEG data URLs."""
        if self.background is not None and push not in self.events:
            return self.background[push % len(self.background)]
        return _data_urls(self.frames(push))


def draw_event(clip: np.ndarray, question: Question, rng: np.random.Generator) -> np.ndarray:
    """``clip`` with ``question``'s mark: a dot in every frame (recent) or a square in one temporal patch (old)."""
    from cords_vllm.lab.vqa.video import draw_marks

    geometry = VideoGeometry(num_frames=len(clip), size=clip.shape[1])
    mark = clip_mark("dot" if question.kind == "recent" else "square", question.answer, rng, geometry)
    return draw_marks(rng, clip.astype(np.float32), (mark,))


def _data_urls(frames: np.ndarray) -> list[str]:
    from cords_vllm.client import frame_data_url

    return [frame_data_url(f) for f in frames]
