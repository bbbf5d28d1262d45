"""The servers of an hours-long stream run: their ``vllm serve`` flags (sizing, the rotary range, frames kept at
their size) and the check that the engine runs with that range."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from cords_vllm.lab.bench.stream_hours.plan import MARKERS, HoursConfig


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
