"""One check a GPU user runs: install, serve, stream, compare, count, and the CUDA tests, in one table.

``bash scripts/gpu-check.sh`` (which runs ``python -m cords_vllm.lab.gpu_check``) on a CUDA machine:

1. **install** ``.[cuda,dev,ray]`` into its own virtualenv (``--venv``, default ``.venv-cuda``; ``--skip-install``
   uses it, or the running Python, as it is; ``--no-install`` installs nothing and uses what the running Python
   imports, for a GPU host with no network), then continues under that environment's Python;
2. **CUDA device**: the one vLLM will use;
3. **tiny model**: the tests' tiny Qwen2-VL (:func:`~cords_vllm.lab.synthetic.build_tiny_qwen2vl`), bf16;
4. per attention backend the plugin supports on CUDA (:data:`CUDA_BACKENDS`: FLASH_ATTN, TRITON_ATTN):
   ``vllm serve <tiny>`` as plain vLLM with no plugin loaded (the control, :data:`PLAIN_ENV`), with
   ``--kv-policy none`` (vLLM's own runner, Model Runner V2 on CUDA) and with ``--kv-policy cords``; on the first
   backend also ``cords`` with ``--kv-cache-dtype fp8`` and on Ray (the plugin must load in Ray workers through
   its entry point: the worker-side compressions prove it), and with ``--eager`` one ``cords`` server at vLLM's
   default CUDA graphs. Each gets the same concurrent OpenAI chat completions with synthetic videos (some
   shorter than the budget, some longer, so compressed) and one live stream through ``/v1/streams``, then
   ``/metrics`` is read (``cords_vllm_compressions_total > 0`` under ``cords``, no ``cords_vllm_`` series at all
   for plain vLLM) and every KV block must come back (``vllm:kv_cache_usage_perc`` back to 0, no stream open);
5. **none = plain vLLM** and **cords = none**, per backend: the videos shorter than the budget get the same
   greedy tokens, log-probabilities within bf16 noise (:data:`LOGPROB_TOL`);
6. **HF exactness**: the compressed engine (in-process, fp32) equals the HF reference that drops the same
   tokens (:mod:`cords_vllm.lab.reference.exactness`), with every layer compressed and with layer-selective
   compression (layers 0-1 of the tiny model's 4; the reference keeps the others whole);
7. **CUDA-gated tests**: pytest on ``tests/compress`` and every test file skipped without CUDA.
8. **compress-step benchmark**: ``benchmarks/compress_step.py``, the Triton kernels against the PyTorch path and
   the copy floor at a 7B model's shape (the kept tokens must be the same; the speed targets are reported).
9. **a step's compressions together**: ``benchmarks/step_together.py`` at token granularity, a step of 1-8
   compressions together (one greedy run on the fused path) against one after another, per implementation (the
   tokens and caches must be the same; the speed-up is reported).

It prints one summary table (step, PASS / FAIL / SKIP with the reason, seconds), writes it with every server's
log under ``--out``, and exits 1 when any step failed. A failed step never stops the others.

``--cpu`` runs the same steps on vLLM's CPU build in the project's ``.venv``: ``--enforce-eager``, 32-token
blocks and a 64 MiB pool; fp8 KV needs a bf16 model and AVX-512 there. The install and the CUDA tests are
skipped, so is Ray (vLLM's CPU platform refuses it), and the servers start ``--jobs`` at a time (3 by default:
their start-up is mostly imports).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The checkout this module runs from (``scripts/``, ``tests/``, ``pyproject.toml``).
REPO = Path(__file__).resolve().parents[2]

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: Policy settings of the ``cords`` servers: videos of more candidate tokens than this are compressed.
BUDGET, SLACK = 256, 64
#: Flags every server gets.
COMMON_FLAGS = ["--dtype", "bfloat16", "--limit-mm-per-prompt", '{"image": 0, "video": 1}']
#: Flags that keep a CPU server small and fast (a CUDA server runs at vLLM's defaults).
CPU_FLAGS = ["--enforce-eager", "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20),
             "--max-model-len", "8192", "--max-num-batched-tokens", "8192"]
QUESTION = "What color was the square?"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class Skip(Exception):
    """A step that does not apply here; its message is the reason."""


class Fail(Exception):
    """A step whose check failed; its message says what."""


@dataclass
class Row:
    """One line of the summary table."""

    step: str
    result: str
    seconds: float
    detail: str = ""


def timed(step: str, fn: Callable[[], str]) -> Row:
    """Run ``fn`` as ``step``: PASS with its returned detail, SKIP / FAIL on :class:`Skip` / anything raised."""
    start = time.perf_counter()
    try:
        detail, result = fn(), PASS
    except Skip as exc:
        detail, result = str(exc), SKIP
    except Exception as exc:
        detail, result = (str(exc) if isinstance(exc, Fail) else f"{type(exc).__name__}: {exc}"), FAIL
    row = Row(step, result, time.perf_counter() - start, " ".join(detail.split()))
    print(f"gpu-check: {row.result} {row.step} ({row.seconds:.1f} s) {row.detail[:300]}", file=sys.stderr, flush=True)
    return row


def format_table(rows: Sequence[Row], width: int = 150) -> str:
    """The summary table: step, result, seconds, detail (cut to fit ``width`` characters)."""
    name = max([len(r.step) for r in rows] + [4])
    lines = [f"{'step':<{name}}  result  seconds  detail", f"{'-' * name}  ------  -------  ------"]
    room = max(20, width - name - 19)
    for r in rows:
        detail = r.detail if len(r.detail) <= room else r.detail[: room - 3] + "..."
        lines.append(f"{r.step:<{name}}  {r.result:<6}  {r.seconds:7.1f}  {detail}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Settings
@dataclass(frozen=True)
class Workload:
    """What every server is sent, all at once: chat completions with synthetic videos and one live stream.

    ``short`` videos (``short_frames`` frames, 256 tokens at 224 x 224) fit the budget and are compared with
    ``none``; ``long`` ones (1024 tokens) are compressed; the stream pushes ``stream_pushes`` clips of
    ``stream_frames`` frames, then asks once.
    """

    short: int = 2
    long: int = 2
    short_frames: int = 8
    long_frames: int = 32
    size: int = 224
    max_tokens: int = 8
    stream_pushes: int = 4
    stream_frames: int = 8


#: The environment of the control server: vLLM loads no plugin (``VLLM_PLUGINS`` names none), as if cords-vllm's
#: entry points were absent.
PLAIN_ENV = {"VLLM_PLUGINS": ""}
#: The CUDA attention backends the plugin supports that the check serves, each with plain vLLM, ``none`` and
#: ``cords`` (the first also with fp8 KV, on Ray and with vLLM's default CUDA graphs).
CUDA_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")
#: Flags of the CUDA servers, which run side by side on one GPU: a small share of its memory each.
CUDA_FLAGS = ["--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", str(1 << 30), "--max-model-len", "8192"]


@dataclass(frozen=True)
class ServerSpec:
    """One ``vllm serve`` of the check: ``policy`` ``None`` is plain vLLM (the control, no plugin loaded)."""

    label: str
    policy: str | None
    flags: tuple[str, ...]
    #: Why it cannot run here (the rows say SKIP with it), or ``None``.
    unavailable: str | None = None
    #: The attention backend it asks for (``None``: vLLM's choice), the group its comparisons belong to.
    backend: str | None = None

    def args(self) -> list[str]:
        policy = [] if self.policy is None else ["--kv-policy", self.policy]
        if self.policy not in (None, "none"):
            policy += ["--kv-policy-config", json.dumps({"budget": BUDGET, "slack": SLACK})]
        backend = ["--attention-backend", self.backend] if self.backend else []
        if self.backend == "TRITON_ATTN":  # its vision encoder on torch's SDPA: no FlashAttention anywhere
            backend += ["--mm-encoder-attn-backend", "TORCH_SDPA"]
        return [*policy, *COMMON_FLAGS, *backend, *self.flags]

    @property
    def env(self) -> dict[str, str]:
        return dict(PLAIN_ENV) if self.policy is None else {}


def server_specs(cpu: bool, eager: bool = False) -> list[ServerSpec]:
    """The servers. Per attention backend (vLLM's own choice on CPU; each of :data:`CUDA_BACKENDS` on CUDA):
    plain vLLM (the control), ``none`` and ``cords`` (bf16); on the first, ``cords`` with fp8 KV and on Ray too,
    and on CUDA ``cords`` at vLLM's default settings (CUDA graphs) when the others run ``--eager``."""
    base = tuple(CPU_FLAGS) if cpu else (*CUDA_FLAGS, *(["--enforce-eager"] if eager else []))
    fp8_missing = None
    if cpu and not cpu_has_avx512():
        fp8_missing = "fp8 KV on vLLM's CPU build needs AVX-512, which this CPU lacks"
    specs = []
    for i, backend in enumerate([None] if cpu else CUDA_BACKENDS):
        tag = f" {backend}" if backend else ""
        specs += [ServerSpec(f"cords bf16{tag}", "cords", base, backend=backend),
                  ServerSpec(f"none bf16{tag}", "none", base, backend=backend),
                  ServerSpec(f"plain vLLM bf16{tag}", None, base, backend=backend)]
        if i == 0:
            specs += [ServerSpec(f"cords bf16 + fp8 KV{tag}", "cords", (*base, "--kv-cache-dtype", "fp8"), fp8_missing,
                                 backend=backend),
                      ServerSpec(f"cords bf16 + Ray{tag}", "cords", (*base, "--distributed-executor-backend", "ray"),
                                 ray_missing(cpu), backend=backend)]
            if eager and not cpu:
                specs.append(ServerSpec(f"cords bf16 + CUDA graphs{tag}", "cords", tuple(CUDA_FLAGS), backend=backend))
    return specs


def ray_missing(cpu: bool) -> str | None:
    """Why the Ray server cannot run here, or ``None``."""
    if cpu:
        return "vLLM's CPU platform refuses Ray ('current platform cpu does not support ray'); GPU only"
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return "ray is not installed in this environment (pip install '.[ray]')"
    return None


def cpu_has_avx512() -> bool:
    """Whether this (Linux) CPU has AVX-512F."""
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------------
# A server's run
@dataclass
class ServerRun:
    """What one server did: its rows, and the greedy tokens of its short videos (for the comparison)."""

    spec: ServerSpec
    rows: list[Row] = field(default_factory=list)
    short_answers: list[Answer] | None = None


def first_error(log: str) -> str:
    """The first ``SomeError: message`` line of a server log (what ended it), else its last line."""
    for line in log.splitlines():
        if "ulimit" in line:
            continue
        match = re.search(r"\b([A-Z]\w*(?:Error|Exception|Exit)): (.+)$", line)
        if match:
            return f"{match.group(1)}: {match.group(2)}"[:300]
    lines = [line for line in log.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(empty log)"


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


@dataclass(frozen=True)
class Answer:
    """One greedy answer: its tokens, each one's log-probability and the top two candidates at each position
    (token text -> log-probability)."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[str, float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


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


def cpu_binds(jobs: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` values that give ``jobs`` CPU servers running at once cores of their own
    (contiguous groups of the allowed cores; with fewer cores than servers, one core each, in turn)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= jobs:
        size = len(cores) // jobs
        return [",".join(map(str, cores[i * size:(i + 1) * size])) for i in range(jobs)]
    return [str(cores[i % len(cores)]) for i in range(jobs)]


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


#: Greatest log-probability difference between two servers' greedy tokens taken as bf16 noise (batch order and
#: kernel choice reorder bf16 sums).
LOGPROB_TOL = 0.05


def agreement(x: Answer, y: Answer, tol: float = LOGPROB_TOL) -> tuple[float, int | None]:
    """How two servers' greedy answers to one prompt agree: ``(worst log-probability gap, position of a near-tie
    or None)``. They agree when every token is the same and each log-probability is within ``tol``, or up to the
    first position where they chose differently and, there, each one's token is the other's runner-up within
    ``tol`` of its choice (a near-tie that bf16 noise may break either way; past it the answers are not
    comparable). Raises :class:`Fail` otherwise."""
    worst = 0.0
    for k, (s, t) in enumerate(zip(x.tokens, y.tokens, strict=True)):
        if s != t:
            gaps = [abs(x.logprobs[k] - y.top[k].get(x.texts[k], -math.inf)),
                    abs(y.logprobs[k] - x.top[k].get(y.texts[k], -math.inf))]
            if max(gaps) > tol:
                raise Fail(f"tokens differ from position {k}: {x.tokens} against {y.tokens}, and not as a near-tie "
                           f"(each one's choice is {max(gaps):.3g} from the other's)")
            return worst, k
        worst = max(worst, abs(x.logprobs[k] - y.logprobs[k]))
        if worst > tol:
            raise Fail(f"position {k}: log-probabilities {x.logprobs[k]:.4f} against {y.logprobs[k]:.4f}")
    return worst, None


def compare_rows(a: ServerRun, b: ServerRun, why: str = "videos under the budget") -> Row:
    """The comparison row: the short videos (asked one at a time) get the same greedy answers from ``a`` and
    ``b`` (:func:`agreement`)."""
    step = f"answers: {a.spec.label} = {b.spec.label} ({why})"

    def compare() -> str:
        if a.short_answers is None or b.short_answers is None:
            raise Skip("a server's video chats failed")
        worst, ties = 0.0, []
        for i, (x, y) in enumerate(zip(a.short_answers, b.short_answers, strict=True)):
            try:
                gap, tie = agreement(x, y)
            except Fail as exc:
                raise Fail(f"video {i}: {exc}") from None
            worst = max(worst, gap)
            if tie is not None:
                ties.append(f"video {i} at token {tie}")
        same = f"the same {len(a.short_answers[0].tokens)} greedy tokens each"
        if ties:
            same = (f"the same tokens up to a near-tie ({', '.join(ties)}: each server's choice is the other's "
                    "runner-up)")
        return f"{len(a.short_answers)} videos, {same}, log-probabilities within {worst:.2g}"

    return timed(step, compare)


def comparison_rows(runs: Sequence[ServerRun]) -> list[Row]:
    """Per attention backend: ``none`` with the plugin = plain vLLM, and ``cords`` = ``none`` on videos under
    the budget."""
    rows = []
    for backend in dict.fromkeys(r.spec.backend for r in runs):
        group = {r.spec.policy: r for r in runs if r.spec.backend == backend and "+" not in r.spec.label}
        if "none" in group and None in group:
            rows.append(compare_rows(group["none"], group[None], "the plugin loaded, no policy"))
        if "cords" in group and "none" in group:
            rows.append(compare_rows(group["cords"], group["none"]))
    return rows


# ---------------------------------------------------------------------------------------------------------
# The other steps
def _python_env() -> dict[str, str]:
    """Environment of a child Python: offline, its own engine settings and metrics directory."""
    env = {**os.environ, **OFFLINE_ENV}
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "CORDS_VLLM_METRICS_DIR"):
        env.pop(name, None)
    return env


def build_model() -> str:
    """The tests' tiny Qwen2-VL (bf16), built once per machine; returns its directory."""
    from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_qwen2vl

    return str(build_tiny_qwen2vl(TinyModelSpec(dtype="bfloat16")))


def exactness_row(model_dir: str, out: Path, compressed_layers: int | None = None) -> Row:
    """Run :mod:`cords_vllm.lab.reference.exactness` in its own process (it builds an in-process engine);
    ``compressed_layers``: the layer-selective form (the lowest layers compressed, the others whole)."""

    def check() -> str:
        env = {**_python_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CORDS_VLLM_TRACE": "1"}
        scope = [] if compressed_layers is None else ["--compressed-layers", str(compressed_layers)]
        proc = subprocess.run([sys.executable, "-m", "cords_vllm.lab.reference.exactness", model_dir, "--json", *scope],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
        log = "exactness.log" if compressed_layers is None else f"exactness_layers_{compressed_layers}.log"
        (out / log).write_text(proc.stdout + proc.stderr)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise Fail(f"exit status {proc.returncode}: {first_error(proc.stderr)}")
        result = json.loads(lines[-1])
        if not result["passed"]:
            raise Fail(result["summary"])
        return result["summary"]

    if compressed_layers is None:
        return timed("HF exactness (fp32, compressed engine = HF reference)", check)
    return timed(f"HF exactness, layers 0..{compressed_layers - 1} compressed, the others whole", check)


def cuda_gated_tests(root: Path = REPO) -> list[str]:
    """``tests/compress`` and every other test file with a test skipped without CUDA."""
    gated = {"tests/compress"}
    for path in sorted((root / "tests").rglob("test_*.py")):
        if re.search(r"skipif\(\s*not\s+torch\.cuda\.is_available\(\)", path.read_text()):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith("tests/compress/"):
                gated.add(rel)
    return sorted(gated)


def pytest_row(cpu: bool, out: Path) -> Row:
    """pytest on :func:`cuda_gated_tests` (SKIP in ``--cpu`` mode)."""

    def run() -> str:
        if cpu:
            raise Skip("no CUDA device in --cpu mode (the CPU stand-ins run in the default suite)")
        files = cuda_gated_tests()
        import importlib.util

        workers = ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []  # one GPU, four processes
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *workers,
                               *files],
                              cwd=REPO, env=_python_env(), capture_output=True, text=True, timeout=3600, check=False)
        (out / "pytest-cuda.log").write_text(proc.stdout + proc.stderr)
        last = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
        if proc.returncode != 0:
            raise Fail(f"pytest exit status {proc.returncode}: {last[0]} (see pytest-cuda.log)")
        return f"{' '.join(files)}: {last[0]}"

    return timed("CUDA-gated tests (pytest)", run)


def compress_step_row(cpu: bool, out: Path) -> Row:
    """``benchmarks/compress_step.py`` (the compress step: Triton kernels vs the PyTorch path vs the copy floor;
    SKIP in ``--cpu`` mode). FAIL when a kernel keeps other tokens than the PyTorch path; the speed targets are
    reported, not enforced."""

    def run() -> str:
        if cpu:
            raise Skip("no CUDA device in --cpu mode (the kernels run under TRITON_INTERPRET=1 in the default suite)")
        proc = subprocess.run([sys.executable, "benchmarks/compress_step.py", "--out", str(out / "compress_step")],
                              cwd=REPO, env=_python_env(), capture_output=True, text=True, timeout=1800, check=False)
        (out / "compress_step.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise Fail(f"exit status {proc.returncode}: {first_error(proc.stdout + proc.stderr)} "
                       "(see compress_step.log)")
        result = json.loads((out / "compress_step" / "compress_step.json").read_text())
        met = [t for t in result["targets"] if t["met"]]
        return f"same kept ids; {len(met)} of {len(result['targets'])} speed targets met (compress_step/*.md)"

    return timed("compress-step benchmark (kernels vs PyTorch)", run)


def step_together_row(cpu: bool, out: Path) -> Row:
    """``benchmarks/step_together.py --granularity token`` (a step's compressions together against one after another,
    Triton kernels and PyTorch path; SKIP in ``--cpu`` mode). FAIL when together keeps other tokens or leaves other
    caches than alone; the speed-up is reported."""

    def run() -> str:
        if cpu:
            raise Skip("no CUDA device in --cpu mode (compress_regions is tested in the default suite)")
        result_dir = out / "step_together"
        proc = subprocess.run([sys.executable, "benchmarks/step_together.py", "--granularity", "token", "--out",
                               str(result_dir)], cwd=REPO, env=_python_env(), capture_output=True, text=True,
                              timeout=1800, check=False)
        (out / "step_together.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise Fail(f"exit status {proc.returncode}: {first_error(proc.stdout + proc.stderr)} "
                       "(see step_together.log)")
        rows = json.loads((result_dir / "step_together.json").read_text())["rows"]
        most = max(r["requests"] for r in rows)
        gains = ", ".join(f"{r['kernels']} {r['speedup']:.2f}x" for r in rows if r["requests"] == most)
        return f"same tokens and caches; {most} compressions together vs alone: {gains}"

    return timed("a step's compressions together (token granularity)", run)


def cuda_device_row() -> Row:
    """The CUDA device vLLM will use (FAIL without one: the check needs ``--cpu`` then)."""

    def probe() -> str:
        code = ("import torch, vllm; assert torch.cuda.is_available(), 'torch sees no CUDA device'; "
                "print(torch.cuda.get_device_name(0), 'CUDA', torch.version.cuda, 'torch', torch.__version__, "
                "'vLLM', vllm.__version__)")
        proc = subprocess.run([sys.executable, "-c", code], env=_python_env(), capture_output=True, text=True,
                              timeout=300, check=False)
        if proc.returncode != 0:
            raise Fail(f"{first_error(proc.stderr)} (on a machine without a GPU, run with --cpu)")
        return proc.stdout.strip().splitlines()[-1]

    return timed("CUDA device", probe)


# ---------------------------------------------------------------------------------------------------------
# Install (GPU mode): into its own venv, then continue under its Python
def install_row(venv: Path) -> Row:
    """Create ``venv`` (once) and install the project with ``.[cuda,dev,ray]`` into it (the pattern of
    ``scripts/setup-env.sh``, without the CPU wheels' fixes, which a CUDA install does not need)."""

    def install() -> str:
        python = venv / "bin" / "python"
        if not python.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        version = subprocess.run([str(python), "-c", "import sys; print(sys.version_info >= (3, 11))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        if version != "True":
            raise Fail(f"{venv} has a Python older than 3.11")
        log = venv / "pip-install.log"
        with log.open("w") as f:
            proc = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-e",
                                   ".[cuda,dev,ray]"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0:
            tail = [line for line in log.read_text().splitlines() if line.strip()][-3:]
            raise Fail(f"pip install failed (full log: {log}): {' | '.join(tail)}")
        probe = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                               env=_python_env(), capture_output=True, text=True, check=False)
        if probe.returncode != 0:
            raise Fail(f"installed, but vLLM does not import: {first_error(probe.stderr)}")
        (venv / ".cords-vllm-cuda-installed").touch()
        vllm_version, torch_version = probe.stdout.split()
        return f"{venv}: vLLM {vllm_version}, torch {torch_version}"

    return timed("install .[cuda,dev,ray]", install)


# ---------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.split("\n", 1)[0])
    p.add_argument("--cpu", action="store_true", help="run the steps on vLLM's CPU build (no install, no CUDA tests)")
    p.add_argument("--skip-install", action="store_true", help="use --venv (or this Python) as it is")
    p.add_argument("--no-install", action="store_true",
                   help="install nothing and use what this Python can import (a GPU host with no network or "
                        "package index: vLLM brought in by hand, the project on PYTHONPATH)")
    p.add_argument("--eager", action="store_true",
                   help="serve with --enforce-eager (faster start-up); one cords server keeps vLLM's CUDA graphs")
    p.add_argument("--venv", type=Path, default=REPO / ".venv-cuda",
                   help="the virtualenv the GPU mode installs into and runs in (default: .venv-cuda)")
    p.add_argument("--out", type=Path, default=REPO / "gpu-check-out",
                   help="where the summary (summary.json) and every log go (default: gpu-check-out)")
    p.add_argument("--jobs", type=int, default=None,
                   help="servers (and the exactness check) run at once (default: 1 on a GPU, 3 with --cpu)")
    p.add_argument("--install-row", help=argparse.SUPPRESS)  # the install's row, handed to the re-executed check
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every step, print the summary table, return 1 when any step failed."""
    args = parse_args(argv)
    started = time.perf_counter()
    rows: list[Row] = []
    if args.cpu:
        rows.append(Row("install .[cuda,dev,ray]", SKIP, 0.0, "--cpu uses the project's .venv (make setup)"))
    elif args.no_install:
        rows.append(Row("install .[cuda,dev,ray]", SKIP, 0.0, f"--no-install: {sys.executable} as it is"))
    elif args.install_row:
        rows.append(Row(**json.loads(args.install_row)))
    elif args.skip_install:
        rows.append(Row("install .[cuda,dev,ray]", SKIP, 0.0, "--skip-install"))
        python = args.venv / "bin" / "python"
        if python.is_file() and Path(sys.prefix).resolve() != args.venv.resolve():
            os.execv(str(python), [str(python), "-m", "cords_vllm.lab.gpu_check", *(argv or sys.argv[1:])])
    else:
        row = install_row(args.venv)
        if row.result == PASS:
            python = str(args.venv / "bin" / "python")
            os.execv(python, [python, "-m", "cords_vllm.lab.gpu_check", *(argv or sys.argv[1:]), "--skip-install",
                              "--install-row", json.dumps(asdict(row))])
        rows.append(row)
        rows.append(Row("everything else", SKIP, 0.0, "no environment to run in: the install failed"))
        return report(rows, args, started)

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.cpu:
        rows.append(cuda_device_row())
        if rows[-1].result != PASS:
            rows.append(Row("everything else", SKIP, 0.0, "no CUDA device"))
            return report(rows, args, started)
    model: list[str] = []

    def tiny_model() -> str:
        model.append(build_model())
        return model[0]

    rows.append(timed("tiny model (bf16)", tiny_model))
    if not model:
        rows.append(Row("everything else", SKIP, 0.0, "no model"))
        return report(rows, args, started)

    workload = Workload()
    specs = server_specs(args.cpu, args.eager)
    jobs = max(1, args.jobs or (3 if args.cpu else 1))
    # CPU servers started together each get cores of their own (OpenMP threads that share cores spin-wait)
    binds = cpu_binds(jobs) if args.cpu and jobs > 1 else []
    envs = [{"VLLM_CPU_OMP_THREADS_BIND": binds[i % len(binds)]} if binds else None for i in range(len(specs))]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        servers = [pool.submit(run_server, spec, model[0], workload, args.out, env)
                   for spec, env in zip(specs, envs, strict=True)]
        exact = [pool.submit(exactness_row, model[0], args.out, layers) for layers in (None, 2)]
        runs = [_result(f, spec) for f, spec in zip(servers, specs, strict=True)]
        for run in runs:
            rows.extend(run.rows)
        rows.extend(comparison_rows(runs))
        rows.extend(f.result() for f in exact)
    rows.append(pytest_row(args.cpu, args.out))
    rows.append(compress_step_row(args.cpu, args.out))
    rows.append(step_together_row(args.cpu, args.out))
    return report(rows, args, started)


def _result(future: concurrent.futures.Future, spec: ServerSpec) -> ServerRun:
    """A server's run, or one FAIL row when the run itself broke (the other servers' rows stand)."""
    try:
        return future.result()
    except Exception as exc:
        return ServerRun(spec, [Row(f"{spec.label}: serve", FAIL, 0.0, f"{type(exc).__name__}: {exc}")])


def report(rows: list[Row], args: argparse.Namespace, started: float) -> int:
    """Print the table, write ``summary.json`` under ``--out``; 1 when any row failed."""
    failed = [r for r in rows if r.result == FAIL]
    total = time.perf_counter() - started
    mode = "--cpu (vLLM's CPU build)" if args.cpu else "CUDA"
    print(f"\ncords-vllm gpu-check, {mode}: {len(rows) - len(failed)} of {len(rows)} steps passed or skipped, "
          f"{len(failed)} failed, {total:.0f} s\n")
    print(format_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"mode": "cpu" if args.cpu else "cuda", "seconds": total, "failed": len(failed),
               "rows": [asdict(r) for r in rows]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nlogs and summary.json: {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
