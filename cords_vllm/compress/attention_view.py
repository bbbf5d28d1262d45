"""The physical view of compressed rows that attention reads, built from host-side knowledge only.

Rows stay logical: a compressed request's row is ``[k kept blocks][j - k null blocks][the rest]``, so
positions, M-RoPE and slot mapping need no change. Attention kernels, however, read ``cdiv(seq_len, bs)``
entries of a row and treat each as ``bs`` context tokens. The view moves the ``j - k`` null entries of each
compressed row behind its used part and reduces its ``seq_len`` by ``(j - k) * bs``; everything else is
unchanged (new tokens are still written through the logical slot mapping into real blocks after the holes).

The host knows every compressed row's ``(k, j)`` from the plans it carried out, so the view is one gather
per compressed row with host-built indices: no device tensor is read back, and a step without a compressed
request in the batch is not touched at all. The persistent block-table and ``seq_lens`` buffers are never
written: the view is built on clones, so the next step starts again from the logical rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cords_vllm.compress.transfer import upload


@dataclass(frozen=True)
class RowHoles:
    """A compressed row of the batch: index ``row``; ``kept`` held blocks, then nulls up to ``region``."""

    row: int
    kept: int
    region: int

    @property
    def num_null(self) -> int:
        return self.region - self.kept


def gather_index(holes: Sequence[RowHoles], width: int) -> np.ndarray:
    """``int64 [n, width]``: for each compressed row, entry order ``[0, k) ++ [j, width) ++ [k, j)``."""
    index = np.empty((len(holes), width), dtype=np.int64)
    for i, h in enumerate(holes):
        index[i] = np.concatenate([np.arange(h.kept), np.arange(h.region, width), np.arange(h.kept, h.region)])
    return index


def compact_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, holes: Sequence[RowHoles], block_size: int,
                 width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clones of ``block_table`` (``int [R, W]``) and ``seq_lens`` (``int [R]``) with the holes compacted.

    Each row of ``holes`` gets its null entries moved behind its first ``width`` entries' used part (order of
    the others kept) and its ``seq_len`` reduced by ``block_size * num_null``; other rows are copied unchanged.
    ``width`` (default ``W``) must cover every compressed row's logical entries, ``cdiv(seq_len, block_size)``:
    entries past it are never read, so the gather's cost follows the compressed rows' lengths, not ``W``
    (which vLLM sizes by ``--max-model-len``).
    """
    full = block_table.shape[1]
    width = full if width is None else min(full, max(width, max(h.region for h in holes)))
    rows, index, delta = upload([np.array([h.row for h in holes]), gather_index(holes, width),
                                 np.array([h.num_null * block_size for h in holes])], block_table.device)
    table = block_table.clone()
    table[rows, :width] = torch.gather(block_table[rows, :width], 1, index.to(torch.long))
    lens = seq_lens.clone()
    lens[rows] = seq_lens[rows] - delta.to(seq_lens.dtype)
    return table, lens
