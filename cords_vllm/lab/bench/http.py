"""Drive a running ``vllm serve`` (any policy) over HTTP and read its own metrics."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cords_vllm.integration.handoff.published import PUBLISH_INTERVAL_S
from cords_vllm.lab.bench.offline import PolicyResult
from cords_vllm.lab.bench.workload import VideoWorkload, VQAWorkload
from cords_vllm.lab.synthetic import jpeg_frames_data_url


def _metrics_text(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def num_gpu_blocks(base_url: str) -> int:
    """The server's KV pool size, from vLLM's ``cache_config_info`` metric."""
    match = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', _metrics_text(base_url))
    if match is None:
        raise RuntimeError(f"{base_url}/metrics has no cache_config_info with num_gpu_blocks")
    return int(match.group(1))


def scrape(base_url: str) -> dict[str, float]:
    """Sum of each metric family on ``/metrics`` (labels ignored)."""
    text = _metrics_text(base_url)
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if match and match.group(3) != "NaN":
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals


def run_http(base_url: str, label: str, workload: VideoWorkload | VQAWorkload,
             on_progress: Callable[[int], None] | None = None, poll_seconds: float = 0.25,
             min_prompt_tokens: int | None = None) -> PolicyResult:
    """Send the workload to ``base_url`` (streaming chat completions) and measure it.

    Blocks in use and running requests are sampled from ``/metrics`` every ``poll_seconds``. A prompt shorter than
    ``min_prompt_tokens`` (default: the video's tokens; lower it for a server that prunes video tokens) means the
    server sampled the frames: ``RuntimeError``.
    """
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    requests = workload.requests()
    urls = {r.request_id: jpeg_frames_data_url(r.frames) for r in requests}
    before = scrape(base_url)
    total_blocks = num_gpu_blocks(base_url) - 1  # block 0 is the null block
    timeline: list[tuple[float, int, int]] = []
    stop = threading.Event()
    t0 = time.perf_counter()
    poller = threading.Thread(target=_sample_blocks, args=(base_url, total_blocks, t0, poll_seconds, timeline, stop),
                              daemon=True)
    poller.start()
    tally = _Tally()

    def one(request):
        time.sleep(max(0.0, request.arrival - (time.perf_counter() - t0)))
        sent = time.perf_counter()
        stream = client.chat.completions.create(
            model=model, temperature=0.0, max_tokens=workload.max_tokens, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
            messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": urls[request.request_id]}},
                {"type": "text", "text": request.question}]}])
        tally.read(request.request_id, stream, sent)
        if on_progress:
            on_progress(1)

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        list(pool.map(one, requests))
    wall = time.perf_counter() - t0
    stop.set()
    poller.join()
    time.sleep(2 * PUBLISH_INTERVAL_S)  # the plugin publishes its counters at most this late
    after = scrape(base_url)
    _check_every_frame_read(tally.usage, workload, min_prompt_tokens)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    return PolicyResult(
        label=label, policy=label, config={}, num_requests=len(requests), wall_seconds=wall,
        prompt_tokens=tally.usage["prompt"], output_tokens=tally.usage["output"], ttft_seconds=tally.ttft,
        peak_running=max((r for _, _, r in timeline), default=0),
        peak_blocks_in_use=max((b for _, b, _ in timeline), default=0), total_blocks=total_blocks,
        preemptions=int(delta("vllm:num_preemptions_total")),
        compressions=int(delta("cords_vllm_compressions_total")),
        selection_seconds=delta("cords_vllm_selection_seconds_total"), timeline=timeline, answers=tally.texts,
    )


def _sample_blocks(base_url: str, total_blocks: int, t0: float, poll_seconds: float,
                   timeline: list[tuple[float, int, int]], stop: threading.Event) -> None:
    """Until ``stop``: every ``poll_seconds``, append ``(seconds since t0, KV blocks in use, running requests)``
    read from ``/metrics`` to ``timeline``."""
    while not stop.is_set():
        m = scrape(base_url)
        # kv_cache_usage_perc is a fraction of the pool in vLLM 0.32
        in_use = round(total_blocks * m.get("vllm:kv_cache_usage_perc", 0.0))
        timeline.append((time.perf_counter() - t0, in_use, int(m.get("vllm:num_requests_running", 0))))
        stop.wait(poll_seconds)


class _Tally:
    """What the workload's streamed answers add up to, read by the request threads at once: each answer's text,
    time to its first token, and the tokens used (``fewest_prompt``: the shortest prompt)."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.texts: dict[str, str] = {}
        self.usage = {"prompt": 0, "output": 0}
        self.lock = threading.Lock()

    def read(self, request_id: str, stream: Any, sent: float) -> None:
        """Read one streamed answer to its end (``sent``: when its request was sent) and add it."""
        first = None
        parts = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if first is None:
                    first = time.perf_counter() - sent
            if chunk.usage:
                with self.lock:
                    self.usage["prompt"] += chunk.usage.prompt_tokens
                    self.usage["output"] += chunk.usage.completion_tokens
                    self.usage["fewest_prompt"] = min(self.usage.get("fewest_prompt", chunk.usage.prompt_tokens),
                                                      chunk.usage.prompt_tokens)
        with self.lock:
            self.texts[request_id] = "".join(parts)
            if first is not None:
                self.ttft.append(first)


def _check_every_frame_read(usage: dict[str, int], workload: VideoWorkload | VQAWorkload,
                            min_prompt_tokens: int | None) -> None:
    """``RuntimeError`` when the shortest prompt is under ``min_prompt_tokens`` (default: the video's tokens): the
    server sampled the frames."""
    least = workload.video_tokens if min_prompt_tokens is None else min_prompt_tokens
    if usage.get("fewest_prompt", least) < least:
        raise RuntimeError(
            f"the server read a {usage['fewest_prompt']}-token prompt for a video of {workload.video_tokens} "
            f"tokens ({workload.frames} frames): it sampled the frames (vLLM keeps 32 by default). Start it "
            """with --media-io-kwargs '{"video": {"num_frames": -1}}' to keep every frame.""")
