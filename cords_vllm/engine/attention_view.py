"""The physical view of compressed rows that attention reads.

Rows stay logical (null block id 0 where blocks were evicted) so positions, M-RoPE and slot mapping need
no change. Attention kernels, however, read ``cdiv(seq_len, bs)`` entries of a row and treat every entry as
``bs`` context tokens. The view therefore moves each row's null entries (within its used part) to the end
and reduces ``seq_len`` by ``bs`` per null entry; everything else in the metadata is unchanged (new tokens
are still written through the logical slot mapping into real blocks after the holes).

The persistent block-table and ``seq_lens`` buffers are never written: the view is built on clones, so the
next step starts again from the logical rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

NULL_BLOCK_ID = 0


def compact_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Compact the first ``num_reqs`` rows; ``None`` if no used entry is null.

    Parameters
    ----------
    block_table:
        ``int [R, W]`` block ids (logical rows, ``0`` = evicted).
    seq_lens:
        ``int [R]`` logical sequence lengths (context + new tokens).

    Returns
    -------
    (block_table, seq_lens, num_null):
        Clones with, for each of the first ``num_reqs`` rows, the null entries among its first
        ``cdiv(seq_len, bs)`` moved to the end (order of the others kept) and ``seq_len`` reduced by
        ``bs * num_null``; ``num_null`` is ``long [num_reqs]``.
    """
    if num_reqs == 0:
        return None
    bt = block_table[:num_reqs]
    width = bt.shape[1]
    used = torch.arange(width, device=bt.device)[None, :] < (
        (seq_lens[:num_reqs].to(torch.long) + block_size - 1) // block_size)[:, None]
    is_null = (bt == NULL_BLOCK_ID) & used
    if not bool(is_null.any()):
        return None
    num_null = is_null.sum(dim=1)
    order = torch.argsort(is_null.to(torch.int8), dim=1, stable=True)
    new_table = block_table.clone()
    new_table[:num_reqs] = torch.gather(bt, 1, order)
    new_seq = seq_lens.clone()
    new_seq[:num_reqs] = seq_lens[:num_reqs] - (num_null * block_size).to(seq_lens.dtype)
    return new_table, new_seq, num_null


def physical_view(common: Any, block_size: int) -> Any:
    """``CommonAttentionMetadata`` with compressed rows compacted (the object itself if none is)."""
    compacted = compact_rows(common.block_table_tensor, common.seq_lens, common.num_reqs, block_size)
    if compacted is None:
        return common
    table, seq_lens, num_null = compacted
    n = common.num_reqs
    changes: dict[str, Any] = {
        "block_table_tensor": table,
        "seq_lens": seq_lens,
        "max_seq_len": int(seq_lens[:n].max()),
        # dataclasses.replace copies these private caches, which were computed from the logical lengths
        "_num_computed_tokens_cache": None,
        "_token_to_req_indices_cache": None,
    }
    upper = getattr(common, "seq_lens_cpu_upper_bound", None)
    if upper is not None:
        upper = upper.clone()
        upper[:n] -= (num_null.to(upper.device) * block_size).to(upper.dtype)
        changes["seq_lens_cpu_upper_bound"] = upper
    return dataclasses.replace(common, **changes)
