"""Layer-selective compression (``compressed_layers``): the lower layers compressed, the upper layers whole, in the
real engine.

* vLLM's own grouping puts exactly the compressed layers in a KV cache group of their own, as
  :func:`~cords_vllm.compress.layer_scope.kv_cache_layout` forecasts, for many layer counts.
* The engine equals the HF reference that evicts the engine's tokens from layers 0-1 and none from layers 2-3.
  Two negative controls: the reference without evictions, and the reference that also evicts from the upper
  layers (what the engine would do if it compressed every layer) both disagree clearly.
* Memory, in the pool's own units (layer-token pages): every layer compressed < lower half compressed < none, and
  what the engine publishes counts the whole layers' blocks too.
* Admission leaves room for the whole rows the running requests still grow into (no preemption).
* A live stream is refused alone (its upper layers would grow without bound); the engine serves on.
"""

from __future__ import annotations

import pytest

from cords_vllm.compress.layer_scope import kv_cache_layout
from cords_vllm.config import KVPolicyConfigError, kv_policy_args
from cords_vllm.integration.inprocess.introspect import scheduler_of, snapshot
from cords_vllm.integration.inprocess.llm import make_llm
from cords_vllm.integration.inprocess.session import EngineSession, SessionClosed
from cords_vllm.lab.reference.exactness import evictions_of
from tests.engine.conftest import BLOCK, CHUNK, VIDEO_PROMPT, chunks_for, logprob_gap, run_engine, video

pytestmark = pytest.mark.engine

TOL = 2e-4
LAYERS = 4  # the tiny model's
SETTINGS = {"budget": 256, "slack": 64}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_vllm_groups_the_compressed_layers_apart_as_forecast(layout):
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cords_vllm.integration.kv_groups import is_compressed, mark_compressed_layers

    config = VllmConfig()
    config.cache_config.kv_cache_layout = layout
    for layers in (4, 12, 28, 36):
        for compressed in range(1, layers):
            spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
            specs = mark_compressed_layers({f"model.layers.{i}.self_attn.attn": spec for i in range(layers)},
                                           compressed)
            groups = get_kv_cache_groups(config, specs)
            forecast = kv_cache_layout(compressed, layers)
            kinds = [is_compressed(g.kv_cache_spec) for g in groups]
            assert (kinds.count(True), kinds.count(False)) == (forecast.compressed_groups, forecast.whole_groups)
            sizes = [len(g.layer_names) for g in groups]  # a group's padding layers are not named
            assert max(sizes) == forecast.group_size
            assert sum(forecast.group_size - n for n in sizes) == forecast.padding_layers
            held = sorted(int(n.split(".")[2]) for g in groups if is_compressed(g.kv_cache_spec)
                          for n in g.layer_names)
            assert held == list(range(compressed))


def test_engine_equals_reference_that_keeps_the_upper_layers_whole(tiny_model, hf_reference):
    frames = video(48)
    prompt = {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}
    run = run_engine(tiny_model, [prompt], "cords", max_tokens=6, compressed_layers=2, **SETTINGS)
    assert len(run.events) >= 2 and all(len(e.kept_logical) == 2 for e in run.events)
    evictions = evictions_of(run.events, num_layers=LAYERS)
    chunks = chunks_for(run.prompt_lens[0], evictions)
    forced = {"max_new_tokens": 6, "forced_tokens": run.token_ids[0]}
    ref = hf_reference.run(VIDEO_PROMPT, frames, chunk_sizes=chunks, evictions=evictions, **forced)
    assert ref.token_ids == run.token_ids[0]
    assert logprob_gap(run, ref) < TOL
    # controls: no evictions at all, and the upper layers evicted like the lower ones (each follows its anchor, 0)
    uncompressed = hf_reference.run(VIDEO_PROMPT, frames, **forced)
    assert logprob_gap(run, uncompressed) > 50 * TOL
    every_layer = {at: [kept[0], kept[1], kept[0], kept[0]] for at, kept in evictions.items()}
    compressed_everywhere = hf_reference.run(VIDEO_PROMPT, frames, chunk_sizes=chunks, evictions=every_layer, **forced)
    assert logprob_gap(run, compressed_everywhere) > 50 * TOL
    assert run.free_blocks_after == run.free_blocks_before


def test_memory_sits_between_every_layer_and_none(tiny_model):
    prompts = [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(48)}}]
    runs = {"none": run_engine(tiny_model, prompts, "none", max_tokens=2),
            LAYERS: run_engine(tiny_model, prompts, "cords", max_tokens=2, **SETTINGS)}
    runs[2] = run_engine(tiny_model, prompts, "cords", max_tokens=2, compressed_layers=2, **SETTINGS)
    whole_row = -(-(runs["none"].prompt_lens[0] + 1) // BLOCK)
    assert runs["none"].published_peak == whole_row
    # a block holds one page of each of its group's layers: compare layer-token pages
    pages = {"none": whole_row * LAYERS}
    for compressed in (2, LAYERS):
        run, layout = runs[compressed], kv_cache_layout(compressed, LAYERS)
        pages[compressed] = run.published_peak * layout.group_size
        assert run.compressions == runs[LAYERS].compressions  # the same plans, on fewer layers
        # the published peak counts every group: each whole group holds every token, the compressed one its part
        compressed_row = run.published_peak - layout.whole_groups * whole_row
        assert 0 < compressed_row <= max(run.max_blocks_held.values()) == max(runs[LAYERS].max_blocks_held.values())
    assert pages[LAYERS] < pages[2] < pages["none"]


def test_admission_keeps_room_for_the_whole_rows_still_to_grow(tiny_model):
    """Four videos, a pool for about two and a half: a request's whole rows grow to its whole prompt, so admitting
    next to running requests must leave them room (without it this run preempts once)."""
    prompts = [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(48, seed=s)}} for s in range(4)]
    run = run_engine(tiny_model, prompts, "cords", max_tokens=4, compressed_layers=2,
                     engine_kwargs={"kv_cache_memory_bytes": 10 << 20, "max_model_len": 2048}, **SETTINGS)
    assert run.num_preemptions == 0
    assert run.max_running >= 2
    assert run.free_blocks_after == run.free_blocks_before


def test_live_stream_is_refused_alone(tiny_model):
    llm = make_llm(tiny_model, block_size=BLOCK, max_num_scheduled_tokens=CHUNK,
                   **kv_policy_args("cords", compressed_layers=2, **SETTINGS))
    groups = scheduler_of(llm).kv_cache_config.kv_cache_groups
    assert [g.layer_names for g in groups] == [[f"language_model.model.layers.{i}.self_attn.attn" for i in (0, 1)],
                                               [f"language_model.model.layers.{i}.self_attn.attn" for i in (2, 3)]]
    free = snapshot(llm).free_blocks
    session = EngineSession(llm, "stream")
    with pytest.raises(SessionClosed):
        session.push({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(8)}})
    from vllm import SamplingParams

    out = llm.generate([{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": video(8)}}],
                       SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert snapshot(llm).free_blocks == free


@pytest.mark.parametrize(("config", "match"), [
    ({"compressed_layers": 3}, "at most 2 of the 4 layers"),
    ({"compressed_layers": 2, "anchors": [0, 2]}, r"names layer 2, but the compressed layers are 0\.\.1"),
])
def test_start_up_refuses_a_scope_the_model_cannot_have(tiny_model, config, match):
    with pytest.raises(KVPolicyConfigError, match=match):
        make_llm(tiny_model, block_size=BLOCK, **kv_policy_args("cords", **config))
