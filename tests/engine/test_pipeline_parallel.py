"""Pipeline parallelism: PP=2 answers as PP=1, and under a policy each stage selects on its own layers.

The tiny model's four layers split into two stages (layers 0-1, 2-3), one worker per core. Without a policy PP=2
answers as PP=1. Under ``cords`` with the default anchors ``[0]``, layers 2-3 cannot follow layer 0 (it is on the
other stage), so the second stage's first layer selects for it (:mod:`cords_vllm.compress.pipeline`): the PP=2
engine keeps, at every compression and in every layer, exactly the tokens a PP=1 engine configured with anchors
``[0, 2]`` keeps, and answers the same. The negative control: PP=1 with the configured ``[0]`` keeps other tokens
in layers 2-3 (the same in layers 0-1). Both stages keep the same count per compression (they share the blocks),
and every block comes back. The same holds over a live engine session (re-based at each turn).

The video is random noise, so that selection meets no exact ties (see ``test_tensor_parallel.py``).

vLLM 0.32's CPU build cannot run a later stage in eager mode on its own (its intermediate buffer is allocated only
by a warm-up the CPU worker skips); the plugin fixes it in every worker
(:mod:`cords_vllm.integration.worker.pipeline_parallel`), and the slow negative control shows the failure with the
plugin kept out of the workers.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cords_vllm.config import KVPolicyConfigError, kv_policy_args
from cords_vllm.integration.inprocess.heap import settle
from cords_vllm.integration.inprocess.introspect import worker_snapshots
from cords_vllm.integration.inprocess.llm import make_llm
from tests.engine.conftest import BLOCK, CHUNK, VIDEO_PROMPT
from tests.engine.parallel_runs import CLIPS, CORES, bind_one_per_core, env, live_session, one_shot

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(len(CORES) < 2, reason="pipeline parallelism on CPU needs two cores (one stage each)")]

TOL = 1e-4  # fp32; PP=2 against PP=1 differs by ~1e-6, with or without a policy
BUDGET, SLACK = 256, 64
#: name -> (pipeline stages, policy settings or None for --kv-policy none)
RUNS = {
    "none-pp1": (1, None),
    "none-pp2": (2, None),
    "cords-pp2": (2, {"anchors": [0]}),
    "cords-pp1-stage-anchors": (1, {"anchors": [0, 2]}),
    "cords-pp1-configured": (1, {"anchors": [0]}),
}
#: The runs that also carry a live session (re-based at each turn).
SESSION_RUNS = ("cords-pp2", "cords-pp1-stage-anchors")


def _kept(llm) -> list[tuple[str, int, list[torch.Tensor]]]:
    """Every compression as ``(request id, at_token, kept ids per layer)``, each layer's ``long [H, n]``, the
    stages' layers in stage order (stage 0's layers, then stage 1's)."""
    stages = [w.events for w in worker_snapshots(llm)]
    assert len({len(e) for e in stages}) == 1, "every stage carries out every compression"
    kept = []
    for events in zip(*stages, strict=True):
        assert len({(e.req_id, e.at_token) for e in events}) == 1
        kept.append((events[0].req_id, events[0].at_token, [layer for e in events for layer in e.kept_logical]))
    return kept


def _run(model: str, stages: int, policy: dict | None, with_session: bool = False,
         environment: dict | None = None) -> dict:

    kwargs = {"block_size": BLOCK, "max_num_batched_tokens": 4096, "max_num_scheduled_tokens": CHUNK,
              "limit_mm_per_prompt": {"image": 0, "video": CLIPS}}
    if policy is not None:
        kwargs.update(kv_policy_args("cords", budget=BUDGET, slack=SLACK, granularity="token", **policy))
    environment = dict(environment or {})
    if stages > 1:  # one stage per core
        kwargs.update(pipeline_parallel_size=stages, distributed_executor_backend="mp")
        environment.update(bind_one_per_core(stages))
    with env(**environment):
        llm = make_llm(model, **kwargs)
        try:
            result = {**one_shot(llm, VIDEO_PROMPT), "kept": _kept(llm) if policy is not None else [],
                      "stages": len(worker_snapshots(llm))}
            if with_session:
                result["session"] = live_session(llm, _kept, "camera-pp")
            return result
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            settle()


