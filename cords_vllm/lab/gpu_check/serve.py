"""One server's run in the GPU check: start it, send it the workload (video chats and a live stream), read its
``/metrics``, check every KV block comes back, stop it; one row per step."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cords_vllm.lab.gpu_check.processes import first_error
from cords_vllm.lab.gpu_check.rows import FAIL, PASS, SKIP, Fail, Row, Skip, timed
from cords_vllm.lab.gpu_check.settings import QUESTION, ServerSpec, Workload


@dataclass(frozen=True)
class Answer:
    """One greedy answer: its tokens, each one's log-probability and the top two candidates at each position
    (token text -> log-probability)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[str, float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


@dataclass
class ServerRun:
    """What one server did: its rows, and the greedy tokens of its short videos (for the comparison)."""

    spec: ServerSpec
    rows: list[Row] = field(default_factory=list)
    short_answers: list[Answer] | None = None


def engine_settings(log: str) -> str:
    """The settings the server's log names: attention backend, CUDA graph mode, KV cache dtype."""
    found = []
    if backend := re.search(r"Using (\S+) attention backend out of", log):
        found.append(f"attention {backend.group(1)}")
    if graphs := re.search(r"'cudagraph_mode': <CUDAGraphMode\.(\w+)", log):
        found.append(f"cudagraph {graphs.group(1)}")
    if dtype := re.search(r"kv_cache_dtype=(\w+)", log):
        found.append(f"kv {dtype.group(1)}")
    if "Using V2 Model Runner" in log:
        found.append("Model Runner V2")
    return ", ".join(found)


def _chat(server: Any, model: str, frames: Any, max_tokens: int) -> Answer:
    from cords_vllm.lab.synthetic import jpeg_frames_data_url

    status, body = server.post_json("/v1/chat/completions", {
        "model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
        "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": jpeg_frames_data_url(frames)}},
            {"type": "text", "text": QUESTION}]}]})
    if status != 200:
        raise Fail(f"HTTP {status}: {str(body)[:200]}")
    choice = body["choices"][0]
    tokens = choice.get("token_ids")
    if tokens is None or len(tokens) != max_tokens:
        raise Fail(f"expected {max_tokens} tokens, got {tokens!r}")
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != max_tokens:
        raise Fail(f"expected {max_tokens} log-probabilities, got {len(content)}")
    return Answer(list(tokens), [c["logprob"] for c in content],
                  [{t["token"]: t["logprob"] for t in c.get("top_logprobs") or []} for c in content],
                  [c["token"] for c in content])


def _stream(server: Any, workload: Workload, compressed: bool) -> str:
    from cords_vllm.client import StreamClient
    from cords_vllm.integration.handoff.published import await_published
    from cords_vllm.lab.synthetic import make_video, video_tokens

    client = StreamClient(server.base_url, timeout=300)
    with client.open(metadata={"check": "gpu-check"}) as stream:
        for push in range(workload.stream_pushes):
            frames = make_video(workload.stream_frames, workload.size, workload.size, seed=100 + push).frames
            stream.append(frames)
        answer = client.request("POST", f"/v1/streams/{stream.id}/ask",
                                {"question": QUESTION, "max_tokens": workload.max_tokens})
        got = answer["usage"]["completion_tokens"]
        if not 1 <= got <= workload.max_tokens or answer["choices"][0]["finish_reason"] not in ("length", "stop"):
            raise Fail(f"the stream's answer is {answer}")
        sent = workload.stream_pushes * video_tokens(workload.stream_frames, workload.size, workload.size)
        info = await_published(stream.refresh, lambda i: (i.get("kv") or {}).get("stream_tokens", 0) >= sent)
        kv = info["kv"]
        held = f"holds {kv['tokens']} of its {kv['stream_tokens']} tokens in {kv['blocks']} blocks"
        if compressed and kv["tokens"] >= kv["stream_tokens"]:
            raise Fail(f"the stream was never compressed: it {held}")
    return f"{workload.stream_pushes} pushes of {workload.stream_frames} frames, {got} answer tokens; it {held}"


def run_server(spec: ServerSpec, model_dir: str, workload: Workload, out: Path,
               env: dict[str, str] | None = None) -> ServerRun:
    """Start ``spec``'s server (``env`` added to its environment), send it the workload, read its metrics,
    check its blocks come back, stop it."""
    from cords_vllm.lab.serving.process import VLLMServer

    run = ServerRun(spec)
    names = ["serve", "video chats", "live stream", "/metrics compressions", "KV blocks returned"]
    if spec.unavailable:
        run.rows = [Row(f"{spec.label}: {n}", SKIP, 0.0, spec.unavailable) for n in names]
        return run
    server = VLLMServer(model_dir, spec.args(), env={**spec.env, **(env or {})}, startup_timeout=600.0)
    rows = run.rows

    def serve() -> str:
        try:
            server.start()
        except (RuntimeError, TimeoutError) as exc:  # its message carries the log's tail: name the first error
            log = Path(server.log_path).read_text(errors="replace")
            raise Fail(f"{str(exc).splitlines()[0]} {first_error(log)} (the server log says so)") from None
        return f"up on {server.base_url}; {engine_settings(Path(server.log_path).read_text(errors='replace'))}"

    rows.append(timed(f"{spec.label}: serve", serve))
    try:
        if rows[-1].result != PASS:
            rows.extend(Row(f"{spec.label}: {n}", SKIP, 0.0, "the server did not start") for n in names[1:])
            return run
        try:
            _workload_rows(run, server, workload)
        except Exception as exc:  # e.g. the server died between two steps: the steps not done fail with it
            done = {r.step for r in rows}
            rows.extend(Row(step, FAIL, 0.0, f"{type(exc).__name__}: {exc}") for n in names[1:]
                        if (step := f"{spec.label}: {n}") not in done)
    finally:
        stop = timed(f"{spec.label}: stop", lambda: f"exit status {server.stop()}")
        if stop.result != PASS:
            rows.append(stop)
        shutil.copyfile(server.log_path, out / f"serve-{re.sub(r'[^a-z0-9]+', '-', spec.label.lower())}.log")
        if any(r.result == FAIL for r in rows):
            log = Path(server.log_path).read_text(errors="replace")
            rows[:] = [_with_cause(r, log) for r in rows]
    return run


