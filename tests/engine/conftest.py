"""Helpers to run the real in-process engine with a KV policy and capture what it did."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("vllm", reason="tests/engine drive vLLM's engine; vLLM is not installed")

from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.integration.inprocess.introspect import host_lengths, record_steps, snapshot
from cords_vllm.integration.inprocess.llm import make_llm
from cords_vllm.lab.reference.exactness import chunks_for, evictions_of
from cords_vllm.lab.synthetic import make_video

os.environ["CORDS_VLLM_TRACE"] = "1"

BLOCK = 32
CHUNK = 256
VIDEO_PROMPT = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What color was the square?"
                "<|im_end|>\n<|im_start|>assistant\n")
TEXT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class EngineRun:
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    prompt_lens: list[int]
    events: list
    free_blocks_before: int
    free_blocks_after: int
    max_blocks_held: dict[str, int]
    max_running: int
    num_preemptions: int
    compressions: int
    #: ``cords_vllm_request_kv_blocks_peak`` as the engine published it (its sink's file, read back).
    published_peak: float


def video(frames: int = 32, seed: int = 3) -> np.ndarray:
    return make_video(frames, 224, 224, seed=seed).frames


def run_engine(model: str, prompts: list[dict], policy: str = "none", max_tokens: int = 6,
               engine_kwargs: dict | None = None, **config) -> EngineRun:
    """Generate greedily for ``prompts`` with the policy; records per-request held blocks after every step."""
    from vllm import SamplingParams

    kwargs = {"block_size": BLOCK, "max_num_batched_tokens": 4096, "max_num_scheduled_tokens": CHUNK,
              **(engine_kwargs or {})}
    if policy != "none":
        kwargs.update(kv_policy_args(policy, **config))
    llm = make_llm(model, **kwargs)
    free_before = snapshot(llm).free_blocks
    steps = record_steps(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=20)
    outs = llm.generate(prompts, params, use_tqdm=False)
    state = snapshot(llm)
    run = EngineRun(
        token_ids=[list(o.outputs[0].token_ids) for o in outs],
        logprobs=[[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs],
        prompt_lens=[len(o.prompt_token_ids) for o in outs],
        events=list(state.events),
        free_blocks_before=free_before,
        free_blocks_after=state.free_blocks,
        max_blocks_held=steps.max_blocks_held,
        max_running=steps.peak_running,
        num_preemptions=steps.preemptions,
        compressions=state.compressions,
        published_peak=_published_peak(llm),
    )
    del llm
    settle()
    return run


def _published_peak(llm) -> float:
    from cords_vllm.integration.engine_core.hooks import scheduler_hooks
    from cords_vllm.integration.engine_core.observers import PEAK
    from cords_vllm.integration.inprocess.introspect import scheduler_of

    publisher = scheduler_hooks(scheduler_of(llm)).publisher
    publisher.flush()
    return json.loads(publisher.path.read_text())["totals"][PEAK]


@pytest.fixture(scope="session")
def hf_reference(tiny_model):
    from cords_vllm.lab.reference.hf import HFQwen2VLReference

    return HFQwen2VLReference(tiny_model)


def assert_exact_with_control(run: EngineRun, reference, prompt: str, frames, tol: float,
                              control_factor: float = 50) -> None:
    """The compressed ``run`` (one request) equals ``reference`` dropping the engine's tokens at the engine's points
    (greedy tokens, every top log-prob within ``tol``), and the same reference without the evictions differs by
    more than ``control_factor * tol`` (the negative control). ``reference`` has ``run(prompt, frames, ...)``."""
    evictions = evictions_of(run.events)
    steps = len(run.token_ids[0])
    ref = reference.run(prompt, frames, max_new_tokens=steps, chunk_sizes=chunks_for(run.prompt_lens[0], evictions),
                        evictions=evictions, forced_tokens=run.token_ids[0])
    assert ref.token_ids == run.token_ids[0], "greedy tokens differ"
    assert logprob_gap(run, ref) < tol
    control = reference.run(prompt, frames, max_new_tokens=steps, forced_tokens=run.token_ids[0])
    assert logprob_gap(run, control) > control_factor * tol, "the reference without the evictions must differ"


def logprob_gap(run: EngineRun, result, index: int = 0) -> float:
    """Largest ``|engine - reference|`` over the engine's top log-probs of every step of request ``index``."""
    ref_lp = result.logits.log_softmax(-1)
    return max(abs(lp - float(ref_lp[step, token])) for step, top in enumerate(run.logprobs[index])
               for token, lp in top.items())


@dataclass
class SessionRun:
    """One engine session pushed turn by turn, then closed: the last turn's answer, what the request held before
    closing (``RequestCompression``), its compression events, and the free blocks before opening and after closing."""

    answer: list[int]
    held: object
    events: list
    free_before: int
    free_after: int
    logprobs: list = field(default_factory=list)
    #: The request's host lengths before closing (``HostLengths``: tokens, prompt, row, inputs, worker copies).
    lengths: object = None


def run_session(llm, turns: list[dict], max_tokens: int = 1, logprobs: int | None = None,
                answer_tokens: int | None = None) -> SessionRun:
    """Push ``turns`` (engine prompts) into one :class:`EngineSession` of ``llm``, then close it. Each turn generates
    ``max_tokens`` tokens, the last one ``answer_tokens`` if given, with its top ``logprobs`` log-probabilities per
    token in :attr:`SessionRun.logprobs`."""
    from cords_vllm.integration.inprocess.session import EngineSession

    free = snapshot(llm).free_blocks
    session = EngineSession(llm, "camera-0")
    answer: list[int] = []
    for i, turn in enumerate(turns):
        last = i == len(turns) - 1
        answer = session.push(turn, answer_tokens if last and answer_tokens else max_tokens, logprobs)
    state = snapshot(llm)
    held = state.requests[session.request_id]
    lengths = host_lengths(llm, session.request_id)
    events = [e for e in state.events if e.req_id == session.request_id]
    session.close()
    return SessionRun(answer, held, events, free, snapshot(llm).free_blocks, session.logprobs, lengths)
