"""One live stream for hours of video through ``vllm serve``: KV held, server memory and push cost per push.

One camera streams ``hours`` of synthetic video at ``fps`` into one stream of the stream API (``/v1/streams``), in
clips of ``clip_frames`` frames of ``size x size`` pixels, as fast as the server takes them (no real-time
pacing). The model is a tiny video-QA checkpoint (the shipped one by default, or one fine-tuned on
:mod:`cords_vllm.lab.vqa.stream_task` examples as well), served with Qwen2-VL-7B's rotary range:
``--hf-overrides`` sets its text config's ``max_position_embeddings`` to ``max_positions`` (32768), and
``--mm-processor-kwargs max_pixels`` keeps frames at their size, so a clip has Qwen2-VL-7B's geometry (8 frames
of 448 x 448: 1,024 video tokens, 18 rotary positions with its markers). :func:`check_position_range` proves the
served range: a ``--max-model-len`` one past it is refused.

Under ``none`` the stream ends with a 410 at ``--max-model-len`` tokens (the rotary range); under ``cords`` it is
re-based at every push, so its KV stays flat and its limit is its rotary positions (a 410 naming "rotary
positions" when they run out). Each push records the video pushed so far, the KV blocks the stream holds (the
stream listing, published up to 0.5 s late, and the pool's usage from ``/metrics``, exact: the stream is the only
request), the resident memory of every server process and the push's wall time.

Questions with known answers (the shipped model's families, :mod:`cords_vllm.lab.vqa.tasks`): every
``ask_every_min`` minutes of video (a *checkpoint*) the stream is asked two questions:

* *old*, "What color was the square?", two pushes before the checkpoint: a square (the ``colour`` family's needle)
  was shown for one temporal patch ``old_event_min`` minutes before; it is the only square since the previous
  checkpoint;
* *recent*, "What color is the dot?", after the push that reaches the checkpoint: a small dot of one colour (the
  ``static`` family's mark) is shown in every frame of the clip before the last one, so the event ended one clip
  (``clip_frames / fps`` seconds) before the question.

The old question is asked before the dot is shown, so it asks whether the stream still holds the square; with
``old_after_recent`` (``--old-after-recent``) it is asked after the dot, with the recent question, and the model
must also tell a square from a newer dot.

Earlier checkpoints' marks may still be held: each checkpoint's colours differ from the previous one's, and a
wrong answer naming the colour of another mark asked about (an earlier checkpoint's, or this checkpoint's other
one) is recorded as ``stale``. The one-shot checkpoint (trained on one mark per video) names the most salient
mark whatever is asked once a stream holds several, under ``none`` too; :mod:`cords_vllm.lab.vqa.stream_task`
draws training examples of this shape (the latest mark of the kind asked, older clips partly held, position gaps)
for a checkpoint that tells marks apart (``train_vqa.py --stream-batch``; see docs/results.md).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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


# ----------------------------------------------------------------------------------------------------------------
# The video and its events


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


# ----------------------------------------------------------------------------------------------------------------
# Servers


def serve_flags(model_dir: str | Path, policy: str, cfg: HoursConfig) -> list[str]:
    """``vllm serve`` flags: fp32, eager, the rotary range ``cfg.max_positions``, frames kept at their size.

    ``none``: ``--max-model-len`` is the rotary range and the pool holds one such request (the stream API admits
    a stream under ``none`` as one max-model-len request). A policy: ``cfg.policy_max_model_len`` and a pool of
    ``cfg.pool_footprints`` streams' bounded footprints.
    """
    from cords_vllm.lab.bench.offline import dtype_bytes, kv_bytes_per_block
    from cords_vllm.utils import cdiv

    block = cfg.block_size
    if policy == "none":
        max_model_len, pool_blocks = cfg.max_positions, cdiv(cfg.max_positions, block) + 1
    else:
        footprint = cdiv(cfg.max_text_tokens + cfg.budget + cfg.slack + 2 * block, block)
        max_model_len, pool_blocks = cfg.policy_max_model_len, math.ceil(cfg.pool_footprints * footprint) + 1
    pool_bytes = (pool_blocks + 1) * kv_bytes_per_block(model_dir, block, dtype_bytes(cfg.dtype))
    flags = ["--kv-policy", policy, "--dtype", cfg.dtype, "--enforce-eager", "--block-size", str(block),
             "--kv-cache-memory-bytes", str(pool_bytes),
             "--max-model-len", str(max_model_len),
             "--max-num-batched-tokens", str(max(2048, 2 * (cfg.clip_tokens + MARKERS))),
             "--limit-mm-per-prompt", '{"image": 0, "video": 1}', "--served-model-name", "tiny-vqa",
             *position_flags(cfg)]
    if cfg.mm_cache_gb is not None:
        flags += ["--mm-processor-cache-gb", str(cfg.mm_cache_gb)]
    if policy != "none":
        flags += ["--kv-policy-config", json.dumps({"budget": cfg.budget, "recent": cfg.recent, "slack": cfg.slack,
                                                    "max_text_tokens": cfg.max_text_tokens})]
    return flags


def position_flags(cfg: HoursConfig) -> list[str]:
    """The flags that give the shipped checkpoint Qwen2-VL-7B's rotary range and keep frames at their size."""
    return ["--hf-overrides", json.dumps({"text_config": {"max_position_embeddings": cfg.max_positions}}),
            "--mm-processor-kwargs", json.dumps({"max_pixels": cfg.size * cfg.size})]


