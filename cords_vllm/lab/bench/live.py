"""Live cameras against a server's stream API, in real time: what the demo and ``benchmarks/streams.py`` run.

Each :class:`Camera` plays a video at ``fps`` into its own stream (``/v1/streams``) in pushes of
``push_frames`` frames, each push sent when its last frame "arrives"; it asks its questions right after given
pushes (about events earlier in the stream) with a streamed answer, timing the first token. A
:class:`Sampler` reads ``GET /v1/streams`` and ``/metrics`` every ``period`` seconds for the KV each stream
holds and the pool's use. A camera *keeps pace* when every push was in the engine before the next one was
due (its lag never exceeded one push interval); a stream the server ended (e.g. at ``--max-model-len``) is
reported with the server's reason, and one whose push or question got no answer within ``stall_timeout_s``
is reported as stalled and closed by the camera (under ``none`` a full pool stalls every session: vLLM does
not preempt sessions waiting for their next input, which hold their blocks).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cords_vllm.client import StreamAPIError, StreamClient
from cords_vllm.lab.bench.http import scrape


@dataclass(frozen=True)
class Question:
    """Asked right after push ``after_push`` (1-based); ``answer`` is the right one (``None``: unknown)."""

    after_push: int
    text: str
    answer: str | None = None
    max_tokens: int = 1


@dataclass(frozen=True)
class Camera:
    """A video played into one stream. ``frames``: ``[T, H, W, 3]`` uint8."""

    name: str
    frames: np.ndarray = field(repr=False)
    fps: float
    push_frames: int
    questions: tuple[Question, ...] = ()
    start_delay_s: float = 0.0

    @property
    def num_pushes(self) -> int:
        return -(-len(self.frames) // self.push_frames)

    @property
    def push_interval_s(self) -> float:
        return self.push_frames / self.fps


@dataclass
class Answer:
    """One question's outcome: the answer text (``None`` if it failed), its time to first token, the stream's
    age (seconds of video streamed) when asked, and the error if any."""

    camera: str
    question: str
    right: str | None
    text: str | None
    ttft_s: float | None
    age_s: float
    error: str | None = None

    @property
    def correct(self) -> bool:
        return self.text is not None and self.right is not None and self.text.strip() == self.right


@dataclass
class CameraRun:
    """What one camera did: pushes done, the worst lag behind real time, its answers, and why it stopped."""

    camera: str
    pushes: int = 0
    planned_pushes: int = 0
    max_lag_s: float = 0.0
    push_seconds: list[float] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    ended: str | None = None
    kept_pace: bool = True
    stream_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_camera(client: StreamClient, camera: Camera, t0: float, *, close: bool = True,
               on_push: Callable[[CameraRun], None] | None = None) -> CameraRun:
    """Play ``camera`` into a new stream in real time from ``t0`` (``time.monotonic()``); never raises.

    ``client.timeout`` is the stall timeout: a push or question unanswered for that long ends the camera.
    """
    run = CameraRun(camera=camera.name, planned_pushes=camera.num_pushes)
    interval = camera.push_interval_s
    try:
        stream = client.open(metadata={"camera": camera.name})
    except StreamAPIError as exc:
        run.ended, run.kept_pace = f"refused ({exc.status}): {exc.message}", False
        run.answers = [Answer(camera.name, q.text, q.answer, None, None, q.after_push * interval,
                              error=f"refused ({exc.status})") for q in camera.questions]
        return run
    run.stream_id = stream.id
    questions = {q.after_push: q for q in camera.questions}
    try:
        for i in range(camera.num_pushes):
            due = t0 + camera.start_delay_s + (i + 1) * interval  # the push's last frame arrives now
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            clip = camera.frames[i * camera.push_frames:(i + 1) * camera.push_frames]
            sent = time.monotonic()
            stream.append(clip)
            done = time.monotonic()
            run.pushes += 1
            run.push_seconds.append(done - sent)
            run.max_lag_s = max(run.max_lag_s, done - due)
            if done - due > interval:
                run.kept_pace = False
            if (q := questions.get(i + 1)) is not None:
                run.answers.append(_ask(stream, camera, q, age_s=(i + 1) * interval))
            if on_push:
                on_push(run)
    except (StreamAPIError, OSError) as exc:
        run.ended = exc.message if isinstance(exc, StreamAPIError) else \
            f"stalled: no answer from the server within {client.timeout:g} s"
        run.kept_pace = False
        for q in camera.questions:
            if not any(a.question == q.text for a in run.answers):  # never asked: the stream ended first
                run.answers.append(Answer(camera.name, q.text, q.answer, None, None, q.after_push * interval,
                                          error=run.ended))
    finally:
        if close:
            with contextlib.suppress(StreamAPIError, OSError):
                stream.close()
    return run


def _ask(stream: Any, camera: Camera, q: Question, age_s: float) -> Answer:
    sent = time.monotonic()
    ttft = None
    parts: list[str] = []
    try:
        for piece in stream.ask(q.text, max_tokens=q.max_tokens, stream_answer=True):
            if ttft is None:
                ttft = time.monotonic() - sent
            parts.append(piece)
    except StreamAPIError as exc:
        return Answer(camera.name, q.text, q.answer, None, None, age_s, error=exc.message)
    except OSError:
        raise  # a stall: the camera ends (see run_camera)
    return Answer(camera.name, q.text, q.answer, "".join(parts), ttft, age_s)


@dataclass
class Sample:
    """One reading: seconds since start, KV blocks per stream (by camera name), pool blocks in use."""

    t: float
    blocks: dict[str, int]
    pool_in_use: int
    preemptions: float


class Sampler:
    """Reads the stream listing and ``/metrics`` every ``period`` seconds in a daemon thread."""

    def __init__(self, client: StreamClient, base_url: str, total_blocks: int, period: float = 0.5) -> None:
        self.client, self.base_url, self.total_blocks, self.period = client, base_url, total_blocks, period
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> Sampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self.client.list()
                metrics = scrape(self.base_url)
            except Exception:  # a reading lost while the server is busy is skipped, not fatal
                self._stop.wait(self.period)
                continue
            blocks = {s["metadata"].get("camera", s["id"]): s["kv"]["blocks"] for s in listing if s.get("kv")}
            in_use = round(self.total_blocks * metrics.get("vllm:kv_cache_usage_perc", 0.0))
            self.samples.append(Sample(time.monotonic() - self._t0, blocks, in_use,
                                       metrics.get("vllm:num_preemptions_total", 0.0)))
            self._stop.wait(self.period)


@dataclass
class LiveRun:
    """One policy's run: its cameras, the sampler's readings, the pool size and the wall time."""

    label: str
    cameras: list[CameraRun]
    samples: list[Sample]
    pool_blocks: int
    wall_s: float

    @property
    def sustained(self) -> int:
        """Cameras that kept pace to their last push."""
        return sum(1 for c in self.cameras if c.kept_pace and c.pushes == c.planned_pushes)

    @property
    def answers(self) -> list[Answer]:
        return [a for c in self.cameras for a in c.answers]

    def peak_blocks_per_stream(self) -> int:
        return max((b for s in self.samples for b in s.blocks.values()), default=0)

    def preemptions(self) -> int:
        if not self.samples:
            return 0
        return int(self.samples[-1].preemptions - self.samples[0].preemptions)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "pool_blocks": self.pool_blocks, "wall_s": self.wall_s,
                "sustained": self.sustained, "preemptions": self.preemptions(),
                "peak_blocks_per_stream": self.peak_blocks_per_stream(),
                "cameras": [c.to_json() for c in self.cameras], "samples": [asdict(s) for s in self.samples]}


def run_cameras(base_url: str, cameras: Sequence[Camera], label: str, *, total_blocks: int,
                api_key: str | None = None, period: float = 0.5, stall_timeout_s: float = 20.0,
                on_push: Callable[[CameraRun], None] | None = None) -> LiveRun:
    """Play every camera at once, each in its own thread, while sampling the server."""
    client = StreamClient(base_url, api_key=api_key, timeout=60)
    runs: list[CameraRun | None] = [None] * len(cameras)
    t0 = time.monotonic()

    def play(i: int) -> None:
        camera_client = StreamClient(base_url, api_key=api_key, timeout=stall_timeout_s)
        runs[i] = run_camera(camera_client, cameras[i], t0, on_push=on_push)

    threads = [threading.Thread(target=play, args=(i,), daemon=True) for i in range(len(cameras))]
    with Sampler(client, base_url, total_blocks, period) as sampler:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(period)
    return LiveRun(label, [r for r in runs if r is not None], sampler.samples, total_blocks,
                   time.monotonic() - t0)


def plot_kv_per_stream(runs: Sequence[LiveRun], path: Path, title: str = "KV held per stream") -> Path:
    """One panel per run: blocks each stream holds over time, and the pool's blocks in use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.8), sharey=True, squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        names = sorted({n for s in run.samples for n in s.blocks}, key=lambda n: (len(n), n))
        for name in names:
            pts = [(s.t, s.blocks[name]) for s in run.samples if name in s.blocks]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, label=name)
        ax.plot([s.t for s in run.samples], [s.pool_in_use for s in run.samples], "k--", lw=1.5,
                label="pool in use")
        ax.axhline(run.pool_blocks, color="red", lw=0.8, ls=":", label="pool size")
        ax.set_title(f"{run.label}: {run.sustained}/{len(run.cameras)} streams kept pace")
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("KV blocks")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
