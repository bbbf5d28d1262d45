"""Tensor parallelism: the policy keeps the same tokens, and answers the same, at TP=2 as at TP=1.

Each rank's KV cache holds one of the tiny model's two KV heads. Joint selection (``per_head: false``) gathers the
anchors' keys and values of both heads across the TP group before selecting, so both ranks keep the tokens TP=1
keeps; per-head selection needs no exchange (heads are independent). Checked for a one-shot request (kept ids of
every compression, all ranks' heads together, equal TP=1's; greedy tokens equal; log-probs within
:data:`TOL`) and for a live stream (an engine session across turns, re-based at each turn).

The video is random noise: the synthetic test video's flat backgrounds give patches with identical features, so
the greedy selection meets exact ties, which the ~1e-7 difference between TP=1's and TP=2's keys (the row-parallel
all-reduce sums in another order) breaks either way; noise has no such ties.

Each configuration starts one TP=2 engine and one TP=1 engine, one after the other, and runs the one-shot request
and (joint token granularity) the session on each: six engine starts, about 3.5 minutes on two cores shared with
another test run (a TP=2 engine's start and request 40-70 s, a TP=1 engine's 15-20 s). vLLM's CPU platform spawns
the TP workers, so they load the plugin themselves.
"""

from __future__ import annotations

import pytest
import torch

from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.integration.inprocess.introspect import worker_snapshots
from cords_vllm.integration.inprocess.llm import make_llm
from tests.engine.conftest import BLOCK, CHUNK, VIDEO_PROMPT
from tests.engine.parallel_runs import CLIPS, CORES, bind_one_per_core, env, live_session, one_shot

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(len(CORES) < 2, reason="tensor parallelism on CPU needs two cores (one rank each)")]

TOL = 1e-4  # fp32; TP=2 against TP=1 without a policy differs by ~5e-7
BUDGET, SLACK = 256, 64
CONFIGS = {
    "token": {"granularity": "token"},
    "frame": {"granularity": "frame"},
    "token-per-head": {"granularity": "token", "per_head": True},
}
SESSION_CONFIGS = ("token",)


def _kept(llm) -> list[tuple[str, int, list[torch.Tensor]]]:
    """Every compression as ``(request id, at_token, kept ids per layer)``, each layer's ``long [H, n]`` with the
    heads of all ranks in rank order (rank ``r`` holds heads ``[r * H / W, (r + 1) * H / W)``)."""
    ranks = [w.events for w in worker_snapshots(llm)]
    assert len({len(e) for e in ranks}) == 1, "every rank carries out every compression"
    kept = []
    for events in zip(*ranks, strict=True):
        assert len({(e.req_id, e.at_token) for e in events}) == 1
        layers = [torch.cat(per_rank, dim=0) for per_rank in zip(*(e.kept_logical for e in events), strict=True)]
        kept.append((events[0].req_id, events[0].at_token, layers))
    return kept


def _run(model: str, tp: int, config: dict, with_session: bool) -> dict:

    kwargs = {"block_size": BLOCK, "max_num_batched_tokens": 4096, "max_num_scheduled_tokens": CHUNK,
              "limit_mm_per_prompt": {"image": 0, "video": CLIPS},
              **kv_policy_args("cords", budget=BUDGET, slack=SLACK, **config)}
    binding = {}
    if tp > 1:  # one rank per core
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        binding = bind_one_per_core(tp)
    with env(**binding):
        llm = make_llm(model, **kwargs)
        try:
            result = {**one_shot(llm, VIDEO_PROMPT), "kept": _kept(llm)}
            if with_session:
                result["session"] = live_session(llm, _kept, "camera-tp")
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            settle()
    return result


@pytest.fixture(scope="module")
def runs(tiny_model):
    """``runs(name) -> (tp1, tp2)``: each configuration's two engines, run once per module."""
    cache: dict[str, tuple[dict, dict]] = {}

    def get(name: str) -> tuple[dict, dict]:
        if name not in cache:
            session = name in SESSION_CONFIGS
            cache[name] = (_run(tiny_model, 1, CONFIGS[name], session), _run(tiny_model, 2, CONFIGS[name], session))
        return cache[name]
    return get


def _assert_same_kept(one: list, two: list) -> None:
    assert len(one) == len(two) >= 2, "the request must be compressed at least twice"
    for (_, at1, layers1), (_, at2, layers2) in zip(one, two, strict=True):
        assert at1 == at2
        for layer, (a, b) in enumerate(zip(layers1, layers2, strict=True)):
            assert a.shape == b.shape, f"at token {at1}, layer {layer}: {tuple(b.shape)} kept, TP=1 {tuple(a.shape)}"
            assert torch.equal(a, b), f"at token {at1}, layer {layer}: kept ids differ from TP=1"


#: The default suite runs the joint token case (one-shot and session: one TP=1 and one TP=2 engine); the others
#: start two more engines each and run with ``-m slow`` (``make test-slow``).
@pytest.mark.parametrize("name", [n if n == "token" else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS])
def test_tp2_keeps_the_tokens_and_answers_of_tp1(runs, name):
    tp1, tp2 = runs(name)
    _assert_same_kept(tp1["kept"], tp2["kept"])
    if not CONFIGS[name].get("per_head"):  # joint: both ranks' heads keep the same ids
        for _, _, layers in tp2["kept"]:
            assert all(torch.equal(layer[0], layer[1]) for layer in layers)
    assert tp2["tokens"] == tp1["tokens"]
    worst = max(abs(lp - s1[t]) for s1, s2 in zip(tp1["logprobs"], tp2["logprobs"], strict=True)
                for t, lp in s2.items() if t in s1)
    assert worst < TOL
    assert tp2["free_after"] == tp2["free_before"]


@pytest.mark.parametrize("name", SESSION_CONFIGS)
def test_tp2_session_keeps_the_tokens_and_answers_of_tp1(runs, name):
    tp1, tp2 = (r["session"] for r in runs(name))
    assert tp2["answers"] == tp1["answers"]
    _assert_same_kept(tp1["kept"], tp2["kept"])
    assert tp2["free"] == runs(name)[1]["free_before"]  # every block back on close
