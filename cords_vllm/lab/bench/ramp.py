"""How many live camera streams a server keeps in real time: a ramp of stream counts, then a hold at the knee.

A :class:`Fleet` plays cameras into ``/v1/streams``, each in its own thread: it opens a stream, optionally sends a
*pre-roll* (the camera's buffered history, pushed back to back, so that a compressing policy starts at its
budget), then pushes ``push_frames`` frames every ``push_frames / fps`` seconds, each push due when its last frame
"arrives". A push is *late* when it is answered more than one push interval after it was due: the camera no longer
keeps pace. Frames are a shared clip stamped with the camera and push numbers (:class:`StampedFrames`), so no two
pushes carry the same bytes (vLLM's multimodal caches key on them) and memory stays flat whatever the count.

:func:`run_ramp` raises the count level by level (``levels``), and at each level measures over a window, after the
new cameras' pre-rolls: late pushes, refusals, the plugin's compressions and their device seconds (its share of the
wall clock), the pool's use and the engine's waiting requests from ``/metrics``, the CPU of the API server, the
engine and this client (:class:`ProcessCPU`), and the inter-token gaps of a concurrent chat request
(:class:`ChatProbe`). The first level with a late push or a refused stream is the knee's upper side; the fleet
is then cut back to the level below and *held* for ``hold_s``: if a push is late during the hold, the newest
tenth of the cameras is closed and the hold starts again, until it passes or the time runs out. What ran out
first at the failing level is named by :func:`limiting_resource` (pure).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cords_vllm.client import StreamAPIError, StreamClient
from cords_vllm.lab.bench.http import scrape

#: ``/metrics`` families a level reads (summed over labels).
COMPRESSIONS = "cords_vllm_compressions_total"
COMPRESS_SECONDS = "cords_vllm_selection_seconds_total"
POOL_USE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
#: A process this busy (cores, over the window) is called saturated.
SATURATED_CORES = 0.9


class StampedFrames:
    """An endless camera over a shared clip: ``clip(k, n)`` is push ``k``'s ``n`` frames ``[n, H, W, 3]`` uint8,
    copies of the base clip's frames with the camera and push numbers written into their first row."""

    def __init__(self, base: np.ndarray, camera: int) -> None:
        if base.ndim != 4 or base.shape[-1] != 3 or base.dtype != np.uint8:
            raise ValueError(f"base clip must be uint8 [T, H, W, 3], got {base.dtype} {tuple(base.shape)}")
        self.base, self.camera = base, camera

    def clip(self, push: int, frames: int) -> np.ndarray:
        idx = [(push * frames + i) % len(self.base) for i in range(frames)]
        out = self.base[idx].copy()
        stamp = np.frombuffer(np.array([self.camera, push], dtype=">u4").tobytes(), np.uint8)
        out[:, 0, : len(stamp), :] = stamp[None, :, None]
        return out


@dataclass(frozen=True)
class PushEvent:
    """One answered push: the camera, when it was answered (monotonic s) and how late (s after it was due)."""

    camera: int
    done: float
    lag_s: float


@dataclass
class CameraState:
    """One camera's thread and outcome."""

    index: int
    stop: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)  # opened and pre-rolled (or failed)
    thread: threading.Thread | None = None
    refused: str | None = None
    ended: str | None = None


