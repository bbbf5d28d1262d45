"""An independent HF transformers reference for Qwen2-VL, with optional KV eviction (fp32 comparisons).

The reference prefills a prompt chunk by chunk, can drop tokens from each layer's (and each KV head's)
cache before any chunk, and decodes greedily (or teacher-forced with another run's tokens), returning the
logits of every generated position. Used to prove that the engine keeps the model's math: without eviction
it must match vLLM token for token; with the engine's own kept indices at the same points it must match
the compressed engine.

Positions follow vLLM, not transformers: vLLM's ``get_mrope_input_positions`` starts the text after a video
at ``max(vision positions) + 1``, while transformers 5.19's ``get_rope_index`` advances by a different amount
(the two agree only when the video's ``T == H / merge``). Evicted tokens keep their original positions: the
cache stores keys after rotary embedding, so gathering kept entries is all eviction needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


def vllm_mrope_positions(input_ids: Sequence[int], video_grid_thw: Sequence[Sequence[int]] | None,
                         video_token_id: int, spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Qwen2-VL M-RoPE position ids as vLLM computes them, for a prompt with any number of videos.

    Returns ``(positions [3, L] int64, delta)`` where decode step ``t`` (0-based, after the prompt) uses
    position ``L + t + delta`` on all three axes.
    """
    ids = np.asarray(input_ids)
    grids = list(video_grid_thw or [])
    parts: list[np.ndarray] = []
    start = 0  # next text index
    next_pos = 0
    video_positions = np.nonzero(ids == video_token_id)[0]
    cursor = 0
    for t, h, w in grids:
        hh, ww = h // spatial_merge_size, w // spatial_merge_size
        n = t * hh * ww
        first = int(video_positions[cursor])
        if not np.all(video_positions[cursor:cursor + n] == np.arange(first, first + n)):
            raise ValueError("each video's placeholder tokens must be contiguous")
        text_len = first - start
        parts.append(np.broadcast_to(np.arange(text_len) + next_pos, (3, text_len)))
        grid = np.indices((t, hh, ww)).reshape(3, -1) + next_pos + text_len
        parts.append(grid)
        next_pos = int(grid.max()) + 1
        start = first + n
        cursor += n
    if cursor != len(video_positions):
        raise ValueError("video_grid_thw does not account for every video token")
    tail = len(ids) - start
    parts.append(np.broadcast_to(np.arange(tail) + next_pos, (3, tail)))
    pos = np.concatenate(parts, axis=1)
    delta = int(pos.max()) + 1 - len(ids)
    return torch.from_numpy(np.ascontiguousarray(pos)).long(), delta


@dataclass
class ReferenceResult:
    """Output of :func:`run_reference`.

    Attributes
    ----------
    token_ids:
        Greedy tokens (argmax of each step's logits), ``len == max_new_tokens``.
    logits:
        ``[max_new_tokens, vocab]`` fp32 logits; row 0 is the prompt's last position.
    kept_logical:
        Per layer, ``[H, n_held]`` logical token ids held in that layer's cache at the end of the prompt.
    """

    token_ids: list[int]
    logits: torch.Tensor
    kept_logical: list[torch.Tensor] = field(default_factory=list)


