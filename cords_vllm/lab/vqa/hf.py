"""Running the video-QA task through HF transformers' Qwen2-VL (training and reference evaluation).

The HF inputs are built without the HF processor, for speed, but equal to what it produces (a test checks
it): :func:`patchify` is ``Qwen2VLVideoProcessor`` for frames already at a size it keeps
(:func:`patchify_images` the image processor, for the frames sent as images), the prompt is
:func:`cords_vllm.lab.vqa.prompt.build_prompt` with each pad expanded to its input's tokens, and the position ids
are vLLM's M-RoPE ids (:mod:`cords_vllm.lab.vqa.positions`, :func:`cords_vllm.lab.reference.hf.vllm_mrope_positions`).
Every function takes ``inputs``: ``"video"`` (one video per prompt) or ``"images"`` (every frame its own
image, in order: how evaluation clients send a video). Batches mix families: rows are
right-padded, which a causal model never attends to, and each row's answer logits are read at its own
last prompt token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cords_vllm.lab.reference.hf import vllm_mrope_positions
from cords_vllm.lab.vqa.positions import mrope_positions
from cords_vllm.lab.vqa.prompt import IMAGE_PAD, INPUT_SHAPES, VIDEO_PAD, build_prompt
from cords_vllm.lab.vqa.tasks import VQAExample
from cords_vllm.lab.vqa.video import MERGE, PATCH, TEMPORAL_PATCH, VideoGeometry

#: CLIP normalisation used by Qwen2-VL's image and video processors.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def patchify(videos: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL video patches of a batch of same-shape videos.

    Parameters
    ----------
    videos:
        ``uint8 [B, T, H, W, 3]`` with ``T`` a multiple of 2 and ``H, W`` multiples of 28.

    Returns
    -------
    pixel_values_videos:
        ``float32 [B * t * h * w, 3 * 2 * 14 * 14]`` with ``t = T / 2``, ``h = H / 14``, ``w = W / 14``,
        rows ordered (video, t, h / 2, w / 2, 2, 2) like ``Qwen2VLVideoProcessor``.
    video_grid_thw:
        ``int64 [B, 3]``, each row ``(t, h, w)``.
    """
    v = torch.as_tensor(np.asarray(videos))
    b, t_count, height, width, channels = v.shape
    gt, gh, gw = t_count // TEMPORAL_PATCH, height // PATCH, width // PATCH
    if t_count % TEMPORAL_PATCH or gh % MERGE or gw % MERGE or height % PATCH or width % PATCH:
        raise ValueError(f"video shape {tuple(v.shape)} is not a whole number of merged patches")
    x = v.float().div_(255.0)
    x = (x - torch.tensor(IMAGE_MEAN)) / torch.tensor(IMAGE_STD)
    x = x.permute(0, 1, 4, 2, 3)                                          # [B, T, C, H, W]
    x = x.reshape(b, gt, TEMPORAL_PATCH, channels, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)                           # B, t, h/2, w/2, 2, 2, C, 2, P, P
    x = x.reshape(b * gt * gh * gw, channels * TEMPORAL_PATCH * PATCH * PATCH).contiguous()
    grid = torch.tensor([[gt, gh, gw]] * b, dtype=torch.long)
    return x, grid


