"""Attention-scored policies see the queries the model computed: the engine's first SnapKV / StreamMem / InfiniPot
compression keeps exactly what the selector keeps on HF transformers' own queries and keys of the same prompt
(layer 0, rotary applied), the rows being the newest video tokens (SnapKV), the text before the video and its
vision-start marker (StreamMem), or that text read after the newest token (InfiniPot: HF runs it at positions moved
there)."""

from __future__ import annotations

import pytest
import torch

from cords_vllm.selection import Observation, get_selector
from cords_vllm.selection.exact import select_exact
from tests.engine.conftest import VIDEO_PROMPT, run_engine, video

pytestmark = pytest.mark.engine

WINDOW = 8
RECENT = 48


def _hf_queries_and_keys(reference, prompt: str, frames, length: int, shift: int = 0, layer: int = 0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s queries ``[Hq, length, D]`` and keys ``[H, length, D]`` (rotary applied) of the prompt's
    first ``length`` tokens, every position moved ``shift`` further, read where HF hands them to its attention
    function."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[str, torch.Tensor] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == layer:
            seen["q"], seen["k"] = query[0].clone(), key[0].clone()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("cords_capture", capture)
    enc = reference.encoded(prompt, frames)
    lm = reference.model.model.language_model
    previous = lm.config._attn_implementation
    lm.config._attn_implementation = "cords_capture"
    try:
        with torch.no_grad():
            lm(inputs_embeds=enc.embeds[:, :length], position_ids=enc.positions[:, None, :length] + shift,
               use_cache=False)
    finally:
        lm.config._attn_implementation = previous
    return seen["q"], seen["k"]


@pytest.mark.parametrize(("policy", "layer", "per_head"), [
    ("snapkv", 0, False), ("streammem", 0, False), ("infinipot", 0, False),
    # the per-layer, per-KV-head variants: a layer past the first, each head on its own queries
    ("snapkv_layerwise", 2, True), ("streammem_layerwise", 2, True), ("infinipot_layerwise", 2, True)])
def test_first_compression_keeps_what_hf_queries_choose(tiny_model, hf_reference, policy, layer, per_head):
    base = policy.removesuffix("_layerwise")
    frames = video(32, seed=11)
    window = {"snapkv": {"window": WINDOW}, "streammem": {"proxy_tokens": WINDOW},
              "infinipot": {"catalyst_tokens": WINDOW}}[base]
    run = run_engine(tiny_model, [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": frames}}], policy,
                     max_tokens=2, budget=192, recent=RECENT, slack=64, granularity="token", **window)
    first = run.events[0]
    at, region_end = first.at_token, first.region_blocks * 32
    ids = hf_reference.encoded(VIDEO_PROMPT, frames).ids
    cfg = hf_reference.config
    pads = (ids == cfg.video_token_id).nonzero().flatten()
    markers = torch.tensor([int(pads[0]) - 1, int(pads[-1]) + 1])
    q, k = _hf_queries_and_keys(hf_reference, VIDEO_PROMPT, frames, at, layer=layer)
    if base == "snapkv":
        rows = pads[pads < at][-WINDOW:]
        visible = torch.arange(region_end)[None, :] <= rows[:, None]
    else:  # the text before the video's first candidate, its vision-start marker (the scheduler's candidates)
        rows = torch.arange(max(int(markers[0]) - WINDOW, 0), int(markers[0]))
        visible = torch.ones(rows.numel(), region_end, dtype=torch.bool)
    if base == "infinipot":  # the catalyst rows as HF computes them once moved right after the newest token
        newest = int(hf_reference.encoded(VIDEO_PROMPT, frames).positions[:, :at].max())
        q, _ = _hf_queries_and_keys(hf_reference, VIDEO_PROMPT, frames, int(markers[0]), newest + 1 - int(rows[0]),
                                    layer=layer)
    is_video = torch.zeros(at, dtype=torch.bool)
    is_video[pads[pads < at]] = True
    is_video[markers[markers < at]] = True
    # the region's newest video tokens that belong to the recent window are protected in this compression
    num_recent = max(RECENT - int(is_video[region_end:].sum()), 0)
    candidates = is_video[:region_end].clone()
    candidates[candidates.nonzero().flatten()[candidates.sum() - num_recent:]] = False
    heads = k.shape[0]
    group = q.shape[0] // heads
    # a joint selection keeps the same tokens in every head (checked on head 0); per head, each head its own
    problems = [(h, k[h:h + 1], q[h * group:(h + 1) * group]) for h in range(heads)] if per_head else [(0, k, q)]
    kept_per_head = []
    for head, keys_h, queries_h in problems:
        kept = first.kept_logical[layer][head]
        kept_region = kept[kept < region_end]
        kept_per_head.append(kept_region)
        need = int(candidates[kept_region].sum())
        keys = keys_h[:, :region_end][None]
        observation = Observation(queries_h[:, rows][None], visible[None])
        ref = select_exact(get_selector(base, **window), keys, keys, need, candidates=candidates[None],
                           observation=observation)
        assert need < int(candidates.sum())  # the compression evicted video tokens
        assert torch.equal(kept_region, ref[0]), (policy, layer, head)
        # A control: the same selection on other queries (the keys' own rows) keeps other tokens.
        other = Observation(keys_h.repeat_interleave(group, 0)[:, rows][None], visible[None])
        wrong = select_exact(get_selector(base, **window), keys, keys, need, candidates=candidates[None],
                             observation=other)
        assert not torch.equal(kept_region, wrong[0])
    if per_head:  # the heads really chose apart (else per-head selection would be untested)
        assert any(not torch.equal(kept_per_head[0], other) for other in kept_per_head[1:])
