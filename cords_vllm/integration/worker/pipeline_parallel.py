"""Pipeline parallelism in the workers: each stage's anchors (the vLLM side of :mod:`cords_vllm.compress.pipeline`),
and the CPU build's missing buffer for a later stage's input.

* **Anchors.** A stage's worker holds only its own layers. Each layer's anchor is mapped by its index in the model
  (never by its position on the stage), under the rule every stage shares: the first layer of every later stage,
  and of the first stage when it holds no configured anchor, becomes an anchor
  (:func:`~cords_vllm.compress.pipeline.pipeline_anchors`). The worker checks, once, that the layers it holds are
  the ones vLLM's layout gives its stage and that every one of them follows an anchor on the stage, so a layout
  this module does not know fails at start-up instead of selecting on another layer's positions.
* **The CPU build's intermediate buffer** (vLLM 0.32, any policy, ``none`` included). A stage after the first
  copies the hidden states it receives into ``GPUModelRunner.intermediate_tensors``, a buffer that only the warm-up
  dummy run allocates. The CPU worker skips that warm-up in eager mode (``CPUModelRunner.warming_up_model`` returns
  at once without compilation, and ``CPUWorker`` does not even call it with an explicit KV cache size), so the
  first step of stage 1 dies on ``assert self.intermediate_tensors is not None``.
  :func:`make_compile_or_warm_up_model` allocates it after the warm-up, as the dummy run would have, only on a
  later stage where it is still missing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from cords_vllm.compress.pipeline import PipelineAnchorError, attention_ordinals, pipeline_anchors, stage_anchor_of
from cords_vllm.config import KVPolicyConfig
from cords_vllm.integration.engine_facts import attention_stages_of

logger = logging.getLogger(__name__)


def stage_anchors(config: KVPolicyConfig, vllm_config: Any, decoder_layers: Sequence[int]) -> tuple[int, ...]:
    """For each of this worker's attention layers (``decoder_layers``: their decoder indices, in order), the
    position among them of the anchor it follows.

    Raises :class:`~cords_vllm.compress.pipeline.PipelineAnchorError` when the worker holds other layers than
    vLLM's layout gives its stage (its compressed layers under layer-selective compression), and
    ``KVPolicyConfigError`` when ``anchors`` names a layer the model lacks.
    """
    from vllm.distributed import get_pp_group

    stages = attention_stages_of(vllm_config)
    rank = get_pp_group().rank_in_group if len(stages) > 1 else 0
    stage, total = stages[rank], stages[-1].stop
    if config.layer_selective(total):  # the worker holds the compressed layers only (never under pipelines)
        stage = range(stage.start, min(stage.stop, config.compressed_layers))
    mc = vllm_config.model_config
    types = getattr(mc.hf_text_config, "layer_types", None)
    held = attention_ordinals(decoder_layers, types if mc.is_hybrid and types else None)
    if held != list(stage):
        raise PipelineAnchorError(
            f"cords-vllm: pipeline stage {rank} holds attention layers {held}, but vLLM's layout gives it "
            f"{stage.start}..{stage.stop - 1}; the policy cannot map its anchors")
    config.check_model(total)
    effective = dataclasses.replace(config, anchors=pipeline_anchors(config.anchors, stages))
    anchor_of = stage_anchor_of(lambda layer: effective.anchor_of(layer, total), stage)
    if len(stages) > 1:
        configured = "all" if config.anchors is None else list(config.anchors)
        logger.info("cords-vllm: pipeline stage %d holds attention layers %d..%d and selects on its anchors %s "
                    "(configured: %s)", rank, stage.start, stage.stop - 1,
                    sorted({stage.start + a for a in anchor_of}), configured)
    return anchor_of


def make_compile_or_warm_up_model(original: Callable) -> Callable:
    """``CPUWorker.compile_or_warm_up_model``, then the later stage's intermediate buffer if the warm-up left none."""
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        from vllm.distributed import get_pp_group

        runner = self.model_runner
        if not get_pp_group().is_first_rank and getattr(runner, "intermediate_tensors", False) is None:
            runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
        return out
    return compile_or_warm_up_model
