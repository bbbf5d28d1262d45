"""The hybrid Qwen3.5 (three Gated DeltaNet layers to one full-attention layer, bf16: the CPU build's only dtype
for it): refused under a policy by default, compressible as an experiment.

With ``CORDS_VLLM_EXPERIMENTAL_HYBRID=1`` only the attention group is compressed (anchors count attention layers,
the state groups are left alone) and every block comes back. Its outputs do not yet equal the HF reference that
drops the same tokens as closely as every other family's (a strict xfail below: it fails loudly once fixed).
"""

from __future__ import annotations

import gc

import pytest
import torch

from cords_vllm.config import KVPolicyConfigError
from cords_vllm.integration.startup.checks import EXPERIMENTAL_HYBRID_ENV
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_model
from tests.engine.conftest import VIDEO_PROMPT, chunks_for, evictions_of, run_engine, video
from tests.engine.test_families import clip

pytestmark = pytest.mark.engine

BF16 = {"dtype": "bfloat16", "block_size": None}  # vLLM sets a hybrid's attention block size (256 here)
#: bf16 engine against the fp32 reference, uncompressed: 0.006 on this model.
TOL = 0.02


@pytest.fixture(scope="module")
def hybrid_model() -> str:
    return str(build_tiny_model(TinyModelSpec(family="qwen3_5", dtype="bfloat16")))


def _prompt():
    return {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": clip(video(48))}}


def test_a_hybrid_model_is_refused_by_default(hybrid_model, monkeypatch):
    monkeypatch.delenv(EXPERIMENTAL_HYBRID_ENV, raising=False)
    with pytest.raises(KVPolicyConfigError, match=EXPERIMENTAL_HYBRID_ENV):
        run_engine(hybrid_model, [_prompt()], "cords", engine_kwargs=BF16, budget=256, slack=64)
    plain = run_engine(hybrid_model, [_prompt()], "none", max_tokens=2, engine_kwargs=BF16)
    assert len(plain.token_ids[0]) == 2  # --kv-policy none serves it


@pytest.fixture(scope="module")
def hybrid_run(hybrid_model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EXPERIMENTAL_HYBRID_ENV, "1")
        run = run_engine(hybrid_model, [_prompt()], "cords", max_tokens=4, engine_kwargs=BF16, budget=256, slack=64)
    gc.collect()
    return run


def test_only_the_attention_group_is_compressed_and_every_block_returns(hybrid_run, hybrid_model, monkeypatch):
    assert len(hybrid_run.events) >= 2
    assert all(len(e.kept_logical) == 1 for e in hybrid_run.events), "one attention layer: one kept set"
    assert hybrid_run.free_blocks_after == hybrid_run.free_blocks_before
    monkeypatch.setenv(EXPERIMENTAL_HYBRID_ENV, "1")
    with pytest.raises(KVPolicyConfigError, match="anchors"):  # anchors index attention layers: only 0 exists
        run_engine(hybrid_model, [_prompt()], "cords", engine_kwargs=BF16, budget=256, slack=64, anchors=[1])


@pytest.mark.slow  # in -m slow (make test-slow): keeps the default suite under 20 minutes
@pytest.mark.xfail(strict=True, reason="on vLLM 0.32's CPU build a compressed hybrid differs from the HF reference "
                                       "with the same evictions by 0.03-0.07 in log-prob (0.006 uncompressed)")
def test_a_compressed_hybrid_equals_the_hf_reference(hybrid_run):
    from cords_vllm.lab.reference.hf import HFReference

    reference = HFReference(build_tiny_model(TinyModelSpec(family="qwen3_5", dtype="bfloat16")), dtype=torch.float32)
    frames = video(48)
    evictions = evictions_of(hybrid_run.events)
    ref = reference.run(VIDEO_PROMPT, frames, max_new_tokens=4, evictions=evictions,
                        chunk_sizes=chunks_for(hybrid_run.prompt_lens[0], evictions),
                        forced_tokens=hybrid_run.token_ids[0])
    ref_lp = ref.logits.log_softmax(-1)
    gap = max(abs(v - float(ref_lp[s, t])) for s, top in enumerate(hybrid_run.logprobs[0]) for t, v in top.items())
    assert gap < TOL
