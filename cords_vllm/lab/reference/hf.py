"""An independent HF transformers reference for the Qwen-VL families, with optional KV eviction (fp32 comparisons).

Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the family is read from the checkpoint (``AutoModelForImageTextToText``).

The reference prefills a prompt chunk by chunk, can drop tokens from each layer's (and each KV head's)
cache before any chunk, and decodes greedily (or teacher-forced with another run's tokens), returning the
logits of every generated position. Used to prove that the engine keeps the model's math: without eviction
it must match vLLM token for token; with the engine's own kept indices at the same points it must match
the compressed engine.

Positions follow vLLM, not transformers: vLLM's ``get_mrope_input_positions`` starts the text after a video
at ``max(vision positions) + 1``, while transformers 5.19's ``get_rope_index`` advances by a different amount
(the two agree only when the video's ``T == H / merge``). Qwen2.5-VL's temporal coordinates are scaled by
``second_per_grid_t * tokens_per_second`` (absolute time); Qwen3-VL writes each frame's timestamp as text, so
each frame is its own ``1 x h x w`` grid after its timestamp tokens, and its deepstack features are added to the
first layers' hidden states chunk by chunk as the engine does. Evicted tokens keep their original positions: the
cache stores keys after rotary embedding, so gathering kept entries is all eviction needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def vllm_mrope_positions(input_ids: Sequence[int], grids: Mapping[int, Sequence[Sequence[float]]],
                         spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Qwen-VL M-RoPE position ids as vLLM computes them, for a prompt with any images and videos.

    ``grids`` maps each placeholder token id (the image pad, the video pad) to the ``(t, h, w)`` patch grids
    of that modality's inputs, in prompt order (a processor's ``image_grid_thw`` / ``video_grid_thw``), one per
    contiguous run of the placeholder; a grid may carry a fourth value, its temporal factor (Qwen2.5-VL:
    ``second_per_grid_t * tokens_per_second``; default 1). An input's tokens get ``(t * factor, h, w)`` grid
    positions (the temporal one truncated to an integer) offset by the position after the text before it (an
    image is a grid with ``t == 1``, so every image has its own temporal position); text after an input starts
    at ``max(its positions) + 1``.

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
        t, h, w, *factor = queues[token].pop(0)
        t, hh, ww = int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size
        n = t * hh * ww
        if not np.all(ids[first:first + n] == token):
            raise ValueError(f"an input of placeholder token {token} has fewer than its grid's {n} tokens")
        text_len = first - start
        parts.append(np.broadcast_to(np.arange(text_len) + next_pos, (3, text_len)))
        indices = np.indices((t, hh, ww))
        if factor and float(factor[0]) != 1.0:
            indices[0] = (indices[0] * float(factor[0])).astype(np.int64)
        grid = indices.reshape(3, -1) + next_pos + text_len
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


def check_chunks(length: int, chunk_sizes: Sequence[int] | None,
                 evictions: Mapping[int, Sequence[torch.Tensor]] | None) -> tuple[list[int], dict]:
    """``(chunks, evictions)`` of a reference run over ``length`` prompt tokens: every chunk positive, their sum the
    prompt, every eviction at a chunk start (``ValueError`` otherwise)."""
    chunks = list(chunk_sizes) if chunk_sizes is not None else [length]
    if sum(chunks) != length or any(c <= 0 for c in chunks):
        raise ValueError(f"chunk_sizes must be positive and sum to the prompt length {length}")
    evictions = dict(evictions or {})
    starts = set(np.cumsum([0, *chunks[:-1]]).tolist())
    if not set(evictions) <= starts:
        raise ValueError(f"evictions at {sorted(set(evictions) - starts)} are not chunk starts")
    return chunks, evictions


def evict(cache, held: list[torch.Tensor], keep_per_layer: Sequence[torch.Tensor],
          layers: Sequence[int] | None = None) -> None:
    """Keep only ``keep_per_layer[i]`` (logical ids, ``[n]`` or ``[H, n]``) in cache layer ``layers[i]`` (default:
    layer ``i``) of an HF ``DynamicCache``.

    ``held[i]`` is ``long [H, T]``: the logical id of each entry of that layer's cache (``keys`` ``[1, H, T, D]``),
    per KV head, in cache order; both are gathered in place to the kept ids, in the order given. A ``None`` entry
    keeps its layer whole (layer-selective compression).
    """
    if len(keep_per_layer) != len(held):
        raise ValueError(f"eviction needs one keep tensor per attention layer ({len(held)}), got "
                         f"{len(keep_per_layer)}")
    layers = list(range(len(held))) if layers is None else list(layers)
    for slot, (layer, keep) in enumerate(zip(layers, keep_per_layer, strict=True)):
        if keep is None:
            continue
        ids = held[slot]
        keep = torch.as_tensor(keep, dtype=torch.long)
        keep = keep.expand(ids.shape[0], -1) if keep.dim() == 1 else keep
        match = ids.unsqueeze(2) == keep.unsqueeze(1)  # [H, T, n_keep]
        if not bool(match.any(dim=1).all()):
            raise ValueError(f"layer {layer}: eviction keeps ids that are not held")
        index = match.float().argmax(dim=1)  # [H, n_keep]: where each kept id sits in the cache
        entry = cache.layers[layer]
        gather = index[None, :, :, None].expand(entry.keys.shape[0], -1, -1, entry.keys.shape[-1])
        entry.keys = torch.gather(entry.keys, 2, gather).contiguous()
        entry.values = torch.gather(entry.values, 2, gather).contiguous()
        held[slot] = torch.gather(ids, 1, index)


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


@dataclass
class Encoded:
    """A prompt as the language model takes it.

    ``ids`` ``[L]``; ``embeds`` ``[1, L, hidden]``; ``positions`` ``[3, L]``; ``delta``: decode step ``t`` takes
    position ``L + t + delta``; ``visual`` ``[L]`` bool, the placeholder tokens (Qwen3-VL); ``deepstack``: per
    early layer, ``[n_visual, hidden]`` features added to that layer's output at the placeholder rows (Qwen3-VL),
    else ``None``.
    """

    ids: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor
    delta: int
    visual: torch.Tensor | None = None
    deepstack: list[torch.Tensor] | None = None


class HFReference:
    """An HF Qwen-VL model (``Qwen2VL``, ``Qwen2_5_VL``, ``Qwen3VL`` ``ForConditionalGeneration``) in fp32 plus its
    processor, loaded from a local checkpoint.

    Videos are given to the processor with ``fps`` (metadata, as the engine gets it: Qwen2.5-VL's temporal
    positions and Qwen3-VL's timestamps depend on it) and never re-sampled.
    """

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32, fps: float = 2.0) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
        self.config = self.model.config
        self.fps = fps
        #: Qwen3-VL: each frame is its own grid after its timestamp text.
        self.frames_as_grids = self.config.model_type.startswith("qwen3")

    def encode(self, prompt: str, video: np.ndarray | Sequence[np.ndarray] | None = None, *,
               images: Sequence[np.ndarray] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prompt text (one ``<|video_pad|>`` / ``<|image_pad|>`` placeholder per input) + its inputs.

        ``video`` is one ``[T, H, W, 3]`` video or a list of them, in prompt order (e.g. the clips of a live
        stream); ``images`` are ``[H, W, 3]`` images in prompt order. Images and videos may interleave in the
        prompt. Returns ``(input_ids [L], inputs_embeds [1, L, hidden], positions [3, L], mrope_delta)``.
        """
        enc = self.encoded(prompt, video, images=images)
        return enc.ids, enc.embeds, enc.positions, enc.delta

    def encoded(self, prompt: str, video: np.ndarray | Sequence[np.ndarray] | None = None, *,
                images: Sequence[np.ndarray] | None = None) -> Encoded:
        """:meth:`encode` with the deepstack inputs (:class:`Encoded`)."""
        videos = None if video is None else list(video) if isinstance(video, list | tuple) else [video]
        images = list(images) if images else None
        kwargs: dict = {}
        if videos:
            kwargs = {"video_metadata": [{"fps": self.fps, "total_num_frames": len(v), "duration": len(v) / self.fps,
                                          "frames_indices": list(range(len(v)))} for v in videos],
                      "do_sample_frames": False}
        enc = self.processor(text=[prompt], videos=videos, images=images, return_tensors="pt", **kwargs)
        ids = enc["input_ids"]
        cfg = self.config
        grids: dict[int, list] = {}
        visual = torch.zeros_like(ids[0], dtype=torch.bool)
        deep: dict[int, list[torch.Tensor]] = {}
        with torch.no_grad():
            emb = self.model.model.get_input_embeddings()(ids)
            for token, pixels, thw, features in (
                    (cfg.video_token_id, "pixel_values_videos", "video_grid_thw", self.model.model.get_video_features),
                    (cfg.image_token_id, "pixel_values", "image_grid_thw", self.model.model.get_image_features)):
                if thw not in enc:
                    continue
                feats = features(enc[pixels], enc[thw], return_dict=True)
                emb = self._scatter(emb, ids, token, feats.pooler_output)
                visual |= ids[0] == token
                if getattr(feats, "deepstack_features", None):
                    deep[token] = [torch.cat(list(f), 0) for f in feats.deepstack_features]
                grids[token] = self._grids(enc, thw)
        pos, delta = vllm_mrope_positions(ids[0].tolist(), grids, cfg.vision_config.spatial_merge_size)
        deepstack = None
        if deep:  # one row per placeholder token in prompt order (images and videos interleaved)
            layers = len(next(iter(deep.values())))
            kinds = ids[0][visual]
            deepstack = []
            for layer in range(layers):
                rows = torch.zeros(int(visual.sum()), emb.shape[-1], dtype=emb.dtype)
                for token, feats in deep.items():
                    rows[kinds == token] = feats[layer].to(emb.dtype)
                deepstack.append(rows)
        return Encoded(ids[0], emb, pos, delta, visual if deepstack else None, deepstack)

    def _grids(self, enc: Mapping, thw_key: str) -> list[list[float]]:
        """One grid per contiguous placeholder run: ``(t, h, w[, t_factor])``."""
        thw = enc[thw_key].tolist()
        if self.frames_as_grids and thw_key == "video_grid_thw":
            return [[1, h, w] for t, h, w in thw for _ in range(t)]
        per_grid = enc.get("second_per_grid_ts") if thw_key == "video_grid_thw" else None
        per_second = getattr(self.config.vision_config, "tokens_per_second", None)
        if per_grid is None or per_second is None:
            return thw
        return [[t, h, w, float(s) * per_second] for (t, h, w), s in zip(thw, per_grid.tolist(), strict=True)]

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
            ``chunk_start``; ``per_layer_keep[l]`` is an int64 tensor of logical token ids to keep in attention
            layer ``l`` (a hybrid model's recurrent-state layers are not counted), either ``[n_keep]`` (all heads)
            or ``[H, n_keep]`` (per KV head), or ``None`` to keep the layer whole (layer-selective compression:
            the layers then hold different lengths, and each gets its own causal mask). Ids not currently held
            are an error.
        forced_tokens:
            Teacher-forced continuation (e.g. the engine's output); default: the reference's own greedy
            tokens.
        """
        enc = self.encoded(prompt, video, images=images)
        chunks, evictions = check_chunks(int(enc.ids.numel()), chunk_sizes, evictions)

        from transformers import DynamicCache

        cache = DynamicCache(config=self.config.text_config)
        uneven = any(keep is None for per_layer in evictions.values() for keep in per_layer)
        hooks = self._layer_masks(cache) if uneven else []
        try:
            return self._generate(enc, cache, chunks, evictions, max_new_tokens, forced_tokens)
        finally:
            for hook in hooks:
                hook.remove()

    def _generate(self, enc: Encoded, cache: Any, chunks: Sequence[int],
                  evictions: Mapping[int, Sequence[torch.Tensor | None]], max_new_tokens: int,
                  forced_tokens: Sequence[int] | None) -> ReferenceResult:
        """:meth:`run`'s prefill and decode on an empty ``cache``."""
        emb, pos, delta = enc.embeds, enc.positions, enc.delta
        length = int(enc.ids.numel())
        lm = self.model.model.language_model
        num_kv = self.config.text_config.num_key_value_heads
        held = [torch.empty(num_kv, 0, dtype=torch.long) for _ in self.attention_layers]
        logits: list[torch.Tensor] = []
        start = 0
        for n in chunks:
            if start in evictions:
                self._evict(cache, held, evictions[start])
            out = lm(inputs_embeds=emb[:, start:start + n], position_ids=pos[:, None, start:start + n],
                     past_key_values=cache, use_cache=True, **self._deepstack(enc, start, n),
                     **self._hybrid_mask(n, held[0].shape[1]))
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
                     use_cache=True, **self._hybrid_mask(1, held[0].shape[1] + t))
            logits.append(self.model.lm_head(out.last_hidden_state[0, -1]).float())
            tokens.append(int(logits[-1].argmax()))
        return ReferenceResult(token_ids=tokens, logits=torch.stack(logits), kept_logical=kept_at_prompt_end)

    @staticmethod
    def _deepstack(enc: Encoded, start: int, n: int) -> dict:
        """The deepstack arguments of the chunk ``[start, start + n)`` (none when the model has none)."""
        if enc.deepstack is None:
            return {}
        mask = enc.visual[start:start + n]
        first = int(enc.visual[:start].sum())
        rows = slice(first, first + int(mask.sum()))
        return {"visual_pos_masks": mask[None], "deepstack_visual_embeds": [d[rows] for d in enc.deepstack]}

    def _layer_masks(self, cache: Any) -> list[Any]:
        """Forward pre-hooks giving each attention layer the causal mask of its own cache length, for layers that
        hold different lengths (layer-selective evictions); transformers builds one mask from layer 0's length.
        Returns the hook handles (remove them after the run)."""
        if len(self.attention_layers) != self.config.text_config.num_hidden_layers:
            raise NotImplementedError("per-layer evictions that keep some layers whole need a non-hybrid model")
        handles = []
        for index, layer in enumerate(self.model.model.language_model.layers):
            def hook(module, args, kwargs, index=index):
                n = kwargs["hidden_states"].shape[1]
                past = cache.get_seq_length(index)
                kwargs["attention_mask"] = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)[None, None]
                return args, kwargs
            handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
        return handles

    def _hybrid_mask(self, n: int, held: int) -> dict:
        """A hybrid model's masks for ``n`` new tokens after ``held`` cached ones (none for other models).

        transformers sizes a hybrid's causal mask from its first layer's cache, a recurrent one that counts every
        token seen, not the attention cache an eviction shortened: the mask would then let a chunk's tokens see
        the tokens after them. The causal mask is given explicitly instead (``[1, 1, n, held + n]``, true where
        attention is allowed), and no padding mask for the recurrent layers.
        """
        if len(self.attention_layers) == self.config.text_config.num_hidden_layers:
            return {}
        causal = torch.ones(n, held + n, dtype=torch.bool).tril(diagonal=held)
        return {"attention_mask": {"full_attention": causal[None, None], "linear_attention": None}}

    @property
    def attention_layers(self) -> list[int]:
        """Decoder layers with a per-token KV cache: all of them, or a hybrid's full-attention layers (Qwen3.5)."""
        text = self.config.text_config
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        return [i for i, kind in enumerate(types) if kind == "full_attention"]

    def _evict(self, cache, held: list[torch.Tensor], keep_per_layer: Sequence[torch.Tensor]) -> None:
        evict(cache, held, keep_per_layer, self.attention_layers)


#: The name from before other families (the class reads the family from the checkpoint).
HFQwen2VLReference = HFReference