def patchify_images(videos: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL image patches of every frame of a batch of same-shape videos, each frame its own image.

    ``Qwen2VLImageProcessor`` repeats an image over the temporal patch, so an image's patches are those of a
    two-frame video of that frame.

    Parameters
    ----------
    videos:
        ``uint8 [B, T, H, W, 3]`` with ``H, W`` multiples of 28.

    Returns
    -------
    pixel_values:
        ``float32 [B * T * h * w, 3 * 2 * 14 * 14]`` (``h = H / 14``, ``w = W / 14``), rows ordered
        (video, frame, h / 2, w / 2, 2, 2).
    image_grid_thw:
        ``int64 [B * T, 3]``, each row ``(1, h, w)``.
    """
    v = np.asarray(videos)
    pixels, grid = patchify(np.repeat(v, TEMPORAL_PATCH, axis=1))
    frames = v.shape[0] * v.shape[1]
    return pixels, torch.tensor([[1, *grid[0, 1:].tolist()]] * frames, dtype=torch.long)


@dataclass(frozen=True)
class PromptLayout:
    """Token ids and positions of one question's prompt with the video pad expanded.

    Attributes
    ----------
    ids:
        ``int64 [L]`` prompt token ids.
    positions:
        ``int64 [3, L]`` M-RoPE position ids (vLLM's rule).
    video_start, video_stop:
        ``[video_start, video_stop)`` spans the vision tokens (with frames sent as images: from the first
        image's first token to the last image's last, the markers between images included).
    """

    ids: torch.Tensor
    positions: torch.Tensor
    video_start: int
    video_stop: int


@dataclass
class HFBatch:
    """A right-padded batch for ``Qwen2VLForConditionalGeneration``.

    Attributes
    ----------
    input_ids:
        ``int64 [B, L]`` (``L`` the longest prompt; padding with the tokenizer's pad id).
    position_ids:
        ``int64 [3, B, L]``.
    pixel_values_videos, video_grid_thw:
        See :func:`patchify` (``None`` for frames sent as images).
    pixel_values, image_grid_thw:
        See :func:`patchify_images` (``None`` for videos).
    last_index:
        ``int64 [B]``, index of each row's last prompt token (where the answer is predicted).
    answer_ids:
        ``int64 [B]``, token id of each row's answer word.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    last_index: torch.Tensor
    answer_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of ``Qwen2VLModel.forward``."""
        vision = {k: v for k, v in (("pixel_values_videos", self.pixel_values_videos),
                                    ("video_grid_thw", self.video_grid_thw), ("pixel_values", self.pixel_values),
                                    ("image_grid_thw", self.image_grid_thw)) if v is not None}
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, **vision}


def video_t_factor(config: Any, fps: float = 2.0) -> float:
    """Temporal positions per temporal patch of a video at ``fps`` for a model ``config``: Qwen2.5-VL's
    ``second_per_grid_t * tokens_per_second`` (``temporal_patch_size / fps`` seconds a patch), else 1."""
    vision = getattr(config, "vision_config", None)
    per_second = getattr(vision, "tokens_per_second", None)
    if not per_second:
        return 1.0
    return getattr(vision, "temporal_patch_size", TEMPORAL_PATCH) / fps * per_second


class HFEncoder:
    """Turns :class:`VQAExample` s into :class:`HFBatch` es for one tokenizer (prompt layouts cached)."""

    def __init__(self, tokenizer: Any, t_factor: float = 1.0) -> None:
        self.tokenizer = tokenizer
        #: Temporal positions per temporal patch of a video (:func:`video_t_factor`).
        self.t_factor = t_factor
        self.video_pad_id = int(tokenizer.convert_tokens_to_ids(VIDEO_PAD))
        self.image_pad_id = int(tokenizer.convert_tokens_to_ids(IMAGE_PAD))
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.convert_tokens_to_ids("<|endoftext|>"))
        self._layouts: dict[tuple[str, VideoGeometry, str], PromptLayout] = {}
        self._answers: dict[str, int] = {}

    def answer_id(self, word: str) -> int:
        """Token id of an answer word; raises if the word is not exactly one token."""
        if word not in self._answers:
            ids = self.tokenizer.encode(word, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"answer {word!r} is {len(ids)} tokens for this tokenizer; it must be one")
            self._answers[word] = int(ids[0])
        return self._answers[word]

    def layout(self, question: str, geometry: VideoGeometry, inputs: str = "video") -> PromptLayout:
        """The :class:`PromptLayout` of ``question`` for videos of ``geometry`` sent as ``inputs``."""
        key = (question, geometry, inputs)
        if key in self._layouts:
            return self._layouts[key]
        if inputs == "video":
            ids = self.tokenizer.encode(build_prompt(question), add_special_tokens=False)
            where = [i for i, t in enumerate(ids) if t == self.video_pad_id]
            if len(where) != 1:
                raise ValueError(f"the prompt must hold one {VIDEO_PAD} token, found {len(where)}")
            start, n = where[0], geometry.num_video_tokens
            full = ids[:start] + [self.video_pad_id] * n + ids[start + 1:]
            positions = mrope_positions(start, geometry.llm_grid, len(full) - start - n, self.t_factor)
            layout = PromptLayout(torch.tensor(full, dtype=torch.long), positions, start, start + n)
        elif inputs == "images":
            ids = self.tokenizer.encode(build_prompt(question, images=geometry.num_frames), add_special_tokens=False)
            if sum(t == self.image_pad_id for t in ids) != geometry.num_frames:
                raise ValueError(f"the prompt must hold {geometry.num_frames} {IMAGE_PAD} tokens")
            per_image = geometry.tokens_per_patch
            full = [x for t in ids for x in ([t] * per_image if t == self.image_pad_id else [t])]
            side = geometry.size // PATCH
            positions, _ = vllm_mrope_positions(full, {self.image_pad_id: [(1, side, side)] * geometry.num_frames},
                                                MERGE)
            pads = [i for i, t in enumerate(full) if t == self.image_pad_id]
            layout = PromptLayout(torch.tensor(full, dtype=torch.long), positions, pads[0], pads[-1] + 1)
        else:
            raise ValueError(f"inputs must be one of {INPUT_SHAPES}, got {inputs!r}")
        self._layouts[key] = layout
        return layout

    def encode(self, examples: Sequence[VQAExample], inputs: str = "video") -> HFBatch:
        """Batch ``examples`` (all with the same video geometry; questions may differ), sent as ``inputs``."""
        if not examples:
            raise ValueError("empty batch")
        geometry = examples[0].geometry
        if any(e.geometry != geometry for e in examples):
            raise ValueError("a batch needs one video geometry")
        layouts = [self.layout(e.question, geometry, inputs) for e in examples]
        length = max(len(x.ids) for x in layouts)
        b = len(examples)
        ids = torch.full((b, length), self.pad_id, dtype=torch.long)
        positions = torch.zeros((3, b, length), dtype=torch.long)
        for row, x in enumerate(layouts):
            n = len(x.ids)
            ids[row, :n] = x.ids
            positions[:, row, :n] = x.positions
            positions[:, row, n:] = x.positions[:, -1:] + torch.arange(1, length - n + 1)
        frames = np.stack([e.frames for e in examples])
        last = torch.tensor([len(x.ids) - 1 for x in layouts], dtype=torch.long)
        answers = torch.tensor([self.answer_id(e.answer) for e in examples], dtype=torch.long)
        if inputs == "images":
            pixels, grid = patchify_images(frames)
            return HFBatch(ids, positions, None, None, last, answers, pixel_values=pixels, image_grid_thw=grid)
        pixels, grid = patchify(frames)
        return HFBatch(ids, positions, pixels, grid, last, answers)


def answer_logits(model: Any, batch: HFBatch) -> torch.Tensor:
    """Next-token logits ``float [B, vocab]`` at each row's last prompt token.

    ``model`` is a ``Qwen2VLForConditionalGeneration``; gradients flow when called outside ``no_grad``.
    """
    out = model.model(**batch.model_inputs(), use_cache=False)
    hidden = out.last_hidden_state[torch.arange(len(batch.last_index)), batch.last_index]  # [B, hidden]
    return model.lm_head(hidden)


@torch.no_grad()
def predict(model: Any, encoder: HFEncoder, examples: Sequence[VQAExample], *, batch_size: int = 32,
            candidates: Sequence[str] | None = None, inputs: str = "video") -> list[str]:
    """Greedy one-token answers of ``model`` (eval mode is the caller's business) to the videos sent as
    ``inputs``.

    With ``candidates``, the argmax is taken over those words only (a closed-vocabulary readout);
    otherwise over the whole vocabulary, as an engine's greedy decoding does.
    """
    cand_ids = torch.tensor([encoder.answer_id(w) for w in candidates]) if candidates else None
    out: list[str] = []
    for i in range(0, len(examples), batch_size):
        logits = answer_logits(model, encoder.encode(examples[i:i + batch_size], inputs)).float()
        best = cand_ids[logits[:, cand_ids].argmax(-1)] if cand_ids is not None else logits.argmax(-1)
        out += [encoder.tokenizer.decode([int(t)]) for t in best]
    return out


#: HF's own vision attention ``forward`` per class while :func:`fast_vision_attention` is active (fallback path).
_ORIGINAL_VISION_FORWARD: dict[type, Any] = {}


def _batched_vision_attention(self: Any, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                              max_seqlen: int | None = None, **kwargs: Any) -> torch.Tensor:
    """``VisionAttention.forward`` with one batched SDPA call when all chunks (frames) have one length.

    ``hidden_states``: ``[seq, embed]``; returns ``[seq, embed]``. Same math as HF's per-chunk loop.
    """
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen

    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if position_embeddings is None or not bool((lengths == lengths[0]).all()):
        return _ORIGINAL_VISION_FORWARD[type(self)](self, hidden_states, cu_seqlens, position_embeddings, max_seqlen,
                                           **kwargs)
    chunks, chunk_len = lengths.numel(), int(lengths[0])
    seq = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = qwen.apply_rotary_pos_emb_vision(q, k, cos, sin)
    q, k, v = (x.reshape(chunks, chunk_len, self.num_heads, -1).transpose(1, 2) for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scaling)  # [chunks, H, len, D]
    return self.proj(o.transpose(1, 2).reshape(seq, -1))


@contextlib.contextmanager
def fast_vision_attention() -> Iterator[None]:
    """Within the block, HF Qwen2-VL's (and Qwen2.5-VL's) vision attention runs all frames in one SDPA call instead
    of a Python loop over frames (several times faster for 32+ temporal patches; identical math). Qwen2.5-VL's
    window attention takes the same path when its windows are equal (a window covering a whole frame)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen25
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen

    classes = (qwen.VisionAttention, qwen25.Qwen2_5_VLVisionAttention)
    originals = [c.forward for c in classes]
    _ORIGINAL_VISION_FORWARD.clear()
    _ORIGINAL_VISION_FORWARD.update(zip(classes, originals, strict=True))
    for cls in classes:
        cls.forward = _batched_vision_attention
    try:
        yield
    finally:
        for cls, original in zip(classes, originals, strict=True):
            cls.forward = original
