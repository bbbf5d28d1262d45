"""An independent HF transformers reference for LLaVA-NeXT-Video, with optional KV eviction (fp32 comparisons).

The same interface as :class:`~cords_vllm.lab.reference.hf.HFReference` (chunked prefill, per layer / per KV head
eviction of the ids not kept before any chunk, teacher forcing), for ``LlavaNextVideoForConditionalGeneration``:
a CLIP tower whose second-to-last layer's patch features (CLS dropped) are average-pooled per frame and projected,
scattered over the ``<video>`` placeholder tokens, then a Llama text model with 1-D rotary positions.

Positions follow vLLM: a request's rows stay logical within a request, so every token's position is its index in
the prompt whatever was evicted before it, kept tokens keep theirs (keys are cached after rotary, so gathering
the kept entries is all eviction needs) and decode step ``t`` takes position ``L + t``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from cords_vllm.lab.reference.hf import ReferenceResult, check_chunks, evict


class HFLlavaNextVideoReference:
    """An HF ``LlavaNextVideoForConditionalGeneration`` (fp32 by default) and its processor, from a local checkpoint.

    Videos are given to the processor as decoded frames and never re-sampled (``do_sample_frames=False``).
    """

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoProcessor, LlavaNextVideoForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = LlavaNextVideoForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
        self.config = self.model.config

    @torch.no_grad()
    def encode(self, prompt: str, video: np.ndarray | Sequence[np.ndarray] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prompt text (one ``<video>`` placeholder per video) + its videos (``[T, H, W, 3]`` each, in prompt order).

        Returns ``(input_ids [L], inputs_embeds [1, L, hidden], positions [L], 0)``: positions are the token
        indices (the last value, the decode offset, is always 0 for 1-D rotary; the tuple mirrors
        :meth:`~cords_vllm.lab.reference.hf.HFReference.encode`).
        """
        videos = None if video is None else list(video) if isinstance(video, list | tuple) else [video]
        kwargs = {"do_sample_frames": False} if videos else {}
        enc = self.processor(text=[prompt], videos=videos, return_tensors="pt", **kwargs)
        ids = enc["input_ids"]
        cfg = self.config
        emb = self.model.model.get_input_embeddings()(ids)
        if videos:
            feats = self.model.model.get_video_features(
                enc["pixel_values_videos"].to(emb.dtype), vision_feature_layer=cfg.vision_feature_layer,
                vision_feature_select_strategy=cfg.vision_feature_select_strategy, return_dict=True).pooler_output
            rows = torch.cat([f.flatten(0, 1) for f in feats], 0)  # [frames * tokens_per_frame, hidden]
            mask = (ids == cfg.video_token_id).unsqueeze(-1).expand_as(emb)
            if int(mask[..., 0].sum()) != rows.shape[0]:
                raise ValueError(f"{int(mask[..., 0].sum())} <video> tokens for {rows.shape[0]} video features")
            emb = emb.masked_scatter(mask, rows.to(emb.dtype))
        return ids[0], emb, torch.arange(ids.shape[1]), 0

    @torch.no_grad()
    def run(self, prompt: str, video: np.ndarray | Sequence[np.ndarray] | None = None, *, max_new_tokens: int = 8,
            chunk_sizes: Sequence[int] | None = None, evictions: Mapping[int, Sequence[torch.Tensor]] | None = None,
            forced_tokens: Sequence[int] | None = None) -> ReferenceResult:
        """Prefill (optionally chunked, with evictions) and decode ``max_new_tokens`` tokens.

        Parameters
        ----------
        video:
            The prompt's videos (see :meth:`encode`).
        chunk_sizes:
            Prefill chunk lengths summing to the prompt length (default: one chunk).
        evictions:
            ``{chunk_start: per_layer_keep}`` applied right before the chunk starting at logical token
            ``chunk_start``; ``per_layer_keep[l]`` is an int64 tensor of logical token ids to keep in layer ``l``,
            ``[n_keep]`` (all heads) or ``[H, n_keep]`` (per KV head). Ids not currently held are an error.
        forced_tokens:
            Teacher-forced continuation (e.g. the engine's output); default: the reference's own greedy tokens.

        Returns a :class:`~cords_vllm.lab.reference.hf.ReferenceResult` (``logits`` ``[max_new_tokens, vocab]``).
        """
        from transformers import DynamicCache

        ids, emb, pos, _ = self.encode(prompt, video)
        length = int(ids.numel())
        chunks, evictions = check_chunks(length, chunk_sizes, evictions)

        lm = self.model.model.language_model
        text = self.config.text_config
        cache = DynamicCache(config=text)
        num_layers, num_kv = text.num_hidden_layers, text.num_key_value_heads
        held = [torch.empty(num_kv, 0, dtype=torch.long) for _ in range(num_layers)]
        start = 0
        for n in chunks:
            if start in evictions:
                evict(cache, held, evictions[start])
            out = lm(inputs_embeds=emb[:, start:start + n], position_ids=pos[None, start:start + n],
                     past_key_values=cache, use_cache=True)
            new = torch.arange(start, start + n).expand(num_kv, n)
            held = [torch.cat([h, new], dim=1) for h in held]
            start += n
        logits = [self.model.lm_head(out.last_hidden_state[0, -1]).float()]
        kept_at_prompt_end = [h.clone() for h in held]
        tokens = [int(logits[0].argmax())]
        embed = self.model.model.get_input_embeddings()
        for t in range(max_new_tokens - 1):
            tok = forced_tokens[t] if forced_tokens is not None else tokens[-1]
            out = lm(inputs_embeds=embed(torch.tensor([[tok]])), position_ids=torch.tensor([[length + t]]),
                     past_key_values=cache, use_cache=True)
            logits.append(self.model.lm_head(out.last_hidden_state[0, -1]).float())
            tokens.append(int(logits[-1].argmax()))
        return ReferenceResult(token_ids=tokens, logits=torch.stack(logits), kept_logical=kept_at_prompt_end)
