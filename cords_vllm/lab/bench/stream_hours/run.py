"""One policy's hours-long stream: serve it, push the video into one stream, ask the questions, and record KV held,
server memory, CPU and wall time per push."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cords_vllm.lab.bench.stream_hours.plan import HoursConfig, Question, StreamVideo
from cords_vllm.lab.bench.stream_hours.records import PolicyRun, PushRecord, QuestionRecord
from cords_vllm.lab.bench.stream_hours.serve import serve_flags
from cords_vllm.lab.vqa.video import COLOUR_NAMES


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
