"""One live stream pushed into an engine session for as long as it lasts: held blocks and push cost vs length.

A camera pushes clips of ``clip_frames`` frames into one resumable request
(:class:`~cords_vllm.integration.inprocess.session.EngineSession`) on an in-process engine whose KV pool holds
``pool_blocks`` blocks. Each push records the stream's length so
far (video tokens pushed), the blocks the session holds once the push is done, and the push's wall time.
Under ``none`` the stream ends where vLLM must: a session cannot hold more than ``--max-model-len`` tokens,
and vLLM's start-up check ties that to the pool. Under a policy the pool only has to hold the stream's
bounded footprint, so the stream runs far past the pool with flat blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cords_vllm.config import kv_policy_args
from cords_vllm.lab.bench.offline import kv_bytes_per_block
from cords_vllm.lab.bench.workload import PolicySpec
from cords_vllm.lab.synthetic import make_video

OPEN = "<|im_start|>user\n"
CLIP = "<|vision_start|><|video_pad|><|vision_end|>"


@dataclass(frozen=True)
class PushRecord:
    """One push: stream length after it (video tokens), blocks the session held after it, its wall time."""

    push: int
    stream_tokens: int
    held_blocks: int
    seconds: float


@dataclass
class SessionRun:
    """What one policy's stream did (``stopped``: why it ended before its last push, or ``None``)."""

    label: str
    pool_blocks: int
    block_size: int
    max_model_len: int
    records: list[PushRecord] = field(default_factory=list)
    stopped: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_session(model_dir: str | Path, spec: PolicySpec, *, pushes: int, clip_frames: int, size: int,
                pool_blocks: int, block_size: int, max_model_len: int,
                on_push: Callable[[PushRecord], None] | None = None) -> SessionRun:
    """Push ``pushes`` clips into one session under ``spec`` (stops early when the engine ends the stream)."""
    from cords_vllm.integration.inprocess.heap import settle
    from cords_vllm.integration.inprocess.introspect import snapshot
    from cords_vllm.integration.inprocess.llm import make_llm
    from cords_vllm.integration.inprocess.session import EngineSession, SessionClosed

    kwargs: dict[str, Any] = {
        "block_size": block_size, "max_model_len": max_model_len, "dtype": "float32",
        "kv_cache_memory_bytes": (pool_blocks + 1) * kv_bytes_per_block(model_dir, block_size, 4),
        "max_num_batched_tokens": max(4096, max_model_len), "max_num_scheduled_tokens": 1024,
        "limit_mm_per_prompt": {"image": 0, "video": 1},
    }
    if spec.policy != "none":
        kwargs.update(kv_policy_args(spec.policy, **spec.config))
    llm = make_llm(model_dir, **kwargs)
    run = SessionRun(label=spec.label, pool_blocks=pool_blocks, block_size=block_size, max_model_len=max_model_len)
    session = EngineSession(llm, "camera")
    streamed = 0
    try:
        per_push = 0
        for i in range(pushes):
            if spec.policy == "none" and per_push and streamed + per_push + 16 > max_model_len:
                # vLLM ends a session at max-model-len tokens (and its own check ties that to the pool); under
                # a policy a stream is re-based at every push, its length is what it holds
                run.stopped = f"push {i + 1}: the stream would pass max-model-len ({max_model_len} tokens)"
                break
            clip = make_video(clip_frames, size, size, seed=1000 + i).frames
            t0 = time.perf_counter()
            try:
                session.push({"prompt": (OPEN if i == 0 else "") + CLIP, "multi_modal_data": {"video": clip}})
            except (SessionClosed, ValueError) as exc:
                run.stopped = f"push {i + 1}: {exc}"[:300]
                break
            seconds = time.perf_counter() - t0
            state = snapshot(llm).requests.get(session.request_id)
            if state is None:
                run.stopped = f"push {i + 1}: the engine ended the stream (max-model-len {max_model_len} reached)"
                break
            per_push, streamed = state.sent_candidate_tokens - streamed, state.sent_candidate_tokens
            record = PushRecord(push=i + 1, stream_tokens=streamed, held_blocks=state.held_blocks, seconds=seconds)
            run.records.append(record)
            if on_push:
                on_push(record)
        session.close()
    finally:
        del session, llm
        settle()
    return run


def summary(run: SessionRun, window: int = 5) -> dict[str, Any]:
    """Stream length reached (in pools), peak and final held blocks, push time at the start and at the end."""
    recs = run.records
    if not recs:
        return {"label": run.label, "pushes": 0}
    first = recs[1: 1 + window] or recs[:1]  # the first push also starts the session
    last = recs[-window:]
    start_s = sum(r.seconds for r in first) / len(first)
    end_s = sum(r.seconds for r in last) / len(last)
    return {
        "label": run.label, "pushes": len(recs), "stream_tokens": recs[-1].stream_tokens,
        "stream_in_pools": recs[-1].stream_tokens / (run.pool_blocks * run.block_size),
        "peak_held_blocks": max(r.held_blocks for r in recs), "final_held_blocks": recs[-1].held_blocks,
        "push_s_start": start_s, "push_s_end": end_s, "push_cost_growth": end_s / start_s if start_s else None,
        "stopped": run.stopped,
    }


def plot_runs(runs: list[SessionRun], out_dir: Path) -> list[Path]:
    """``session_blocks.png`` (held blocks vs stream length) and ``session_push_time.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, key, ylabel in (("session_blocks.png", "held_blocks", "KV blocks held by the stream"),
                              ("session_push_time.png", "seconds", "seconds per push")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for run in runs:
            ax.plot([r.stream_tokens for r in run.records], [getattr(r, key) for r in run.records], label=run.label)
        if key == "held_blocks" and runs:
            ax.axhline(runs[0].pool_blocks, color="grey", linestyle="--", label="KV pool")
        ax.set_xlabel("stream length (video tokens pushed)")
        ax.set_ylabel(ylabel)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
