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


def vllm_mrope_positions(input_ids: Sequence[int], grids: Mapping[int, Sequence[Sequence[int]]],
                         spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Qwen2-VL M-RoPE position ids as vLLM computes them, for a prompt with any images and videos.

    ``grids`` maps each placeholder token id (the image pad, the video pad) to the ``(t, h, w)`` patch grids
    of that modality's inputs, in prompt order (a processor's ``image_grid_thw`` / ``video_grid_thw``). An
    input's tokens get ``(t, h, w)`` grid positions offset by the position after the text before it (an
    image is a grid with ``t == 1``, so every image has its own temporal position); text after an input
    starts at ``max(its positions) + 1``.

    Returns ``(positions [3, L] int64, delta)`` where decode step ``t`` (0-based, after the prompt) uses
    position ``L + t + delta`` on all three axes.
    """
    ids = np.asarray(input_ids)
    queues = {token: list(g) for token, g in grids.items()}
    placeholder = np.isin(ids, list(queues))
    parts: list[np.ndarray] = []
    start = 0  # next text index
    next_pos = 0
    while True:
        found = np.nonzero(placeholder[start:])[0]
        if found.size == 0:
            break
        first = start + int(found[0])
        token = int(ids[first])
        if not queues[token]:
            raise ValueError(f"more inputs of placeholder token {token} in the prompt than grids")
        t, h, w = queues[token].pop(0)
        hh, ww = h // spatial_merge_size, w // spatial_merge_size
        n = t * hh * ww
        if not np.all(ids[first:first + n] == token):
            raise ValueError(f"an input of placeholder token {token} has fewer than its grid's {n} tokens")
        text_len = first - start
        parts.append(np.broadcast_to(np.arange(text_len) + next_pos, (3, text_len)))
        grid = np.indices((t, hh, ww)).reshape(3, -1) + next_pos + text_len
        parts.append(grid)
        next_pos = int(grid.max()) + 1
        start = first + n
    if any(queues.values()):
        raise ValueError("the grids name more inputs than the prompt's placeholders")
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

    def encode(self, prompt: str, video: np.ndarray | Sequence[np.ndarray] | None = None, *,
               images: Sequence[np.ndarray] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prompt text (one ``<|video_pad|>`` / ``<|image_pad|>`` placeholder per input) + its inputs.

        ``video`` is one ``[T, H, W, 3]`` video or a list of them, in prompt order (e.g. the clips of a live
        stream); ``images`` are ``[H, W, 3]`` images in prompt order. Images and videos may interleave in the
        prompt. Returns ``(input_ids [L], inputs_embeds [1, L, hidden], positions [3, L], mrope_delta)``.
        """
        videos = None if video is None else list(video) if isinstance(video, list | tuple) else [video]
        images = list(images) if images else None
        enc = self.processor(text=[prompt], videos=videos, images=images, return_tensors="pt")
        ids = enc["input_ids"]
        grids: dict[int, list] = {}
        with torch.no_grad():
            emb = self.model.model.get_input_embeddings()(ids)
            if videos:
                feats = self.model.model.get_video_features(enc["pixel_values_videos"], enc["video_grid_thw"],
                                                            return_dict=True)
                emb = self._scatter(emb, ids, self.config.video_token_id, feats.pooler_output)
                grids[self.config.video_token_id] = enc["video_grid_thw"].tolist()
            if images:
                feats = self.model.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"],
                                                            return_dict=True)
                emb = self._scatter(emb, ids, self.config.image_token_id, feats.pooler_output)
                grids[self.config.image_token_id] = enc["image_grid_thw"].tolist()
        pos, delta = vllm_mrope_positions(ids[0].tolist(), grids, self.config.vision_config.spatial_merge_size)
        return ids[0], emb, pos, delta

    @staticmethod
    def _scatter(emb: torch.Tensor, ids: torch.Tensor, token: int, features: Sequence[torch.Tensor]
                 ) -> torch.Tensor:
        """``emb`` ``[1, L, hidden]`` with the placeholder ``token``'s rows replaced by ``features`` in order."""
        mask = (ids == token).unsqueeze(-1).expand_as(emb)
        return emb.masked_scatter(mask, torch.cat(list(features), 0).to(emb.dtype))

    @torch.no_grad()
    def run(self, prompt: str, video: np.ndarray | Sequence[np.ndarray] | None = None, *,
            images: Sequence[np.ndarray] | None = None, max_new_tokens: int = 8,
            chunk_sizes: Sequence[int] | None = None,
            evictions: Mapping[int, Sequence[torch.Tensor]] | None = None,
            forced_tokens: Sequence[int] | None = None) -> ReferenceResult:
        """Prefill (optionally chunked, with evictions) and decode ``max_new_tokens`` tokens.

        Parameters
        ----------
        video, images:
            The prompt's inputs (see :meth:`encode`).
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
        ids, emb, pos, delta = self.encode(prompt, video, images=images)
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
