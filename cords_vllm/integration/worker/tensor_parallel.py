"""The tensor-parallel group's head gather for joint selection (the vLLM side of
:mod:`cords_vllm.compress.tensor_parallel`).

Each rank's KV cache holds its share of the KV heads; joint selection must see all of them to keep the same
tokens on every rank as one rank would. The compress step gets a gather built on vLLM's TP group collective
(``get_tp_group().all_gather``, gloo / shared memory on CPU, NCCL on CUDA) only when the TP world size is above 1.
"""

from __future__ import annotations

from typing import Any

from cords_vllm.compress.tensor_parallel import HeadGather, head_gatherer, local_head_gatherer, local_kv_heads


def tp_head_gatherer(runner: Any, local_heads: int) -> HeadGather | None:
    """The rank's head gather for joint selection, or ``None`` with one TP rank.

    ``local_heads``: the KV heads this rank's cache holds (checked against vLLM's layout rule, so a layout this
    module does not know fails at start-up instead of selecting on the wrong heads).
    """
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return None
    total = runner.model_config.get_total_num_kv_heads()
    expected = local_kv_heads(total, world)
    if local_heads != expected:
        raise RuntimeError(
            f"cords-vllm: this rank's KV cache holds {local_heads} KV heads, but {total} heads over {world} "
            f"tensor-parallel ranks should give {expected}; joint selection cannot gather the model's heads in order "
            "(use per_head: true, or --tensor-parallel-size 1)")
    return head_gatherer(get_tp_group().all_gather, world, total)


def tp_warmup_gatherer(runner: Any) -> HeadGather | None:
    """The start-up warm-up's stand-in for :func:`tp_head_gatherer` (same shapes, no collective:
    :func:`~cords_vllm.compress.tensor_parallel.local_head_gatherer`), or ``None`` with one TP rank."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    world = get_tensor_model_parallel_world_size()
    return None if world == 1 else local_head_gatherer(world, runner.model_config.get_total_num_kv_heads())
