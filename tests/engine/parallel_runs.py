"""What the tensor- and pipeline-parallel engine tests share: one worker per core, noise videos, a live session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from cords_vllm.integration.inprocess.introspect import snapshot
from cords_vllm.integration.inprocess.session import EngineSession

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
CLIPS, CLIP_FRAMES = 4, 4
OPEN, CLIP = "<|im_start|>user\n", "<|vision_start|><|video_pad|><|vision_end|>"
QUESTION = "What color was the square?<|im_end|>\n<|im_start|>assistant\n"


def noise_video(frames: int, seed: int) -> np.ndarray:
    """``uint8 [frames, 224, 224, 3]`` random pixels (no two patches alike: no ties in selection)."""
    return np.random.default_rng(seed).integers(0, 256, (frames, 224, 224, 3), dtype=np.uint8)


def bind_one_per_core(workers: int) -> dict[str, str]:
    """The environment that puts each of ``workers`` CPU workers on its own core (vLLM's default binding, "auto",
    refuses a machine with one NUMA node)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in CORES[:workers])}


@contextmanager
def env(**values: str) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside the block, restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def one_shot(llm, prompt: str) -> dict:
    """One greedy request of a 48-frame noise video: its tokens, top-20 log-probs, and the free blocks before
    and after."""
    from vllm import SamplingParams

    free = snapshot(llm).free_blocks
    request = {"prompt": prompt, "multi_modal_data": {"video": noise_video(48, seed=0)}}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=20)
    out = llm.generate([request], params, use_tqdm=False)[0].outputs[0]
    return {"tokens": list(out.token_ids),
            "logprobs": [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs],
            "free_before": free, "free_after": snapshot(llm).free_blocks}


def live_session(llm, kept: Callable, name: str) -> dict:
    """A live stream of :data:`CLIPS` noise clips with a question after the second and the last, then closed: the
    answers, the session's compressions (``kept(llm)``'s entries of its request) and the free blocks after closing."""
    session = EngineSession(llm, name)
    answers = []
    for i in range(CLIPS):
        session.push({"prompt": (OPEN if i == 0 else "") + CLIP,
                      "multi_modal_data": {"video": noise_video(CLIP_FRAMES, seed=100 + i)}}, max_tokens=1)
        if i in (1, CLIPS - 1):
            answers.append(session.push({"prompt": QUESTION + ("" if i == CLIPS - 1 else OPEN)}, max_tokens=3))
    compressions = [k for k in kept(llm) if k[0] == session.request_id]
    session.close()
    return {"answers": answers, "kept": compressions, "free": snapshot(llm).free_blocks}
