"""The hybrid Qwen3.5 (three Gated DeltaNet layers to one full-attention layer, bf16: the CPU build's only dtype
for it): served compressed on the CPU build, where it is checked here; refused under a policy elsewhere (a GPU)
unless ``CORDS_VLLM_EXPERIMENTAL_HYBRID=1``.

Only the attention group is compressed (anchors count attention layers, the state groups are left alone), every
block comes back, and the outputs equal the fp32 HF reference that drops the same tokens as closely as the
uncompressed bf16 engine equals it. The run hands a block its compression freed to attention again in the same step
(vLLM zeroes such blocks on a hybrid model, before the workers copy kept tokens out of them, unless the plugin
spares them: without that, the gap was 0.03 to 0.07).
"""

from __future__ import annotations

import pytest
import torch

from cords_vllm.config import KVPolicyConfigError
from cords_vllm.integration.handoff import plans
from cords_vllm.integration.startup.checks import EXPERIMENTAL_HYBRID_ENV, check_attention
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_model
from tests.engine.conftest import VIDEO_PROMPT, assert_exact_with_control, run_engine, video
from tests.engine.test_families import clip

pytestmark = pytest.mark.engine

BF16 = {"dtype": "bfloat16", "block_size": None}  # vLLM sets a hybrid's attention block size (256 here)
#: bf16 engine against the fp32 reference: 0.006 uncompressed on this model, 0.007 to 0.009 compressed (token and
#: frame granularity, per-head and joint selection, two budgets, two requests batched); about three times that.
TOL = 0.02
#: The reference without the evictions differs by 0.13 to 0.25: more than five tolerances.
CONTROL_FACTOR = 5


@pytest.fixture(scope="module")
def hybrid_model() -> str:
    return str(build_tiny_model(TinyModelSpec(family="qwen3_5", dtype="bfloat16")))


def _prompt():
    return {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": clip(video(48))}}


def test_a_hybrid_model_is_refused_where_it_is_not_checked():
    """Checked exact on vLLM's CPU build (the tests below, no switch set); elsewhere (a GPU) refused unless the
    switch is set."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(EXPERIMENTAL_HYBRID_ENV, raising=False)
        with pytest.raises(KVPolicyConfigError, match=EXPERIMENTAL_HYBRID_ENV):
            check_attention("cords", "tiny-qwen3.5", None, False, hybrid=True, hybrid_checked=False)
        check_attention("cords", "tiny-qwen3.5", None, False, hybrid=True, hybrid_checked=True)
        mp.setenv(EXPERIMENTAL_HYBRID_ENV, "1")
        check_attention("cords", "tiny-qwen3.5", None, False, hybrid=True, hybrid_checked=False)


@pytest.fixture(scope="module")
def hybrid_run(hybrid_model):
    """The compressed run, with the freed blocks the plugin kept vLLM from zeroing (``hybrid_run.spared``)."""
    spared: list[int] = []
    spare = plans.spare_freed_blocks

    def recording(output, step_plans):
        before = list(getattr(output, plans.ZERO_FIELD, None) or ())
        spare(output, step_plans)
        after = set(getattr(output, plans.ZERO_FIELD, None) or ())
        spared.extend(b for b in before if b not in after)

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(EXPERIMENTAL_HYBRID_ENV, raising=False)  # on vLLM's CPU build a hybrid is served compressed
        mp.setattr(plans, "spare_freed_blocks", recording)
        run = run_engine(hybrid_model, [_prompt()], "cords", max_tokens=4, engine_kwargs=BF16, budget=256, slack=64)
    run.spared = spared
    return run


def test_only_the_attention_group_is_compressed_and_every_block_returns(hybrid_run, hybrid_model):
    assert len(hybrid_run.events) >= 2
    assert all(len(e.kept_logical) == 1 for e in hybrid_run.events), "one attention layer: one kept set"
    assert hybrid_run.free_blocks_after == hybrid_run.free_blocks_before
    with pytest.raises(KVPolicyConfigError, match="anchors"):  # anchors index attention layers: only 0 exists
        run_engine(hybrid_model, [_prompt()], "cords", engine_kwargs=BF16, budget=256, slack=64, anchors=[1])


def test_a_compressed_hybrid_equals_the_hf_reference(hybrid_run):
    from cords_vllm.lab.reference.hf import HFReference

    assert hybrid_run.spared, "the run must give a freed block to attention again in its compression's step"
    reference = HFReference(build_tiny_model(TinyModelSpec(family="qwen3_5", dtype="bfloat16")), dtype=torch.float32)
    assert_exact_with_control(hybrid_run, reference, VIDEO_PROMPT, video(48), TOL, control_factor=CONTROL_FACTOR)


@pytest.mark.slow  # in -m slow (make test-slow): a second compressed run, to show what the sparing fixes
def test_zeroing_the_freed_blocks_first_loses_kept_tokens(hybrid_model, monkeypatch):
    from cords_vllm.lab.reference.exactness import chunks_for, evictions_of
    from cords_vllm.lab.reference.hf import HFReference
    from tests.engine.conftest import logprob_gap

    monkeypatch.setattr(plans, "spare_freed_blocks", lambda output, step_plans: None)
    run = run_engine(hybrid_model, [_prompt()], "cords", max_tokens=4, engine_kwargs=BF16, budget=256, slack=64)
    reference = HFReference(build_tiny_model(TinyModelSpec(family="qwen3_5", dtype="bfloat16")), dtype=torch.float32)
    evictions = evictions_of(run.events)
    ref = reference.run(VIDEO_PROMPT, video(48), max_new_tokens=4, evictions=evictions, forced_tokens=run.token_ids[0],
                        chunk_sizes=chunks_for(run.prompt_lens[0], evictions))
    assert logprob_gap(run, ref) > TOL  # 0.03 to 0.07: vLLM zeroed blocks the workers then copied kept tokens from