@pytest.fixture(scope="module")
def runs(tiny_model):
    """``runs(name)``: each engine of :data:`RUNS`, run once per module."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = _run(tiny_model, *RUNS[name], with_session=name in SESSION_RUNS)
        return cache[name]
    return get


def _worst_logprob_gap(one: dict, two: dict) -> float:
    return max(abs(lp - s1[t]) for s1, s2 in zip(one["logprobs"], two["logprobs"], strict=True)
               for t, lp in s2.items() if t in s1)


def _same_layers(one: list, two: list, layers: range) -> bool:
    assert len(one) == len(two) >= 2, "the request must be compressed at least twice"
    same = True
    for (_, at1, layers1), (_, at2, layers2) in zip(one, two, strict=True):
        assert at1 == at2
        for layer in layers:
            a, b = layers1[layer], layers2[layer]
            assert a.shape == b.shape, f"at token {at1}, layer {layer}: {tuple(b.shape)} kept, {tuple(a.shape)}"
            same &= torch.equal(a, b)
    return same


def _startup_line(model: str, **config) -> str:
    """The plugin's start-up line for a PP=2 engine configuration (vLLM's ``create_engine_config``; no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    from cords_vllm.plugin import register

    register()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    plugin_logger = logging.getLogger("cords_vllm")
    plugin_logger.addHandler(handler)
    try:
        EngineArgs(model=model, max_model_len=1024, pipeline_parallel_size=2, distributed_executor_backend="mp",
                   **kv_policy_args("cords", budget=256, **config)).create_engine_config()
    finally:
        plugin_logger.removeHandler(handler)
    return "\n".join(r.getMessage() for r in records)


def test_start_up_checks_anchors_against_the_whole_model_and_names_the_stage_anchors(tiny_model):
    """Stage 0 holds layers 0-1 only, but ``anchors`` index the whole model's layers."""
    line = _startup_line(tiny_model, anchors=[3])
    assert "anchors [3] -> [0, 2, 3] (pipeline parallel, attention layers 0..1, 2..3 per stage" in line
    assert "pipeline parallel" not in _startup_line(tiny_model, anchors=[0, 2])
    with pytest.raises(KVPolicyConfigError, match=r"names layer 4, but the model has layers 0\.\.3"):
        _startup_line(tiny_model, anchors=[4])


#: The default suite runs the policy's checks (two engines with a live session each, one more in-process: about 90 s on
#: two shared cores); the run without a policy (one more PP=2 engine) and the CPU fix's negative control run with
#: ``-m slow`` (``make test-slow``).
@pytest.mark.slow
def test_pp2_without_a_policy_answers_as_pp1(runs):
    one, two = runs("none-pp1"), runs("none-pp2")
    assert two["tokens"] == one["tokens"]
    assert _worst_logprob_gap(one, two) < TOL


def test_pp2_selects_per_stage_as_pp1_with_the_stage_anchors(runs):
    two, same_rule, configured = runs("cords-pp2"), runs("cords-pp1-stage-anchors"), runs("cords-pp1-configured")
    assert two["stages"] == 2
    assert _same_layers(same_rule["kept"], two["kept"], range(4))
    assert two["tokens"] == same_rule["tokens"]
    assert _worst_logprob_gap(same_rule, two) < TOL
    # negative control: the configured anchors alone (layer 0 for every layer) keep the same tokens on stage 0 only
    assert _same_layers(configured["kept"], two["kept"], range(2))
    assert not _same_layers(configured["kept"], two["kept"], range(2, 4))
    assert _worst_logprob_gap(configured, two) > 100 * TOL


def test_both_stages_keep_the_same_count_and_every_block_comes_back(runs):
    two = runs("cords-pp2")
    for _, at, layers in two["kept"]:
        assert len({tuple(layer.shape) for layer in layers}) == 1, f"at token {at}: kept counts differ across layers"
    assert two["free_after"] == two["free_before"]


def test_a_pp2_session_keeps_the_tokens_and_answers_of_pp1_with_the_stage_anchors(runs):
    two, one = runs("cords-pp2"), runs("cords-pp1-stage-anchors")
    assert two["session"]["answers"] == one["session"]["answers"]
    assert _same_layers(one["session"]["kept"], two["session"]["kept"], range(4))
    assert two["session"]["free"] == two["free_before"]  # every block back on close


@pytest.mark.slow
def test_a_later_stage_fails_on_the_cpu_build_without_the_plugin(tiny_model, capfd):
    """Negative control of the CPU fix: with the plugin kept out of the workers (``VLLM_PLUGINS`` names no plugin),
    vLLM's own stage 1 fails its first step on the missing buffer (its worker logs why to the test's output)."""
    try:
        _run(tiny_model, 2, None, environment={"VLLM_PLUGINS": "none"})
        failed = False
    except Exception:  # vLLM raises several kinds here
        failed = True
    settle()
    captured = capfd.readouterr()
    assert failed
    assert "assert self.intermediate_tensors is not None" in captured.out + captured.err