def check_position_range(model_dir: str | Path, cfg: HoursConfig) -> dict[str, Any]:
    """Start ``vllm serve`` with ``--max-model-len`` one past ``cfg.max_positions``: vLLM must refuse it, naming the
    overridden ``max_position_embeddings`` (proof that the engine runs with that range). Returns what it said."""
    from cords_vllm.lab.serving.process import VLLMServer

    server = VLLMServer(model_dir, ["--kv-policy", "none", "--dtype", cfg.dtype, "--enforce-eager",
                                    "--max-model-len", str(cfg.max_positions + 1), *position_flags(cfg)],
                        startup_timeout=180)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        match = re.search(r"derived max_model_len \((max_position_embeddings=[0-9.]+)", str(exc))
        return {"refused": True, "max_model_len": cfg.max_positions + 1,
                "derived": match.group(1) if match else None, "ok": bool(match) and str(cfg.max_positions) in
                match.group(1)}
    server.stop()
    return {"refused": False, "max_model_len": cfg.max_positions + 1, "derived": None, "ok": False}


# ----------------------------------------------------------------------------------------------------------------
# One policy's run


@dataclass
class PushRecord:
    """One push: the video and video tokens pushed so far, KV held after it, server memory, wall time.

    ``kv_blocks``: the stream listing's (published up to 0.5 s late; ``None`` before the first publication);
    ``pool_blocks``: blocks in use in the pool (``/metrics``), the stream being the only request;
    ``positions``: rotary positions used, estimated as the stream's protected (text) tokens ``text_tokens`` plus
    each clip's extent; ``cpu_s``: CPU seconds the server's processes spent during the push (unlike ``push_s``,
    hardly changed by other work on the machine); ``t_s``: seconds since the first push; ``load1``: the machine's
    one-minute load average.
    """

    push: int
    video_s: float
    video_tokens: int
    kv_blocks: int | None
    pool_blocks: int
    text_tokens: int
    positions: int
    rss_mb: float
    rss_by_process: dict[str, float]
    push_s: float
    cpu_s: float
    t_s: float
    load1: float


@dataclass
class QuestionRecord:
    """One question asked: when (push, video time), about which event (its video time), the answer given."""

    checkpoint: int
    kind: str
    push: int
    video_s: float
    event_video_s: float
    question: str
    answer: str
    predicted: str
    correct: bool
    stale: bool
    ask_s: float