class Fleet:
    """Cameras playing into one server; :meth:`grow` and :meth:`shrink` change how many, :meth:`close` ends all.

    ``preroll_pushes`` pushes are sent back to back when a camera opens, then one push every ``push_frames / fps``
    seconds. ``stall_timeout_s``: a push unanswered this long ends the camera (as ended, not as late).
    """

    def __init__(self, base_url: str, base_clip: np.ndarray, *, fps: float, push_frames: int,
                 preroll_pushes: int = 0, stall_timeout_s: float = 60.0, api_key: str | None = None) -> None:
        if fps <= 0 or push_frames < 1 or preroll_pushes < 0:
            raise ValueError(f"need fps > 0, push_frames >= 1, preroll_pushes >= 0; got {fps}, {push_frames}, "
                             f"{preroll_pushes}")
        self.base_url, self.base_clip = base_url, base_clip
        self.fps, self.push_frames, self.preroll_pushes = fps, push_frames, preroll_pushes
        self.stall_timeout_s, self.api_key = stall_timeout_s, api_key
        self.cameras: list[CameraState] = []
        self.events: list[PushEvent] = []
        self._lock = threading.Lock()

    @property
    def interval_s(self) -> float:
        return self.push_frames / self.fps

    def active(self) -> list[CameraState]:
        return [c for c in self.cameras if not c.stop.is_set() and c.refused is None and c.ended is None]

    def grow(self, count: int, settle_timeout_s: float) -> float:
        """Start cameras until ``count`` are active; wait for their opens and pre-rolls (at most
        ``settle_timeout_s``). Returns the seconds waited."""
        t0 = time.monotonic()
        new = []
        while len(self.active()) + len(new) < count:
            cam = CameraState(len(self.cameras))
            cam.thread = threading.Thread(target=self._play, args=(cam,), daemon=True, name=f"camera-{cam.index}")
            self.cameras.append(cam)
            new.append(cam)
            cam.thread.start()
        for cam in new:
            cam.ready.wait(max(0.0, settle_timeout_s - (time.monotonic() - t0)))
        return time.monotonic() - t0

    def shrink(self, count: int) -> None:
        """Close the newest active cameras until ``count`` remain."""
        for cam in reversed(self.active()[count:]):
            cam.stop.set()

    def close(self, timeout_s: float = 30.0) -> None:
        for cam in self.cameras:
            cam.stop.set()
        deadline = time.monotonic() + timeout_s
        for cam in self.cameras:
            if cam.thread is not None:
                cam.thread.join(max(0.0, deadline - time.monotonic()))

    def events_between(self, start: float, end: float) -> list[PushEvent]:
        with self._lock:
            return [e for e in self.events if start <= e.done < end]

    def _play(self, cam: CameraState) -> None:
        client = StreamClient(self.base_url, api_key=self.api_key, timeout=self.stall_timeout_s)
        frames = StampedFrames(self.base_clip, cam.index)
        try:
            stream = client.open(metadata={"camera": f"c{cam.index}"})
        except (StreamAPIError, OSError) as exc:
            cam.refused = f"{exc.status}: {exc.message}" if isinstance(exc, StreamAPIError) else f"{exc}"
            cam.ready.set()
            return
        try:
            for k in range(self.preroll_pushes):
                if cam.stop.is_set():
                    return
                stream.append(frames.clip(k, self.push_frames))
            cam.ready.set()
            start = time.monotonic()
            push = self.preroll_pushes
            while True:
                due = start + (push - self.preroll_pushes + 1) * self.interval_s
                if cam.stop.wait(max(0.0, due - time.monotonic())):
                    return
                stream.append(frames.clip(push, self.push_frames))
                done = time.monotonic()
                with self._lock:
                    self.events.append(PushEvent(cam.index, done, done - due))
                push += 1
        except (StreamAPIError, OSError) as exc:
            cam.ended = exc.message if isinstance(exc, StreamAPIError) else \
                f"stalled: no answer within {self.stall_timeout_s:g} s"
        finally:
            cam.ready.set()
            with contextlib.suppress(StreamAPIError, OSError):
                stream.close()


class ChatProbe:
    """A chat client beside the cameras: one streamed text completion after another, timing each token's arrival.

    :meth:`gaps_between` gives the inter-token gaps (seconds) of tokens that arrived in a window.
    """

    def __init__(self, base_url: str, *, prompt: str = "Describe a busy street.", max_tokens: int = 64,
                 api_key: str | None = None) -> None:
        self.base_url, self.prompt, self.max_tokens, self.api_key = base_url, prompt, max_tokens, api_key
        self.arrivals: list[tuple[float, float]] = []  # (arrival, gap since the previous token of its request)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chat-probe")
        self._lock = threading.Lock()

    def __enter__(self) -> ChatProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def gaps_between(self, start: float, end: float) -> list[float]:
        with self._lock:
            return [gap for t, gap in self.arrivals if start <= t < end]

    def _run(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                        timeout=120)
        model = client.models.list().data[0].id
        while not self._stop.is_set():
            try:
                previous = None
                for chunk in client.completions.create(model=model, prompt=self.prompt, max_tokens=self.max_tokens,
                                                       temperature=0.0, stream=True,
                                                       extra_body={"ignore_eos": True}):
                    now = time.monotonic()
                    if chunk.choices and previous is not None:
                        with self._lock:
                            self.arrivals.append((now, now - previous))
                    previous = now
            except Exception as exc:  # a failed request is counted, and the probe goes on
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                self._stop.wait(1.0)


