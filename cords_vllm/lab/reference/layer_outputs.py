"""Every layer's attention output at the answer, in the HF reference: full KV against a policy's evictions.

The engine's compressions are replayed in :class:`~cords_vllm.lab.reference.hf.HFReference` (the suite proves it
equal to the engine for the same evictions); forward hooks read each attention layer's output (after its output
projection) at the prompt's last position, where the answer token is read. The relative error
``||o_full - o_policy|| / ||o_full||`` per layer says where a policy's evictions start to change what the model
computes, question by question (:func:`layer_errors`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cords_vllm.lab.reference.exactness import chunks_for


def attention_outputs(reference: Any, prompt: str, frames: np.ndarray, length: int,
                      evictions: Mapping[int, Sequence[torch.Tensor | None]] | None = None) -> torch.Tensor:
    """``[L, hidden]``: each attention layer's output at the prompt's last token, the ``length`` prompt tokens (the
    engine's count) prefilled in chunks that start at the ``evictions``' points (``{at_token: kept per layer}``, as
    :func:`~cords_vllm.lab.reference.exactness.evictions_of` gives; ``None``: full KV, one chunk)."""
    layers = reference.model.model.language_model.layers
    seen: dict[int, torch.Tensor] = {}

    def hook(index: int):
        def capture(module, args, output):
            seen[index] = output[0][0, -1].detach().clone()  # the chunk's last token; the last chunk wins
        return capture

    # a compression at the prompt's end acts after the answer was read: only earlier ones matter here
    evictions = {at: kept for at, kept in (evictions or {}).items() if at < length}
    handles = [layers[i].self_attn.register_forward_hook(hook(i)) for i in reference.attention_layers]
    try:
        reference.run(prompt, frames, max_new_tokens=1, chunk_sizes=chunks_for(length, evictions),
                      evictions=evictions)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([seen[i] for i in reference.attention_layers])


def layer_errors(full: torch.Tensor, policy: torch.Tensor) -> torch.Tensor:
    """``[L]`` relative errors ``||policy - full|| / ||full||`` of ``[L, hidden]`` attention outputs."""
    if full.shape != policy.shape:
        raise ValueError(f"attention outputs of different shapes: {tuple(full.shape)} and {tuple(policy.shape)}")
    return (policy.double() - full.double()).norm(dim=-1) / full.double().norm(dim=-1).clamp_min(1e-30)