@dataclass
class PolicyRun:
    """What one policy's stream did.

    ``stopped``: why the stream ended before its last push (the 410's message), ``stopped_push`` the push
    refused (or after which a question was refused: ``stopped_during``); ``errors``: other error answers (status
    and message); ``log_errors``: error lines of the server log.
    """

    policy: str
    flags: list[str]
    pool_blocks: int
    footprint_blocks: int | None = None
    records: list[PushRecord] = field(default_factory=list)
    questions: list[QuestionRecord] = field(default_factory=list)
    stopped: str | None = None
    stopped_push: int | None = None
    stopped_status: int | None = None
    stopped_during: str | None = None
    errors: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    startup_s: float = 0.0
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """Compact JSON: per-push values as columns."""
        out = {k: v for k, v in asdict(self).items() if k not in ("records", "questions")}
        recs = self.records
        names = sorted({n for r in recs for n in r.rss_by_process})
        out["pushes"] = {
            "push": [r.push for r in recs], "video_s": [r.video_s for r in recs],
            "video_tokens": [r.video_tokens for r in recs], "kv_blocks": [r.kv_blocks for r in recs],
            "pool_blocks": [r.pool_blocks for r in recs], "text_tokens": [r.text_tokens for r in recs],
            "positions": [r.positions for r in recs], "rss_mb": [round(r.rss_mb, 1) for r in recs],
            "push_s": [round(r.push_s, 3) for r in recs], "cpu_s": [round(r.cpu_s, 2) for r in recs],
            "t_s": [round(r.t_s, 1) for r in recs], "load1": [round(r.load1, 2) for r in recs],
            "rss_mb_by_process": {n: [round(r.rss_by_process.get(n, 0.0), 1) for r in recs] for n in names},
        }
        out["questions"] = [asdict(q) for q in self.questions]
        return out


def named_colour(text: str) -> str:
    """The first colour name in an answer (``"The dot is red."`` -> ``"red"``), else the answer stripped."""
    words = re.findall(r"[a-z]+", text.lower())
    return next((w for w in words if w in COLOUR_NAMES), text.strip())


def _scrape_pool_blocks(base_url: str, total_blocks: int) -> int:
    from cords_vllm.lab.bench.http import scrape

    return round(total_blocks * scrape(base_url).get("vllm:kv_cache_usage_perc", 0.0))


def _rss(pid: int) -> dict[str, float]:
    from cords_vllm.lab.bench.soak import process_tree_rss_mb

    return process_tree_rss_mb(pid)


def cpu_seconds(pids: Sequence[int]) -> float:
    """User and system CPU seconds ``pids`` have used so far (all their threads; gone processes count 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def _pids(by_process: dict[str, float]) -> list[int]:
    """The pids of :func:`~cords_vllm.lab.bench.soak.process_tree_rss_mb`'s ``"name (pid)"`` keys."""
    return [int(key.rsplit("(", 1)[1].rstrip(")")) for key in by_process]