class ProcessCPU:
    """CPU cores a process used between two readings; with ``children``, its descendants' instead (the engine's
    processes under an API server, read apart from the server itself)."""

    def __init__(self, pid: int, *, children: bool = False) -> None:
        import psutil

        self.process, self.children = psutil.Process(pid), children
        self._last = self._read()

    def _read(self) -> tuple[float, float]:
        import psutil

        procs = [self.process]
        if self.children:
            with contextlib.suppress(psutil.Error):
                procs = self.process.children(recursive=True)
        busy = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                busy += t.user + t.system
        return time.monotonic(), busy

    def cores(self) -> float:
        """Cores used since the previous call (or creation)."""
        now, busy = self._read()
        then, before = self._last
        self._last = (now, busy)
        return max(0.0, busy - before) / max(now - then, 1e-9)


@dataclass
class Level:
    """What one level measured over its window."""

    streams: int
    window_s: float
    settle_s: float
    pushes: int
    late_pushes: int
    worst_lag_s: float
    refused: int
    ended: int
    compressions: float
    compress_s: float
    pool_use: float
    waiting: float
    cpu_cores: dict[str, float]
    chat_gaps: int
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    reasons: list[str] = field(default_factory=list)

    @property
    def kept_pace(self) -> bool:
        return self.late_pushes == 0 and self.refused == 0 and self.ended == 0 and self.pushes > 0

    @property
    def compress_share(self) -> float:
        """Share of the wall clock the device spent compressing (the plugin's own timing)."""
        return self.compress_s / self.window_s if self.window_s > 0 else 0.0

    @property
    def ms_per_compression(self) -> float | None:
        return 1e3 * self.compress_s / self.compressions if self.compressions else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kept_pace": self.kept_pace, "compress_share": self.compress_share,
                "ms_per_compression": self.ms_per_compression}


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if len(values) else None


def limiting_resource(level: Level, *, cores: float | None = None) -> str:
    """What ran out first at a level that did not keep pace (pure).

    In order: the KV pool (a stream refused for room), no push answered at all, a stream the server ended, every
    core of the machine busy (``cores``: how many it has; a shared CPU run out), the API server's CPU (it decodes
    every frame), this client's CPU (it encodes them), the engine (requests waiting for it: GPU compute on a GPU,
    the engine's cores on a CPU); else ``"undetermined"``.
    """
    if level.refused:
        return "KV pool (streams refused for room)"
    if not level.pushes:
        return "no push answered within the window (the server stalled)"
    if level.ended:
        return "streams ended by the server: " + "; ".join(level.reasons[:2])
    cpu = level.cpu_cores
    if cores is not None and sum(cpu.values()) >= SATURATED_CORES * cores:
        return f"CPU (all {cores} cores busy)"
    if cpu.get("api_server", 0.0) >= SATURATED_CORES:
        return "API server's CPU (decoding frames)"
    if cpu.get("client", 0.0) >= SATURATED_CORES:
        return "benchmark client's CPU (encoding frames)"
    if level.waiting > 0 or level.pool_use >= 0.95:
        return "engine compute (requests waiting for the GPU)"
    return "undetermined"


@dataclass
class RampResult:
    """The ramp's levels, the count held, the first failing level's cause."""

    levels: list[Level]
    held: int | None
    hold: list[Level]
    limit: str | None
    fps: float
    push_frames: int
    preroll_pushes: int

    @property
    def knee(self) -> int | None:
        """The most streams a level kept pace with (``None``: not even the first)."""
        ok = [lv.streams for lv in self.levels if lv.kept_pace]
        return max(ok) if ok else None

    def level_at(self, streams: int) -> Level | None:
        return next((lv for lv in self.levels if lv.streams == streams), None)

    def to_json(self) -> dict[str, Any]:
        return {"levels": [lv.to_json() for lv in self.levels], "hold": [lv.to_json() for lv in self.hold],
                "held": self.held, "knee": self.knee, "limit": self.limit, "fps": self.fps,
                "push_frames": self.push_frames, "preroll_pushes": self.preroll_pushes}


