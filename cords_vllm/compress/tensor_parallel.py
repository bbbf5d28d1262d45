"""Joint selection under tensor parallelism: every rank selects on the features of all KV heads (pure torch).

Under tensor parallelism of degree ``W`` each rank's KV cache holds only its share of a layer's KV heads, while
all ranks share the block ids (the scheduler's plan is one). Per-head selection needs nothing more: heads are
independent, so each rank's heads select for themselves as they would at ``W = 1``. Joint selection
(``per_head: false``) scores each token on the keys and values of *all* heads, so each rank gathers the anchor
layers' keys and values of the other ranks' heads before selecting: all ranks then run the same selection on
the same full-head features, keep the same tokens (the same count, the same ids) and move their own heads' KV
with the common indices.

How heads are laid out across ranks (vLLM's ``QKVParallelLinear``, which this module only assumes as a rule
of integers): with ``H >= W`` KV heads, ``W`` divides ``H`` and rank ``r`` holds heads
``[r * H / W, (r + 1) * H / W)``; with ``H < W``, ``H`` divides ``W`` and each head is replicated on
``R = W / H`` consecutive ranks (rank ``r`` holds head ``r // R``). Concatenating the ranks' heads in rank
order therefore gives the model's head order, each head ``R`` times in a row: keeping every ``R``-th head
gives exactly the ``W = 1`` features.

Communication per compression (one all-gather, all anchors, keys and values together): each rank contributes
``2 * A * T * H_local * D * s`` bytes and receives ``(W - 1)`` times that, where ``A`` is the number of anchor
layers, ``T`` the tokens the region holds (candidates and the protected tokens between them: the previously
kept ones plus those entering it), ``H_local = max(1, H / W)`` the KV heads per rank, ``D`` the head size and
``s`` the bytes per element of the decoded features (the cache dtype; 4 for an fp8 cache, decoded to
float32). See :func:`gathered_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: ``[..., H_local, T, D]`` -> ``[..., H, T, D]``: this rank's heads to the layer's heads, in the model's order.
HeadGather = Callable[[torch.Tensor], torch.Tensor]
#: A group all-gather: ``(x, dim)`` -> the ranks' ``x`` concatenated along ``dim`` in rank order.
AllGather = Callable[[torch.Tensor, int], torch.Tensor]


def kv_head_replicas(total_kv_heads: int, world_size: int) -> int:
    """Ranks that hold each KV head (``1`` unless there are fewer heads than ranks).

    Raises ``ValueError`` when the heads cannot be laid out across ranks (neither count divides the other).
    """
    if total_kv_heads < 1 or world_size < 1:
        raise ValueError(f"need at least one KV head and one rank, got {total_kv_heads} heads, {world_size} ranks")
    if total_kv_heads >= world_size:
        if total_kv_heads % world_size:
            raise ValueError(f"{total_kv_heads} KV heads cannot be split across {world_size} tensor-parallel ranks")
        return 1
    if world_size % total_kv_heads:
        raise ValueError(f"{total_kv_heads} KV heads cannot be replicated across {world_size} tensor-parallel ranks")
    return world_size // total_kv_heads


def local_kv_heads(total_kv_heads: int, world_size: int) -> int:
    """KV heads each rank holds: ``H / W``, or one (replicated) when ``H < W``."""
    kv_head_replicas(total_kv_heads, world_size)  # checks the layout
    return max(1, total_kv_heads // world_size)


def head_gatherer(all_gather: AllGather, world_size: int, total_kv_heads: int) -> HeadGather | None:
    """The :data:`HeadGather` of one rank of a tensor-parallel group, or ``None`` when ``world_size == 1``.

    ``all_gather`` is the group's collective (every rank must call the returned function at the same points, in
    the same order, with tensors of the same shape: the compress step does, since every rank carries out the
    same plans). A replicated head (``H < W``) is kept once.
    """
    if world_size == 1:
        return None
    replicas = kv_head_replicas(total_kv_heads, world_size)

    def gather_heads(x: torch.Tensor) -> torch.Tensor:
        """``[..., H_local, T, D]`` -> ``[..., H, T, D]`` (the ranks' heads in rank order, each head once)."""
        dim = x.dim() - 3
        gathered = all_gather(x.contiguous(), dim)
        if replicas > 1:
            gathered = gathered[(slice(None),) * dim + (slice(None, None, replicas),)]
        return gathered

    return gather_heads


def local_head_gatherer(world_size: int, total_kv_heads: int) -> HeadGather | None:
    """A stand-in for :func:`head_gatherer`'s gather with the same output (shape, dtype, layout) and no communication:
    this rank's heads in every rank's place. For compiling kernels (the start-up warm-up), whose launches depend only
    on shapes: a collective there would tie every rank's start-up to every other's, and a rank whose warm-up failed
    alone would leave the others waiting in it. ``None`` when ``world_size == 1``."""
    return head_gatherer(lambda x, dim: torch.cat([x] * world_size, dim), world_size, total_kv_heads)


def gathered_bytes(anchors: int, tokens: int, total_kv_heads: int, head_size: int, element_size: int,
                   world_size: int) -> tuple[int, int]:
    """``(sent, received)`` bytes of one rank for one compression's head gather on the PyTorch path (the fused kernel
    path gathers the units' float32 features instead, ``M <= tokens`` of them:
    :func:`~cords_vllm.compress.step_triton.gathered_rows`).

    ``sent = 2 * anchors * tokens * H_local * head_size * element_size`` (keys and values of this rank's heads of
    every anchor layer, over the region's ``tokens``), ``received = (world_size - 1) * sent``; both 0 at
    ``world_size == 1``. ``H_local`` is :func:`local_kv_heads`.
    """
    if world_size == 1:
        return 0, 0
    sent = 2 * anchors * tokens * local_kv_heads(total_kv_heads, world_size) * head_size * element_size
    return sent, (world_size - 1) * sent