def run_policy(model_dir: str | Path, policy: str, cfg: HoursConfig, video: StreamVideo,
               questions: Sequence[Question], on_push: Callable[[PushRecord], None] | None = None,
               on_question: Callable[[QuestionRecord], None] | None = None) -> PolicyRun:
    """Serve ``policy``, open one stream and push ``video`` into it until its end or the first error answer
    (a 410 ends the run: the stream has ended); ask ``questions`` after their pushes."""
    from cords_vllm.client import StreamAPIError, StreamClient
    from cords_vllm.lab.bench.http import num_gpu_blocks
    from cords_vllm.lab.serving.process import VLLMServer

    flags = serve_flags(model_dir, policy, cfg)
    server = VLLMServer(model_dir, flags)
    asks: dict[int, list[Question]] = {}
    for q in questions:
        asks.setdefault(q.ask_push, []).append(q)
    t0 = time.perf_counter()
    with server:
        run = PolicyRun(policy, flags, num_gpu_blocks(server.base_url) - 1, startup_s=time.perf_counter() - t0)
        client = StreamClient(server.base_url, timeout=600)
        stream = client.open(metadata={"benchmark": "stream_hours"})
        run.footprint_blocks = stream.info.get("footprint_blocks")
        shown: list[str] = []  # colours of the marks of the questions asked so far
        t_run = time.perf_counter()
        pids = _pids(_rss(server.proc.pid))
        push, what = -1, "push"
        try:
            for push in range(cfg.pushes):
                what = "push"
                urls = video.urls(push)
                cpu, t = cpu_seconds(pids), time.perf_counter()
                answer = client.request("POST", f"/v1/streams/{stream.id}/frames", {"frames": urls})
                push_s, cpu = time.perf_counter() - t, cpu_seconds(pids) - cpu
                stream.info = answer["stream"]
                info = stream.refresh()
                by_process = _rss(server.proc.pid)
                pids = _pids(by_process)
                kv = info.get("kv") or {}
                text = int(info.get("text_tokens") or 0)
                record = PushRecord(
                    push=push, video_s=(push + 1) * cfg.clip_seconds, video_tokens=(push + 1) * cfg.clip_tokens,
                    kv_blocks=kv.get("blocks"), pool_blocks=_scrape_pool_blocks(server.base_url, run.pool_blocks),
                    text_tokens=text, positions=text + info.get("clips", push + 1) * cfg.clip_positions,
                    rss_mb=sum(by_process.values()), rss_by_process=_by_name(by_process), push_s=push_s,
                    cpu_s=cpu, t_s=t - t_run, load1=os.getloadavg()[0])
                run.records.append(record)
                if on_push:
                    on_push(record)
                shown += [q.answer for q in asks.get(push, [])]
                for q in asks.get(push, []):
                    what = f"{q.kind} question"
                    t = time.perf_counter()
                    got = named_colour(stream.ask(q.text, max_tokens=cfg.answer_tokens))
                    done = QuestionRecord(
                        checkpoint=q.checkpoint, kind=q.kind, push=push, video_s=record.video_s,
                        event_video_s=q.event_push * cfg.clip_seconds, question=q.text, answer=q.answer,
                        predicted=got, correct=got == q.answer, stale=got != q.answer and got in shown,
                        ask_s=time.perf_counter() - t)
                    run.questions.append(done)
                    if on_question:
                        on_question(done)
        except StreamAPIError as exc:
            run.stopped, run.stopped_push, run.stopped_status = exc.message, push, exc.status
            run.stopped_during = what
            if exc.status != 410:
                run.errors.append(f"{what} {push}: HTTP {exc.status}: {exc.message}")
        except OSError as exc:  # the server went away or stopped answering
            run.stopped, run.stopped_push, run.stopped_during = f"{type(exc).__name__}: {exc}", push, what
            run.errors.append(f"{what} {push}: {type(exc).__name__}: {exc}")
        run.wall_s = time.perf_counter() - t_run
        try:
            stream.close()
        except StreamAPIError as exc:
            if exc.status != 404:
                run.errors.append(f"close: HTTP {exc.status}: {exc.message}")
        log = Path(server.log_path).read_text(errors="replace")
    run.log_errors = [line[:400] for line in log.splitlines()
                      if re.search(r"\bERROR\b", line) or line.startswith("Traceback")][:20]
    return run


def _by_name(by_process: dict[str, float]) -> dict[str, float]:
    """``{"name (pid)": MB}`` -> ``{"name": MB}`` (summed over processes of the same name)."""
    out: dict[str, float] = {}
    for key, mb in by_process.items():
        name = key.rsplit(" (", 1)[0]
        out[name] = out.get(name, 0.0) + mb
    return out


# ----------------------------------------------------------------------------------------------------------------
# Summary, table, plot


def _tenth(n: int) -> int:
    return max(1, math.ceil(n / 10))


