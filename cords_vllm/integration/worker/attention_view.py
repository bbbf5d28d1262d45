"""vLLM glue for the physical view: rewrite a ``CommonAttentionMetadata`` for the batch's compressed rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from cords_vllm.compress.attention_view import RowHoles, compact_rows
from cords_vllm.utils import cdiv


def physical_view(common: Any, holes: Sequence[RowHoles], block_size: int) -> Any:
    """``CommonAttentionMetadata`` with the rows of ``holes`` compacted (``common`` itself if there are none).

    Only host data is read: ``holes`` (from the worker's plans) and ``seq_lens_cpu_upper_bound``, a CPU
    tensor, which also bounds the entries the gather touches (its cost is independent of ``--max-model-len``).
    ``max_seq_len`` stays the logical maximum, an upper bound as vLLM documents it.
    """
    holes = [h for h in holes if h.row < common.num_reqs]
    if not holes:
        return common
    upper = getattr(common, "seq_lens_cpu_upper_bound", None)
    width = None  # without the host's upper bound, the whole row (its width follows --max-model-len)
    if upper is not None:
        width = cdiv(int(upper[[h.row for h in holes]].max()), block_size)  # a CPU tensor: no device read
    table, seq_lens = compact_rows(common.block_table_tensor, common.seq_lens, holes, block_size, width)
    changes: dict[str, Any] = {
        "block_table_tensor": table,
        "seq_lens": seq_lens,
        # dataclasses.replace copies these private caches, which were computed from the logical lengths
        "_num_computed_tokens_cache": None,
        "_token_to_req_indices_cache": None,
    }
    if upper is not None:
        upper = upper.clone()
        rows = torch.tensor([h.row for h in holes])
        upper[rows] -= torch.tensor([h.num_null * block_size for h in holes], dtype=upper.dtype)
        changes["seq_lens_cpu_upper_bound"] = upper
    return dataclasses.replace(common, **changes)
