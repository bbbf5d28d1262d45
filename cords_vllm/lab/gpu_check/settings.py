"""What the GPU check serves and sends: the servers (:class:`ServerSpec`, per attention backend and policy), their
flags and the workload every server gets."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

#: Policy settings of the ``cords`` servers: videos of more candidate tokens than this are compressed.
BUDGET, SLACK = 256, 64
#: Flags every server gets.
COMMON_FLAGS = ["--dtype", "bfloat16", "--limit-mm-per-prompt", '{"image": 0, "video": 1}']
#: Flags that keep a CPU server small and fast (a CUDA server runs at vLLM's defaults).
CPU_FLAGS = ["--enforce-eager", "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20),
             "--max-model-len", "8192", "--max-num-batched-tokens", "8192"]
QUESTION = "What color was the square?"


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


def cpu_binds(jobs: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` values that give ``jobs`` CPU servers running at once cores of their own
    (contiguous groups of the allowed cores; with fewer cores than servers, one core each, in turn)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= jobs:
        size = len(cores) // jobs
        return [",".join(map(str, cores[i * size:(i + 1) * size])) for i in range(jobs)]
    return [str(cores[i % len(cores)]) for i in range(jobs)]
