"""The engine runs the implementation ``kernels`` names, says so at start-up, and keeps the same tokens with each.

On CPU the Triton kernels run under Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` where
no GPU is): ``kernels="triton"`` drives the real engine through the greedy kernel (the CPU cache's packed tiles
take the PyTorch copy, and the fused step, which reads the GPU backends' paged view, says it does not run), against
``kernels="torch"``, the reference. ``auto`` on CPU is the reference.
"""

from __future__ import annotations

import logging
import re

import pytest

import cords_vllm.integration.worker.compressor as compressor
from cords_vllm.compress import kernel_warmup
from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError, kv_policy_args
from cords_vllm.integration.worker.hooks import attached_compressor
from cords_vllm.selection import cords_triton
from tests.engine.conftest import BLOCK, CHUNK, VIDEO_PROMPT, run_engine, video
from tests.support.device_audit import watch_launches
from tests.support.specialization import specialization


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_kernels_key_reaches_the_workers_and_both_paths_keep_the_same_tokens(tiny_model, monkeypatch):
    """(The Triton run's start-up warm-up fails here, on purpose: the worker says why and serves.)"""
    prompts = [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(48)}}]
    worker_log = logging.getLogger(compressor.__name__.rpartition(".")[0])  # the compressor and its warm-up
    lines, level = _Lines(), worker_log.level
    worker_log.addHandler(lines)
    worker_log.setLevel(logging.INFO)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(kernel_warmup, "warm_up", broken)
    try:
        runs = {kernels: run_engine(tiny_model, prompts, "cords", max_tokens=4, budget=256, slack=64,
                                    granularity="frame", kernels=kernels) for kernels in ("torch", "triton")}
    finally:
        worker_log.removeHandler(lines)
        worker_log.setLevel(level)
    log = "\n".join(lines.lines)
    assert re.search(r"compress step on \S+: PyTorch reference \(forced; kernels=torch", log)
    assert "kernel warm-up failed (RuntimeError: no compiler today); each width compiles at its first" in log
    assert re.search(r"compress step on \S+: Triton kernels \(kernels=triton, from kv_policy_config 'kernels'\); "
                     r"fused step: no, the greedy kernel and the copy \(the KV cache is not the paged view", log)
    torch_run, triton_run = runs["torch"], runs["triton"]
    assert torch_run.compressions >= 2 and triton_run.compressions == torch_run.compressions
    assert [e.kept_logical for e in triton_run.events] != []
    for a, b in zip(torch_run.events, triton_run.events, strict=True):
        assert all((x == y).all() for x, y in zip(a.kept_logical, b.kept_logical, strict=True))
    assert triton_run.token_ids == torch_run.token_ids
    assert triton_run.free_blocks_after == triton_run.free_blocks_before


def _warmup(worker):
    return attached_compressor(worker.model_runner).warmup


def test_the_kernels_compile_at_start_up_for_every_width_the_videos_take(tiny_model, monkeypatch, make_llm):
    """The worker compiles its kernels when the engine starts (here their variants are listed: the interpreter has
    nothing to compile), and the compressions of videos of several lengths, at the server's budget and at budgets
    requests narrowed it to, launch only variants it compiled."""
    pytest.importorskip("triton")
    worker_log = logging.getLogger(compressor.__name__.rpartition(".")[0])  # the compressor and its warm-up
    lines, level = _Lines(), worker_log.level
    worker_log.addHandler(lines)
    worker_log.setLevel(logging.INFO)
    try:
        llm = make_llm(tiny_model, block_size=BLOCK, max_num_batched_tokens=4096, max_num_scheduled_tokens=CHUNK,
                       **kv_policy_args("cords", budget=128, slack=16, granularity="token", kernels="triton"))
    finally:
        worker_log.removeHandler(lines)
        worker_log.setLevel(level)
    report = llm.collective_rpc(_warmup)[0]
    assert any(re.search(r"kernel warm-up: compiled \d+ kernel variants \(greedy\) for regions of \d+-\d+ rows", line)
               for line in lines.lines), lines.lines
    launched = []

    def run(label, kernel, grid, args, kwargs):
        launched.append(specialization(kernel, args, kwargs))
        return kernel[grid](*args, **kwargs)

    watch_launches(monkeypatch, (cords_triton,), run)
    from vllm import SamplingParams

    for frames, budget in ((16, 128), (12, 24)):  # one after the other: a step's compressions share their width
        llm.generate({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(frames, seed=frames)}},
                     SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_policy": {"budget": budget}}),
                     use_tqdm=False)
    del llm
    warmed = {specialization(v.kernel, v.args, v.kwargs) for v in report.variants if v.name == "greedy"}
    blocks = {dict(fixed)["BLOCK"] for fixed, _ in launched}
    assert len(blocks) >= 2, blocks  # compressions of several widths
    assert set(launched) <= warmed, sorted(dict(fixed)["BLOCK"] for fixed, _ in set(launched) - warmed)


@pytest.mark.parametrize("value", ["cuda", "TRITON", 1, True])
def test_an_unknown_kernels_value_stops_the_configuration(value):
    with pytest.raises(KVPolicyConfigError, match="'kernels' must be one of"):
        KVPolicyConfig.parse("cords", {"kernels": value})


def test_an_unknown_environment_choice_stops_the_configuration(monkeypatch):
    monkeypatch.setenv("CORDS_VLLM_KERNELS", "cuda")
    with pytest.raises(KVPolicyConfigError, match="CORDS_VLLM_KERNELS must be one of"):
        KVPolicyConfig.parse("cords", {})
    assert KVPolicyConfig.parse("cords", {"kernels": "torch"}).kernels == "torch"  # the key wins


def test_kernels_round_trips_through_the_configuration():
    config = KVPolicyConfig.parse("cords", {"kernels": "torch"})
    assert config.kernels == "torch" and KVPolicyConfig.parse("cords", config.to_json()) == config
    assert "kernels" not in KVPolicyConfig.parse("cords", {}).to_json()


@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_warmup_takes_true_or_false(value):
    with pytest.raises(KVPolicyConfigError, match="'warmup' must be true or false"):
        KVPolicyConfig.parse("cords", {"warmup": value})
    config = KVPolicyConfig.parse("cords", {"warmup": False})
    assert not config.warmup and KVPolicyConfig.parse("cords", {}).warmup
    assert KVPolicyConfig.parse("cords", config.to_json()) == config
