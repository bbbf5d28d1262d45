"""Drive an in-process vLLM engine through a workload with one KV policy and measure it.

The engine is stepped by hand (``LLMEngine.add_request`` / ``step``) so arrivals follow the workload's
schedule and every step can be observed: KV blocks in use, running requests and preemptions come from the
engine's own scheduler and block pool after each step's allocation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cords_vllm.config import kv_policy_args
from cords_vllm.lab.bench import pruning
from cords_vllm.lab.bench.workload import PolicySpec, VideoWorkload
from cords_vllm.utils import cdiv


@dataclass
class PolicyResult:
    """Measurements of one policy on one workload."""

    label: str
    policy: str
    config: dict
    num_requests: int
    wall_seconds: float
    prompt_tokens: int
    output_tokens: int
    ttft_seconds: list[float]
    peak_running: int
    peak_blocks_in_use: int
    total_blocks: int
    preemptions: int
    compressions: int
    selection_seconds: float
    #: requests past their prompt (decoding) at the same time: streams the server really holds at once
    #: (``peak_running`` also counts prompts that are admitted and later preempted)
    peak_decoding: int = 0
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, blocks in use, running)
    answers: dict[str, Any] = field(default_factory=dict)  # token ids (offline) or text (HTTP)

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.wall_seconds

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.wall_seconds

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds

    def ttft(self, q: float) -> float:
        return float(np.quantile(self.ttft_seconds, q)) if self.ttft_seconds else float("nan")

    @property
    def selection_share(self) -> float:
        return self.selection_seconds / self.wall_seconds

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label, "policy": self.policy, "config": self.config,
            "requests_per_s": self.requests_per_second, "prefill_tok_per_s": self.prefill_tokens_per_second,
            "output_tok_per_s": self.output_tokens_per_second, "ttft_p50_s": self.ttft(0.5),
            "ttft_p90_s": self.ttft(0.9), "peak_running": self.peak_running, "peak_decoding": self.peak_decoding,
            "peak_kv_blocks": self.peak_blocks_in_use, "total_kv_blocks": self.total_blocks,
            "preemptions": self.preemptions, "compressions": self.compressions,
            "selection_share": self.selection_share, "wall_s": self.wall_seconds,
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["summary"] = self.summary()
        return out


def dtype_bytes(dtype: str) -> int:
    """Bytes of one KV element served with ``--dtype dtype``: 4 for ``float32``, else 2 (16-bit, ``auto`` included
    for the Qwen-VL checkpoints, which are bf16)."""
    return 4 if dtype == "float32" else 2


def kv_bytes_per_block(model_dir: str | Path, block_size: int, dtype_bytes: int) -> int:
    """Bytes one KV block takes across all layers of a (Qwen2-VL) checkpoint: a directory, or a Hugging Face model
    id (its ``config.json`` from the hub cache)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        from huggingface_hub import hf_hub_download

        config = Path(hf_hub_download(str(model_dir), "config.json"))
    text = json.loads(config.read_text())
    text = text.get("text_config", text)
    head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head * block_size * dtype_bytes


@dataclass(frozen=True)
class EngineSettings:
    """Engine sizing for a workload: block size, per-request chunk, per-step token budget, pool size.

    ``prefix_caching``: ``None`` leaves vLLM's prefix caching to the engine (on by default; a policy keeps the
    requests it may compress out of it, since it rewrites their blocks in place); ``False`` turns it off in every
    cell, ``True`` asks for it in every cell. With it on, a preempted request that is not compressed finds its
    blocks again when it recomputes.
    """

    block_size: int = 32
    chunk: int = 512
    step_tokens: int = 4096
    pool_videos: float = 2.0
    dtype: str = "float32"
    prefix_caching: bool | None = None

    def engine_kwargs(self, model_dir: str | Path, workload: VideoWorkload, prompt_tokens: int) -> dict[str, Any]:
        per_video = cdiv(prompt_tokens + workload.max_tokens, self.block_size)
        max_len = per_video * self.block_size
        # vLLM's start-up check needs one max_model_len request to fit in the pool
        blocks = max(int(self.pool_videos * per_video), per_video) + 1
        return {
            **({} if self.prefix_caching is None else {"enable_prefix_caching": self.prefix_caching}),
            "dtype": self.dtype, "block_size": self.block_size,
            "kv_cache_memory_bytes": blocks * kv_bytes_per_block(model_dir, self.block_size, dtype_bytes(self.dtype)),
            "max_model_len": max_len,
            # the encoder cache (sized by max_num_batched_tokens) must hold every video being prefilled
            "max_num_batched_tokens": max(workload.num_requests * workload.video_tokens, max_len),
            "max_num_scheduled_tokens": self.step_tokens, "long_prefill_token_threshold": self.chunk,
            "max_num_seqs": max(workload.num_requests, 1),
        }


def run_offline(model_dir: str | Path, spec: PolicySpec, workload: VideoWorkload, settings: EngineSettings,
                on_progress: Callable[[int], None] | None = None) -> PolicyResult:
    """Run ``workload`` through a fresh in-process engine with policy ``spec``."""
    from vllm import SamplingParams

    from cords_vllm.integration.inprocess.heap import settle
    from cords_vllm.integration.inprocess.introspect import record_steps, snapshot
    from cords_vllm.integration.inprocess.llm import make_llm

    requests = workload.requests()
    config, kwargs = pruning.split(spec, spec.config.get("budget"), workload.video_tokens)
    if spec.policy != "none":
        kwargs.update(kv_policy_args(spec.policy, **config))
    prompt_len = prompt_tokens(model_dir, requests[0].prompt, workload)
    llm = make_llm(model_dir, **settings.engine_kwargs(model_dir, workload, prompt_len), **kwargs)
    engine = llm.llm_engine
    steps = record_steps(llm)
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    pending = sorted(requests, key=lambda r: r.arrival)
    first_token: dict[str, float] = {}
    arrival: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    served_prompt_tokens = 0
    steps.start()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - steps.started
        while pending and pending[0].arrival <= now:
            request = pending.pop(0)
            arrival[request.request_id] = request.arrival
            engine.add_request(request.request_id, request.engine_input(), params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].arrival - now))
            continue
        for out in engine.step():
            t = time.perf_counter() - steps.started
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first_token:
                first_token[out.request_id] = t
            if out.finished:
                answers[out.request_id] = list(out.outputs[0].token_ids)
                served_prompt_tokens += len(out.prompt_token_ids)
                if on_progress:
                    on_progress(1)
    wall = time.perf_counter() - steps.started
    state = snapshot(llm)
    result = PolicyResult(
        label=spec.label, policy=spec.policy, config=spec.config, num_requests=len(requests), wall_seconds=wall,
        prompt_tokens=served_prompt_tokens, output_tokens=sum(len(a) for a in answers.values()),
        ttft_seconds=[first_token[r] - arrival[r] for r in first_token], peak_running=steps.peak_running,
        peak_blocks_in_use=steps.peak_blocks, total_blocks=steps.total_blocks,
        preemptions=steps.preemptions, peak_decoding=steps.peak_decoding,
        compressions=state.compressions, selection_seconds=state.selection_seconds, timeline=steps.timeline,
        answers=answers,
    )
    del llm, engine
    settle()
    return result


def prompt_tokens(model_dir: str | Path, prompt: str, workload: VideoWorkload) -> int:
    """Prompt length of one request: its text tokens with the placeholder expanded to the video's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return len(tokenizer(prompt)["input_ids"]) - 1 + workload.video_tokens