def rss_growth(records: Sequence[PushRecord], key: Callable[[PushRecord], float] | None = None) -> dict[str, Any]:
    """RSS growth after warm-up (the first 10% of pushes): a least-squares line of RSS against video hours over
    the other pushes; ``pct_per_hour`` is its slope over the RSS at the end of warm-up. ``late_pct_per_hour``:
    the same over the second half of the pushes only, which tells growth that goes on (a leak) from growth that
    levels off (caches and the allocator's heap filling to their size)."""
    key = key or (lambda r: r.rss_mb)
    warm = _tenth(len(records))
    rest = records[warm:]
    if len(rest) < 2:
        return {"mb_per_hour": None, "pct_per_hour": None, "start_mb": None, "end_mb": None,
                "late_mb_per_hour": None, "late_pct_per_hour": None}
    start = float(key(records[warm - 1]))
    slope = _slope(rest, key)
    late = _slope(records[len(records) // 2:], key)
    return {"mb_per_hour": slope, "pct_per_hour": 100 * slope / start if start else None, "start_mb": start,
            "end_mb": float(key(rest[-1])), "delta_mb": float(key(rest[-1]) - start),
            "late_mb_per_hour": late, "late_pct_per_hour": 100 * late / start if start else None}


def _slope(records: Sequence[PushRecord], key: Callable[[PushRecord], float]) -> float:
    """MB per hour of video: the least-squares slope of ``key`` over ``records``."""
    hours = np.array([r.video_s / 3600 for r in records])
    if len(records) < 2 or np.ptp(hours) == 0:
        return 0.0
    return float(np.polyfit(hours, np.array([key(r) for r in records]), 1)[0])


def summarise(run: PolicyRun, cfg: HoursConfig) -> dict[str, Any]:
    """The run's figures: pushes and video reached, KV blocks first / last (``kv_flat``: their peak after warm-up,
    the first 10% of pushes, passes the peak during it by at most the blocks of the protected text added since,
    questions and answers, which are never evicted, plus one; ``kv_within_footprint``: never above the footprint
    the stream was admitted with), RSS growth after warm-up, push wall time and server CPU time ratios (medians
    of the last 10% of pushes over the first 10%; the load average tells whether other work shared the machine),
    questions right / asked, and where the stream ended."""
    recs = run.records
    out: dict[str, Any] = {"policy": run.policy, "pushes": len(recs), "planned_pushes": cfg.pushes,
                           "video_hours": recs[-1].video_s / 3600 if recs else 0.0,
                           "video_tokens": recs[-1].video_tokens if recs else 0, "pool_blocks": run.pool_blocks,
                           "stopped": run.stopped, "stopped_push": run.stopped_push,
                           "stopped_status": run.stopped_status, "stopped_during": run.stopped_during,
                           "stopped_video_s": (run.stopped_push * cfg.clip_seconds
                                               if run.stopped_push is not None else None),
                           "errors": len(run.errors), "log_errors": len(run.log_errors), "wall_s": run.wall_s,
                           "startup_s": run.startup_s}
    if not recs:
        return out
    n = _tenth(len(recs))
    blocks = [r.pool_blocks for r in recs]
    first, last = np.median([r.push_s for r in recs[:n]]), np.median([r.push_s for r in recs[-n:]])
    cpu_first, cpu_last = np.median([r.cpu_s for r in recs[:n]]), np.median([r.cpu_s for r in recs[-n:]])
    text_blocks = math.ceil(max(0, recs[-1].text_tokens - recs[n - 1].text_tokens) / cfg.block_size)
    growth = max(blocks[n:], default=0) - max(blocks[:n])
    out.update({
        "kv_blocks_first": blocks[0], "kv_blocks_last": blocks[-1], "kv_blocks_peak": max(blocks),
        "kv_blocks_peak_warmup": max(blocks[:n]), "kv_blocks_peak_after_warmup": max(blocks[n:], default=None),
        "kv_blocks_growth_after_warmup": growth, "text_tokens_first": recs[0].text_tokens,
        "text_tokens_last": recs[-1].text_tokens, "text_blocks_added_after_warmup": text_blocks,
        "kv_flat": growth <= text_blocks + 1,
        "footprint_blocks": run.footprint_blocks,
        "kv_within_footprint": run.footprint_blocks is None or max(blocks) <= run.footprint_blocks,
        "listing_kv_blocks_last": recs[-1].kv_blocks,
        "positions_last": recs[-1].positions,
        "rss": rss_growth(recs),
        "rss_by_process": {name: rss_growth(recs, lambda r, name=name: r.rss_by_process.get(name, 0.0))
                           for name in recs[-1].rss_by_process},
        "push_s_median_first10": float(first), "push_s_median_last10": float(last),
        "push_s_ratio_last_first": float(last / first) if first else None,
        "cpu_s_median_first10": float(cpu_first), "cpu_s_median_last10": float(cpu_last),
        "cpu_s_ratio_last_first": float(cpu_last / cpu_first) if cpu_first else None,
        "load1_mean_first10": float(np.mean([r.load1 for r in recs[:n]])),
        "load1_mean_last10": float(np.mean([r.load1 for r in recs[-n:]])),
        "questions_right": sum(q.correct for q in run.questions), "questions_asked": len(run.questions),
        "questions_by_kind": {kind: [sum(q.correct for q in run.questions if q.kind == kind),
                                     sum(q.kind == kind for q in run.questions)] for kind in QUESTIONS},
        "stale_answers": sum(q.stale for q in run.questions),
    })
    return out


def agreement_with_none(runs: Sequence[PolicyRun]) -> dict[str, dict[str, Any]]:
    """Per policy other than ``none``: of the questions both it and ``none`` answered (``none`` stops at its rotary
    range), how many got the same answer. Where they agree, what the policy evicted did not change the answer,
    right or wrong: the compression's own fidelity, apart from how well the model answers."""
    reference = next((r for r in runs if r.policy == "none"), None)
    if reference is None:
        return {}
    asked = {(q.checkpoint, q.kind): q.predicted for q in reference.questions}
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run is reference:
            continue
        both = [(q, asked[q.checkpoint, q.kind]) for q in run.questions if (q.checkpoint, q.kind) in asked]
        out[run.policy] = {"questions": len(both), "same_answer": sum(q.predicted == p for q, p in both),
                           "right": sum(q.correct for q, _ in both),
                           "none_right": sum(p == q.answer for q, p in both)}
    return out


def write_results(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON with every list of numbers on one line (per-push columns stay small)."""
    text = json.dumps(payload, indent=1, default=float)
    text = re.sub(r"\[\s+([^\[\]{}\"]*?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _fmt(value: Any, spec: str = "{}") -> str:
    return "-" if value is None else spec.format(value)


def format_summary(summaries: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of :func:`summarise` results, one row per policy."""
    lines = ["| policy | pushes | video h | KV blocks first / last (peak) | flat | RSS after warm-up | "
             "RSS %/h (2nd half) | push s first / last 10% | ratio | CPU s ratio | load first / last | "
             "right / asked | ended |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if not s["pushes"]:
            lines.append(f"| {s['policy']} | 0 | - | - | - | - | - | - | - | - | - | - | {s['stopped']} |")
            continue
        rss = s["rss"]
        ended = "reached the end" if s["stopped"] is None else (
            f"HTTP {s['stopped_status']} at push {s['stopped_push']} ({s['stopped_during']})")
        lines.append(
            f"| {s['policy']} | {s['pushes']} | {s['video_hours']:.3f} | {s['kv_blocks_first']} / "
            f"{s['kv_blocks_last']} ({s['kv_blocks_peak']}) | {'yes' if s['kv_flat'] else 'no'} | "
            f"{_fmt(rss['start_mb'], '{:.0f}')} -> {_fmt(rss['end_mb'], '{:.0f}')} MB | "
            f"{_fmt(rss['pct_per_hour'], '{:+.2f}')} ({_fmt(rss['late_pct_per_hour'], '{:+.2f}')}) | "
            f"{s['push_s_median_first10']:.3f} / "
            f"{s['push_s_median_last10']:.3f} | {_fmt(s['push_s_ratio_last_first'], '{:.2f}x')} | "
            f"{_fmt(s['cpu_s_ratio_last_first'], '{:.2f}x')} | {s['load1_mean_first10']:.1f} / "
            f"{s['load1_mean_last10']:.1f} | "
            f"{s['questions_right']} / {s['questions_asked']} | {ended} |")
    return "\n".join(lines)


def plot_runs(runs: Sequence[PolicyRun], path: Path, title: str = "") -> Path:
    """Three panels against video time, one line per policy: KV blocks held, server RSS, push wall time (and,
    dashed, the server's CPU seconds per push)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for run in runs:
        minutes = [r.video_s / 60 for r in run.records]
        axes[0].plot(minutes, [r.pool_blocks for r in run.records], label=run.policy)
        axes[1].plot(minutes, [r.rss_mb for r in run.records], label=run.policy)
        line, = axes[2].plot(minutes, [r.push_s for r in run.records], label=f"{run.policy}: wall", linewidth=0.6)
        axes[2].plot(minutes, [r.cpu_s for r in run.records], label=f"{run.policy}: server CPU", linewidth=0.6,
                     linestyle="--", color=line.get_color())
        if run.stopped is not None and run.records:
            axes[0].plot(minutes[-1], run.records[-1].pool_blocks, "x", color="black")
    axes[0].set_ylabel("KV blocks held")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("server RSS (MB, all processes)")
    axes[2].set_ylabel("seconds per push")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("video streamed (minutes)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
