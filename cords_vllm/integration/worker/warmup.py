"""The worker's start-up work for the compress step's kernels: a step's Gram memory bounded by what vLLM left
free on the device, and every kernel variant this server's compressions launch compiled before the first request
(:mod:`cords_vllm.compress.kernel_warmup`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from cords_vllm.compress.gram_budget import limit_from_free_memory, set_step_gram_limit
from cords_vllm.integration.worker.tensor_parallel import tp_warmup_gatherer
from cords_vllm.kernel_backend import interpreting, kernels_in_force, use_triton

logger = logging.getLogger(__name__)


def warm_up_kernels(comp: Any, runner: Any) -> None:
    """At start-up, before the engine serves (``comp``: the worker's
    :class:`~cords_vllm.integration.worker.comp.WorkerCompressor`, its caches allocated): where Triton
    kernels run the compress step, bound a step's Gram matrices by the memory vLLM left free, then compile the
    kernels for every width this server's compressions can take (:mod:`cords_vllm.compress.kernel_warmup`),
    unless the configuration's ``warmup`` is false; the report goes to ``comp.warmup``. Every rank runs it on
    its own: under tensor parallelism its small compressions gather heads with a stand-in of the same shapes
    (:func:`tp_warmup_gatherer`), not the group's collective, so a rank whose warm-up fails alone serves and leaves
    no other waiting."""
    with kernels_in_force(comp.setup.kernels):
        if not use_triton(comp.device):
            return
    if comp.device.type == "cuda":  # the KV cache is allocated: what vLLM leaves free bounds a step's Gram matrices
        free, _ = torch.cuda.mem_get_info(comp.device)
        limit = set_step_gram_limit(limit_from_free_memory(free))
        logger.info("cords-vllm: a step's shared greedy run holds at most %.2f GiB of Gram matrices (half of "
                    "the %.2f GiB left free)", limit / (1 << 30), free / (1 << 30))
    if not comp.config.warmup:
        logger.info("cords-vllm: kernel warm-up off (kv_policy_config 'warmup'): each width compiles at its "
                    "first compression")
        return
    from cords_vllm.compress.kernel_warmup import TEMPLATE_BLOCKS, WarmupWidths, warm_up, warm_up_copy  # Triton's

    if runner.kv_cache_config.num_blocks <= TEMPLATE_BLOCKS:
        logger.warning("cords-vllm: kernel warm-up skipped: a pool of %d KV blocks leaves no %d free for its "
                       "compressions; each width compiles at its first compression",
                       runner.kv_cache_config.num_blocks, TEMPLATE_BLOCKS)
        return
    observed = comp.setup.selector.needs_observation  # no start-up compression has their queries: the copy alone
    widths = None
    if not observed:
        max_len = runner.vllm_config.model_config.max_model_len
        max_rows = min(max_len, comp.config.stream_footprint_blocks(max_len, comp.block_size) * comp.block_size)
        widths = WarmupWidths.for_server(
            budget=comp.config.budget, slack=comp.config.slack, block_size=comp.block_size,
            max_rows=max_rows, granularity=comp.config.granularity, frames_known=comp.facts.finds_frames)
    try:
        if widths is None:
            comp.warmup = warm_up_copy(comp.caches, comp.accessors)
        else:
            setup = comp.setup  # under tensor parallelism, a gather of the same shapes without the collective
            if setup.gather_heads is not None:
                setup = dataclasses.replace(setup, gather_heads=tp_warmup_gatherer(runner))
            comp.warmup = warm_up(comp.caches, comp.accessors, comp.codecs, setup, widths)
    except Exception as exc:  # an optimisation: say why it did not run, and serve (compiles at first use)
        logger.warning("cords-vllm: kernel warm-up failed (%s: %s); each width compiles at its first "
                       "compression", type(exc).__name__, exc, exc_info=exc)
        return
    logger.info("cords-vllm: kernel warm-up: %s%s%s", comp.warmup.describe(),
                f" (--kv-policy {comp.config.policy} scores observed queries: the copy alone; its selection runs "
                "on the PyTorch path)" if observed else "",
                " (interpreted: nothing to compile)" if interpreting() and comp.warmup.variants else "")