class HFQwen2VLReference:
    """An HF ``Qwen2VLForConditionalGeneration`` in fp32 plus its processor, loaded from a local checkpoint."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
        self.config = self.model.config

    def encode(self, prompt: str, video: np.ndarray | Sequence[np.ndarray] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prompt text (one ``<|video_pad|>`` placeholder per video) + optional ``[T, H, W, 3]`` video(s).

        ``video`` is one video or a list of videos, in prompt order (e.g. the clips of a live stream).
        Returns ``(input_ids [L], inputs_embeds [1, L, hidden], positions [3, L], mrope_delta)``.
        """
        videos = None if video is None else list(video) if isinstance(video, list | tuple) else [video]
        enc = self.processor(text=[prompt], videos=videos, return_tensors="pt")
        ids = enc["input_ids"]
        with torch.no_grad():
            emb = self.model.model.get_input_embeddings()(ids)
            grid = None
            if videos:
                feats = self.model.model.get_video_features(enc["pixel_values_videos"], enc["video_grid_thw"],
                                                            return_dict=True)
                vemb = torch.cat(list(feats.pooler_output), 0).to(emb.dtype)
                mask = (ids == self.config.video_token_id).unsqueeze(-1).expand_as(emb)
                emb = emb.masked_scatter(mask, vemb)
                grid = enc["video_grid_thw"].tolist()
        pos, delta = vllm_mrope_positions(ids[0].tolist(), grid, self.config.video_token_id,
                                          self.config.vision_config.spatial_merge_size)
        return ids[0], emb, pos, delta

    @torch.no_grad()
    def run(self, prompt: str, video: np.ndarray | Sequence[np.ndarray] | None = None, *, max_new_tokens: int = 8,
            chunk_sizes: Sequence[int] | None = None,
            evictions: Mapping[int, Sequence[torch.Tensor]] | None = None,
            forced_tokens: Sequence[int] | None = None) -> ReferenceResult:
        """Prefill (optionally chunked, with evictions) and decode ``max_new_tokens`` tokens.

        Parameters
        ----------
        chunk_sizes:
            Prefill chunk lengths summing to the prompt length (default: one chunk).
        evictions:
            ``{chunk_start: per_layer_keep}`` applied right before the chunk starting at logical token
            ``chunk_start``; ``per_layer_keep[l]`` is an int64 tensor of logical token ids to keep in layer
            ``l``, either ``[n_keep]`` (all heads) or ``[H, n_keep]`` (per KV head). Ids not currently held
            are an error.
        forced_tokens:
            Teacher-forced continuation (e.g. the engine's output); default: the reference's own greedy
            tokens.
        """
        ids, emb, pos, delta = self.encode(prompt, video)
        length = int(ids.numel())
        chunks = list(chunk_sizes) if chunk_sizes is not None else [length]
        if sum(chunks) != length or any(c <= 0 for c in chunks):
            raise ValueError(f"chunk_sizes must be positive and sum to the prompt length {length}")
        evictions = dict(evictions or {})
        starts = set(np.cumsum([0, *chunks[:-1]]).tolist())
        if not set(evictions) <= starts:
            raise ValueError(f"evictions at {sorted(set(evictions) - starts)} are not chunk starts")

        from transformers import DynamicCache

        lm = self.model.model.language_model
        text = self.config.text_config
        cache = DynamicCache(config=text)
        num_layers, num_kv = text.num_hidden_layers, text.num_key_value_heads
        held = [torch.empty(num_kv, 0, dtype=torch.long) for _ in range(num_layers)]
        logits: list[torch.Tensor] = []
        start = 0
        for n in chunks:
            if start in evictions:
                self._evict(cache, held, evictions[start])
            out = lm(inputs_embeds=emb[:, start:start + n], position_ids=pos[:, None, start:start + n],
                     past_key_values=cache, use_cache=True)
            new = torch.arange(start, start + n).expand(num_kv, n)
            held = [torch.cat([h, new], dim=1) for h in held]
            start += n
        logits.append(self.model.lm_head(out.last_hidden_state[0, -1]).float())
        kept_at_prompt_end = [h.clone() for h in held]
        tokens = [int(logits[0].argmax())]
        embed = self.model.model.get_input_embeddings()
        for t in range(max_new_tokens - 1):
            tok = forced_tokens[t] if forced_tokens is not None else tokens[-1]
            p = torch.full((3, 1, 1), length + t + delta, dtype=torch.long)
            out = lm(inputs_embeds=embed(torch.tensor([[tok]])), position_ids=p, past_key_values=cache,
                     use_cache=True)
            logits.append(self.model.lm_head(out.last_hidden_state[0, -1]).float())
            tokens.append(int(logits[-1].argmax()))
        return ReferenceResult(token_ids=tokens, logits=torch.stack(logits), kept_logical=kept_at_prompt_end)

    @staticmethod
    def _evict(cache, held: list[torch.Tensor], keep_per_layer: Sequence[torch.Tensor]) -> None:
        if len(keep_per_layer) != len(held):
            raise ValueError(f"eviction needs one keep tensor per layer ({len(held)}), got {len(keep_per_layer)}")
        for layer, keep in enumerate(keep_per_layer):
            h = held[layer]  # [H, T] logical ids in cache order
            keep = torch.as_tensor(keep, dtype=torch.long)
            keep = keep.expand(h.shape[0], -1) if keep.dim() == 1 else keep
            # position of each kept logical id inside this layer/head's cache
            match = h.unsqueeze(2) == keep.unsqueeze(1)  # [H, T, n_keep]
            if not bool(match.any(dim=1).all()):
                raise ValueError(f"layer {layer}: eviction keeps ids that are not held")
            index = match.float().argmax(dim=1)  # [H, n_keep]
            entry = cache.layers[layer]
            gather = index[None, :, :, None].expand(entry.keys.shape[0], -1, -1, entry.keys.shape[-1])
            entry.keys = torch.gather(entry.keys, 2, gather).contiguous()
            entry.values = torch.gather(entry.values, 2, gather).contiguous()
            held[layer] = torch.gather(h, 1, index)