class Meter:
    """Reads everything a level needs at its window's two ends."""

    def __init__(self, base_url: str, fleet: Fleet, probe: ChatProbe | None,
                 cpus: dict[str, ProcessCPU]) -> None:
        self.base_url, self.fleet, self.probe, self.cpus = base_url, fleet, probe, cpus

    def outcomes(self) -> dict[int, tuple[str | None, str | None]]:
        """Each camera's ``(refused, ended)`` now: pass it to :meth:`measure` as ``since`` to count what changed
        from here (e.g. before the level's cameras were started)."""
        return {c.index: (c.refused, c.ended) for c in self.fleet.cameras}

    def measure(self, streams: int, window_s: float, settle_s: float,
                since: dict[int, tuple[str | None, str | None]] | None = None,
                sleep: Callable[[float], None] = time.sleep) -> Level:
        """Measure a window of ``window_s`` from now; refusals and ends count from ``since`` (default: now)."""
        for cpu in self.cpus.values():
            cpu.cores()
        before, start = scrape(self.base_url), time.monotonic()
        cameras_before = self.outcomes() if since is None else since
        polls: list[dict[str, float]] = []
        while time.monotonic() - start < window_s:
            sleep(min(1.0, max(0.0, window_s - (time.monotonic() - start))))
            with contextlib.suppress(OSError):
                polls.append(scrape(self.base_url))
        end = time.monotonic()
        after = polls[-1] if polls else scrape(self.base_url)
        events = self.fleet.events_between(start, end)
        interval = self.fleet.interval_s
        fresh = [c for c in self.fleet.cameras if cameras_before.get(c.index, (None, None)) != (c.refused, c.ended)]
        gaps = self.probe.gaps_between(start, end) if self.probe else []
        return Level(
            streams=streams, window_s=end - start, settle_s=settle_s, pushes=len(events),
            late_pushes=sum(e.lag_s > interval for e in events), worst_lag_s=max((e.lag_s for e in events), default=0),
            refused=sum(c.refused is not None for c in fresh), ended=sum(c.ended is not None for c in fresh),
            compressions=after.get(COMPRESSIONS, 0.0) - before.get(COMPRESSIONS, 0.0),
            compress_s=after.get(COMPRESS_SECONDS, 0.0) - before.get(COMPRESS_SECONDS, 0.0),
            pool_use=max((p.get(POOL_USE, 0.0) for p in polls), default=0.0),
            waiting=float(np.mean([p.get(WAITING, 0.0) for p in polls])) if polls else 0.0,
            cpu_cores={name: round(cpu.cores(), 3) for name, cpu in self.cpus.items()},
            chat_gaps=len(gaps), itl_p50_ms=percentile_ms(gaps, 50), itl_p99_ms=percentile_ms(gaps, 99),
            reasons=[c.refused or c.ended or "" for c in fresh][:4])


def run_ramp(fleet: Fleet, meter: Meter, levels: Sequence[int], *, window_s: float, hold_s: float,
             deadline: float, settle_timeout_s: float = 120.0, cores: float | None = None,
             log: Callable[[str], None] = print) -> RampResult:
    """Raise the fleet level by level until one does not keep pace (or ``deadline``, monotonic), then hold the
    level below it for ``hold_s``, shedding a tenth of the streams whenever a push is late."""
    measured: list[Level] = []
    limit = None
    for count in levels:
        if time.monotonic() + settle_timeout_s / 4 + window_s + hold_s > deadline:
            log(f"ramp: stopping before {count} streams (time)")
            break
        since = meter.outcomes()
        settle = fleet.grow(count, settle_timeout_s)
        level = meter.measure(count, window_s, settle, since)
        measured.append(level)
        log(f"ramp: {count:4d} streams  late {level.late_pushes}/{level.pushes}  refused {level.refused}  "
            f"compress {100 * level.compress_share:5.1f}%  chat ITL p99 {level.itl_p99_ms or 0:7.1f} ms  "
            f"pool {100 * level.pool_use:5.1f}%")
        if not level.kept_pace:
            limit = limiting_resource(level, cores=cores)
            log(f"ramp: {count} streams fell behind: {limit}")
            break
    knee = max((lv.streams for lv in measured if lv.kept_pace), default=0)
    hold: list[Level] = []
    held = None
    target = knee
    while target > 0 and time.monotonic() + hold_s <= deadline:
        fleet.shrink(target)
        since = meter.outcomes()
        settle = fleet.grow(target, settle_timeout_s)
        level = meter.measure(target, hold_s, settle, since)
        hold.append(level)
        log(f"hold: {target} streams for {level.window_s:.0f} s: late {level.late_pushes}/{level.pushes}")
        if level.kept_pace:
            held = target
            break
        target -= max(1, target // 10)
    return RampResult(measured, held, hold, limit, fleet.fps, fleet.push_frames, fleet.preroll_pushes)
