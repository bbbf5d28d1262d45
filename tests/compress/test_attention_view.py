"""The physical view of compressed rows: right against a list model, host-data only, and absent when unneeded."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cords_vllm.compress.attention_view import RowHoles, compact_rows
from cords_vllm.integration.worker.attention_view import physical_view
from cords_vllm.utils import cdiv
from tests.support.device_audit import DeviceAudit

BS, WIDTH = 4, 12


def _rows():
    table = torch.arange(1, 5 * WIDTH + 1, dtype=torch.int32).view(5, WIDTH)
    holes = [RowHoles(row=1, kept=2, region=5), RowHoles(row=3, kept=0, region=4)]
    for h in holes:
        table[h.row, h.kept: h.region] = 0  # evicted entries are the null block
    seq_lens = torch.tensor([20, 40, 9, 33, 47], dtype=torch.int32)
    return table, seq_lens, holes


def test_holes_move_behind_the_used_entries_and_seq_lens_shrink():
    table, seq_lens, holes = _rows()
    new_table, new_lens = compact_rows(table, seq_lens, holes, BS)
    for r in range(5):
        row = table[r].tolist()
        hole = next((h for h in holes if h.row == r), None)
        if hole is None:
            assert new_table[r].tolist() == row and int(new_lens[r]) == int(seq_lens[r])
            continue
        expected = row[: hole.kept] + row[hole.region:] + row[hole.kept: hole.region]
        assert new_table[r].tolist() == expected
        assert int(new_lens[r]) == int(seq_lens[r]) - BS * hole.num_null
        used = cdiv(int(new_lens[r]), BS)
        assert 0 not in new_table[r, :used].tolist()  # kernels read only real blocks
    assert torch.equal(table, _rows()[0]) and torch.equal(seq_lens, _rows()[1])  # persistent buffers untouched


def test_the_view_reads_no_device_tensor():
    table, seq_lens, holes = _rows()
    with DeviceAudit() as audit:
        compact_rows(table, seq_lens, holes, BS)
    assert audit.syncs == [] and audit.undeviced == []
    # and with the buffers on `meta`, where any host read would raise
    new_table, new_lens = compact_rows(table.to("meta"), seq_lens.to("meta"), holes, BS)
    assert new_table.device.type == "meta" and new_lens.shape == (5,)


@dataclasses.dataclass
class _Common:  # the fields of vLLM's CommonAttentionMetadata that the view reads or writes
    block_table_tensor: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    max_seq_len: int
    seq_lens_cpu_upper_bound: torch.Tensor | None
    _num_computed_tokens_cache: torch.Tensor | None = None
    _token_to_req_indices_cache: torch.Tensor | None = None


def test_metadata_is_untouched_without_compressed_rows_in_the_batch():
    table, seq_lens, holes = _rows()
    common = _Common(table, seq_lens, num_reqs=3, max_seq_len=47, seq_lens_cpu_upper_bound=seq_lens.clone())
    assert physical_view(common, [], BS) is common
    assert physical_view(common, [RowHoles(row=3, kept=0, region=4)], BS) is common  # row 3 is not in the batch
    view = physical_view(common, holes, BS)
    assert view is not common and int(view.seq_lens[1]) == 40 - 3 * BS
    assert int(view.seq_lens_cpu_upper_bound[1]) == 40 - 3 * BS and int(common.seq_lens_cpu_upper_bound[1]) == 40


@pytest.mark.parametrize("num_reqs", [0, 5])
def test_physical_view_keeps_every_other_field(num_reqs):
    table, seq_lens, holes = _rows()
    common = _Common(table, seq_lens, num_reqs=num_reqs, max_seq_len=47, seq_lens_cpu_upper_bound=None)
    view = physical_view(common, holes, BS)
    assert view.max_seq_len == 47 and view.num_reqs == num_reqs  # max_seq_len stays a valid upper bound


def test_the_gather_covers_the_compressed_rows_not_the_whole_width():
    """vLLM sizes the block table by --max-model-len: the view touches only the compressed rows' used entries."""
    table, seq_lens, holes = _rows()
    wide = torch.cat([table, torch.arange(1, 5 * 1000 + 1, dtype=torch.int32).view(5, 1000)], 1)  # a long W
    used = max(cdiv(int(seq_lens[h.row]), BS) for h in holes)
    narrow_table, narrow_lens = compact_rows(wide, seq_lens, holes, BS, width=used)
    full_table, full_lens = compact_rows(wide, seq_lens, holes, BS)
    assert torch.equal(narrow_lens, full_lens)
    for h in holes:  # the entries a kernel reads are the same
        n = cdiv(int(narrow_lens[h.row]), BS)
        assert narrow_table[h.row, :n].tolist() == full_table[h.row, :n].tolist()
        assert 0 not in narrow_table[h.row, :n].tolist()
    assert torch.equal(narrow_table[:, used:], wide[:, used:])  # nothing past the used entries was touched
    calls = []
    original = torch.gather
    try:
        torch.gather = lambda t, dim, index: calls.append(tuple(index.shape)) or original(t, dim, index)
        common = _Common(wide, seq_lens, num_reqs=5, max_seq_len=47, seq_lens_cpu_upper_bound=seq_lens.clone())
        physical_view(common, holes, BS)
    finally:
        torch.gather = original
    assert calls == [(len(holes), used)]  # from the host's upper bound, not the table's width