def _with_cause(row: Row, log: str) -> Row:
    """A failed row of a server whose log names an error gets that error appended."""
    if row.result != FAIL or "the server log says" in row.detail:
        return row
    cause = first_error(log)
    if not re.search(r"(Error|Exception|Exit)\b", cause):
        return row
    return Row(row.step, row.result, row.seconds, f"{row.detail} (the server log says {cause})")


def _workload_rows(run: ServerRun, server: Any, workload: Workload) -> None:
    from cords_vllm.integration.handoff.published import await_published
    from cords_vllm.lab.bench.http import scrape
    from cords_vllm.lab.synthetic import make_video

    spec, label = run.spec, run.spec.label
    model = server.model_id()
    short = [make_video(workload.short_frames, workload.size, workload.size, seed=s).frames
             for s in range(workload.short)]
    long = [make_video(workload.long_frames, workload.size, workload.size, seed=50 + s).frames
            for s in range(workload.long)]
    compressed = spec.policy not in (None, "none")
    before = scrape(server.base_url).get("cords_vllm_compressions_total", 0.0)

    def chats() -> str:
        # the short videos alone first, one at a time: the answers the servers' comparison uses (each request
        # alone in its batch, so no server's batch mix moves a bf16 sum), then everything at once
        run.short_answers = [_chat(server, model, f, workload.max_tokens) for f in short]
        with concurrent.futures.ThreadPoolExecutor(len(short) + len(long)) as pool:
            futures = [pool.submit(_chat, server, model, f, workload.max_tokens) for f in [*short, *long]]
            for f in futures:
                f.result()
        return (f"{len(short)} videos of {workload.short_frames} frames (under the budget) one at a time, then "
                f"with {len(long)} of {workload.long_frames} at once, {workload.max_tokens} greedy tokens each")

    def stream() -> str:
        if spec.policy is None:
            raise Skip("plain vLLM has no /v1/streams (the control)")
        return _stream(server, workload, compressed)

    # The chats and the stream run at the same time, each timed on its own.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chat_row = pool.submit(timed, f"{label}: video chats", chats)
        stream_row = pool.submit(timed, f"{label}: live stream", stream)
        run.rows += [chat_row.result(), stream_row.result()]

    def compressions() -> str:
        if spec.policy is None:
            if any(name.startswith("cords_vllm_") for name in scrape(server.base_url)):
                raise Fail("plain vLLM's /metrics has cords_vllm_ series: the plugin was loaded")
            return "no cords_vllm_ series: the plugin is not loaded (the control)"
        if not compressed:
            count = scrape(server.base_url).get("cords_vllm_compressions_total", 0.0) - before
            if count:
                raise Fail(f"--kv-policy none compressed {count:g} times")
            return "0 under --kv-policy none, as expected"
        try:
            metrics = await_published(lambda: scrape(server.base_url),
                                      lambda m: m.get("cords_vllm_compressions_total", 0.0) > before)
        except TimeoutError:
            raise Fail("cords_vllm_compressions_total stayed at 0") from None
        names = ("compressions", "evicted_tokens", "kept_tokens", "selection_seconds")
        return ", ".join(f"{n} {metrics.get(f'cords_vllm_{n}_total', 0.0):.4g}" for n in names)

    def blocks_returned() -> str:
        if server.proc is None or server.proc.poll() is not None:
            raise Fail("the server is no longer running")
        deadline = time.monotonic() + 30
        while True:
            usage = scrape(server.base_url).get("vllm:kv_cache_usage_perc")
            if spec.policy is None:
                status, open_streams = 200, 0  # no stream API
            else:
                status, text = server.get("/v1/streams")
                open_streams = len(json.loads(text).get("data", [])) if status == 200 else None
            if usage == 0.0 and open_streams == 0:
                peak = scrape(server.base_url).get("cords_vllm_request_kv_blocks_peak", 0.0)
                return f"vllm:kv_cache_usage_perc 0, no stream open (a request held at most {peak:g} blocks)"
            if time.monotonic() > deadline:
                raise Fail(f"30 s after the last request: vllm:kv_cache_usage_perc {usage}, open streams "
                           f"{open_streams} (GET /v1/streams: HTTP {status})")
            time.sleep(0.5)

    run.rows.append(timed(f"{label}: /metrics compressions", compressions))
    run.rows.append(timed(f"{label}: KV blocks returned", blocks_returned))
