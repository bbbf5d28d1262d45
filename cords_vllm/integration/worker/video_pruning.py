"""vLLM's own video pruning (``--video-pruning-rate``, EVS / VidCom2) made to run: two fixes of vLLM 0.32 (workers).

EVS drops video tokens before the prompt is laid out (so every frame's kept tokens sit in frame 0's slot of the
placeholder) and recomputes the request's M-RoPE positions at run time, in the model runner's
``_gather_mm_embeddings``, when ``runner.is_multimodal_pruning_enabled`` says so. Two things of vLLM 0.32 break it:

* **The CPU runner never turns the recomputation on.** ``GPUModelRunner.load_model`` sets
  ``is_multimodal_pruning_enabled`` after loading the model; ``CPUModelRunner.load_model`` replaces that method and
  never does, so the flag keeps ``__init__``'s ``False``, the pruned embeddings (which carry their positions in
  extra channels) are merged unstripped and the first video prefill dies ("Error during index put operation").
  :func:`make_cpu_load_model` sets the flag as the GPU runner computes it. It acts only where a
  ``CPUModelRunner`` is built (the CPU platform), only when pruning is asked for and the model supports it, and
  never lowers a flag vLLM set itself.
* **Qwen3-VL takes a prompt's outer ``<|vision_start|>`` for a frame's.** With transformers >= 5.10 the processor
  expands only the bare ``<|video_pad|>``, so a prompt written the usual way (``<|vision_start|><|video_pad|>
  <|vision_end|>``, as the chat template renders it) keeps its outer markers around the per-frame
  ``<t seconds><|vision_start|>...<|vision_end|>`` layout. EVS's ``recompute_mrope_positions``
  (``multimodal/video_prune/evs.py``) finds each media's start as the next ``<|vision_start|>`` token, takes the
  outer one for the first frame's, lays the video's positions out from the wrong token and fails ("The expanded
  size of the tensor (0) must match ..."), on every device.
  :func:`make_recompute_mrope_positions` hides, from that search only, every ``<|vision_start|>`` that does not
  open media: one not followed by an image or video token or by ``<|vision_end|>`` (a frame EVS emptied). The
  positions are then those of the bare-placeholder prompt, shifted by the outer marker.

Not fixed here (vLLM 0.32, every device): Qwen3-VL's recomputation is not chunk-invariant. When a prefill chunk
ends inside a pruned video, the next chunk's search counts the frame's timestamp from the chunk's piece of the
video and gives some of its tokens other positions than one whole-prompt chunk would (29 of 283 on the test clip;
bare or wrapped prompt alike). Qwen2.5-VL's positions are the same for any chunking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Stands in for a hidden ``<|vision_start|>``: no token has this id, so it is text to EVS's position search.
HIDDEN_MARKER = -1


def pruning_enabled(runner: Any) -> bool:
    """Whether the runner's model prunes video, computed as ``GPUModelRunner.load_model`` computes
    ``is_multimodal_pruning_enabled`` (the model supports pruning and ``--video-pruning-rate`` > 0)."""
    from vllm.model_executor.models.interfaces import supports_multimodal_pruning

    mm_config = runner.model_config.multimodal_config
    return bool(supports_multimodal_pruning(runner.get_model()) and mm_config is not None
                and mm_config.is_multimodal_pruning_enabled())


def outer_vision_starts(input_ids: list[int] | torch.Tensor, vision_start: int, opening: tuple[int, ...]
                        ) -> torch.Tensor:
    """Indices (``long [k]``, on ``input_ids``' device) of the ``vision_start`` tokens that open no media: those
    not directly followed by a token of ``opening`` (image and video pads, ``<|vision_end|>``)."""
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.long)
    following = torch.full_like(ids, HIDDEN_MARKER)
    following[:-1] = ids[1:]
    opens = torch.isin(following, torch.tensor(opening, dtype=ids.dtype, device=ids.device))
    return ((ids == vision_start) & ~opens).nonzero(as_tuple=True)[0]


def hide_outer_vision_starts(input_ids: list[int] | torch.Tensor, vision_start: int, opening: tuple[int, ...]
                             ) -> list[int] | torch.Tensor:
    """``input_ids`` with every :func:`outer_vision_starts` token replaced by :data:`HIDDEN_MARKER` (a copy; the
    input itself when there is none). A list stays a list, a tensor a tensor on its device."""
    if isinstance(input_ids, torch.Tensor):
        outer = outer_vision_starts(input_ids, vision_start, opening)
        hidden = input_ids.clone()
        hidden[outer] = HIDDEN_MARKER  # no host sync: the copy is made whether or not there is a marker to hide
        return hidden
    outer = outer_vision_starts(input_ids, vision_start, opening).tolist()
    if not outer:
        return input_ids
    hidden = list(input_ids)
    for i in outer:
        hidden[i] = HIDDEN_MARKER
    return hidden


# ------------------------------------------------------------------------------------------------------
# Wrappers (``make(original) -> wrapper``), installed by the patch table.
def make_cpu_load_model(original: Callable) -> Callable:
    """``CPUModelRunner.load_model``, then ``is_multimodal_pruning_enabled`` as the GPU runner sets it."""
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not self.is_multimodal_pruning_enabled and pruning_enabled(self):
            self.is_multimodal_pruning_enabled = True
    return load_model


def make_recompute_mrope_positions(original: Callable) -> Callable:
    """Qwen3-VL's ``recompute_mrope_positions`` on the prompt with its outer ``<|vision_start|>`` markers hidden."""
    def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
        config = self.config
        opening = (config.image_token_id, config.video_token_id, config.vision_end_token_id)
        input_ids = hide_outer_vision_starts(input_ids, config.vision_start_token_id, opening)
        return original(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens)
    return recompute_mrope_positions
