"""Nothing of another platform in a process: the plugin's set-up in a CUDA process (vLLM's CUDA platform and GPU
worker classes, run on this CPU machine by :mod:`platform_probe`) never loads vLLM's CPU worker modules nor
changes what their import replaces (torch's CUDA events and streams, pinned copies, vLLM's host-to-device copy,
Model Runner V2's buffers); under ``--kv-policy none`` a worker is left as vLLM made it.

Each case runs in a fresh interpreter, as each vLLM process starts; the cases run concurrently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cords_vllm.integration.handoff.engine_policy import ENV
from cords_vllm.integration.patch import table
from cords_vllm.integration.patch.mechanism import for_platform, module_of

PROBE = Path(__file__).with_name("platform_probe.py")
REPO = Path(__file__).resolve().parents[2]

#: (platform, role, announced policy or None, resolve the whole table as the plugin once did)
CASES = {
    "cuda worker, cords": ("cuda", "worker", "cords", False),
    "cuda worker, none": ("cuda", "worker", "none", False),
    "cuda worker, nothing announced": ("cuda", "worker", None, False),
    "cuda engine core, none": ("cuda", "engine-core", "none", False),
    "cuda worker, whole table resolved (control)": ("cuda", "worker", "cords", True),
    "cpu worker, cords": ("cpu", "worker", "cords", False),
}


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """Every case's probe result, the interpreters started together."""
    procs = {}
    for name, (platform, role, policy, whole) in CASES.items():
        env = {k: v for k, v in os.environ.items() if k != ENV}
        if policy is not None:
            env[ENV] = policy
        if whole:
            env["PROBE_RESOLVE_WHOLE_TABLE"] = "1"
        procs[name] = subprocess.Popen([sys.executable, str(PROBE), platform, role], cwd=REPO, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {stderr[-3000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("cuda") and "control" not in c])
def test_a_cuda_process_loads_nothing_of_the_cpu_build(probes, case):
    got = probes[case]
    assert got["platform"] == "cuda"
    assert got["cpu_worker_modules"] == []
    assert got["replaced"] == []


def test_the_probe_sees_the_cpu_worker_when_it_is_loaded(probes):
    """The negative control: resolving the whole table (what the plugin did before) loads vLLM's CPU worker in a
    CUDA process, which replaces every guarded attribute but the Triton barrier of a CPU Triton build."""
    got = probes["cuda worker, whole table resolved (control)"]
    assert "vllm.v1.worker.cpu_worker" in got["cpu_worker_modules"]
    assert {"torch:cuda.Event", "torch:cuda.Stream", "torch:Tensor.pin_memory", "torch:accelerator.synchronize",
            "vllm.utils.torch_utils:async_tensor_h2d"} <= set(got["replaced"])


def test_policy_hooks_reach_a_cuda_worker_only_under_a_policy(probes):
    cords, none = probes["cuda worker, cords"], probes["cuda worker, none"]
    worker_patches = {e.target for e in table.WORKER if e.platform in (None, "cuda") and not e.target.startswith(
        "vllm._custom_ops")}
    assert worker_patches <= set(cords["installed"])
    assert none["installed"] == []  # under none the worker runs vLLM's code alone
    assert probes["cuda worker, nothing announced"]["installed"] == cords["installed"]
    # the engine core under none keeps only the session guard (a stream past --max-model-len ends alone)
    assert probes["cuda engine core, none"]["installed"] == ["vllm.v1.core.sched.scheduler:Scheduler.schedule"]


def test_the_cpu_build_gets_its_fixes(probes):
    got = probes["cpu worker, cords"]
    assert {"vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",
            "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model"} <= set(got["installed"])


#: The modules the table may resolve, per platform: reviewed. A module here is imported by the plugin only
#: after vLLM itself imported it in that process (the post-import hooks); a CPU-build module must never be listed
#: for CUDA.
REVIEWED_MODULES = {
    "common": {
        "vllm.engine.arg_utils", "vllm.entrypoints.launchers.app", "vllm.model_executor.models.qwen3_vl",
        "vllm.multimodal.media.image", "vllm.multimodal.media.video", "vllm.multimodal.registry",
        "vllm.multimodal.video_decoders.opencv",
        "vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_utils",
        "vllm.v1.core.sched.output", "vllm.v1.core.sched.request_queue", "vllm.v1.core.sched.scheduler",
        "vllm.v1.engine.async_llm", "vllm.v1.engine.core_client", "vllm.v1.engine.input_processor",
        "vllm.v1.engine.llm_engine", "vllm.v1.engine.output_processor", "vllm.v1.worker.gpu_model_runner",
        "vllm.v1.worker.gpu_worker", "vllm.v1.worker.utils",
        # the API server's HTTP protocols (uvicorn, which vLLM serves with): the header deadline
        "uvicorn.protocols.http.h11_impl", "uvicorn.protocols.http.httptools_impl",
    },
    "cpu": {"vllm._custom_ops", "vllm.config.multimodal", "vllm.model_executor.models.interfaces",
            "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu_worker"},
}


@pytest.mark.parametrize("platform", ["cuda", "cpu", "rocm"])
def test_the_modules_the_table_resolves_per_platform_are_reviewed(platform):
    common = {module_of(e) for e in for_platform(table.TABLE, "no such platform")}
    own = {module_of(e) for e in for_platform(table.TABLE, platform)}
    assert common == REVIEWED_MODULES["common"]
    assert own == common | REVIEWED_MODULES.get(platform, set())
    assert not any(m.startswith("vllm.v1.worker.cpu") for m in own) or platform == "cpu"
