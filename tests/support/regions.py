"""First and later compressions of several requests' regions, each in its own blocks of one cache: the shared input of
the tests of a step's compressions together, of the kernels' compile variants and of the warm-up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from cords_vllm.compress.kv_access import slots_of
from cords_vllm.compress.step import RegionBatch


def first_batches(requests: Sequence[tuple[int, int, int, str]], frame: int, block_size: int,
                  blocks: int) -> list[RegionBatch]:
    """One first compression per request ``(text tokens, frames, kept blocks, unit)``: ``text`` protected tokens,
    then ``frames`` labelled frames of ``frame`` tokens, the region cut to whole blocks, each request in its own
    blocks from block 1 (block 0 is null) of a cache of ``blocks``."""
    out, first = [], 1
    for text, frames, keep, unit in requests:
        region = (text + frames * frame) // block_size
        ids = torch.arange(first, first + region)
        first += region
        labels = torch.cat([torch.zeros(text, dtype=torch.long), torch.arange(frames).repeat_interleave(frame) + 1,
                            torch.full((block_size,), frames + 1)])[: region * block_size]
        out.append(RegionBatch(
            src_slots=slots_of(ids, block_size), dst_slots=slots_of(ids[:keep], block_size),
            new_ids=torch.arange(region * block_size), spans=torch.tensor([[text, text + frames * frame]]),
            new_labels=labels, num_keep=keep * block_size, num_keep_candidates=keep * block_size - text,
            num_candidates=region * block_size - text, group_size={"frame": frame, "block": block_size}.get(unit),
            frame_tokens=frame, granularity=unit))
    assert first <= blocks
    return out


def later_batch(batch: RegionBatch, text: int, block_size: int) -> RegionBatch:
    """The request's next compression after ``batch`` (whose ``text`` protected tokens lead the region): its kept
    blocks only, to one block fewer, with the same recent window."""
    kept = batch.dst_slots.view(-1, block_size)[:, 0] // block_size
    keep = kept.numel() - 1
    return replace(batch, src_slots=slots_of(kept, block_size), dst_slots=slots_of(kept[:keep], block_size),
                   new_ids=batch.new_ids[:0], new_labels=None if batch.new_labels is None else batch.new_labels[:0],
                   new_label_runs=None if batch.new_label_runs is None else 0,
                   num_keep=keep * block_size, num_keep_candidates=keep * block_size - text - batch.num_recent,
                   num_candidates=kept.numel() * block_size - text - batch.num_recent)


def on_device(batch: RegionBatch, device: torch.device | str) -> RegionBatch:
    """``batch`` with its tensors on ``device``."""
    return RegionBatch(**{f: v.to(device) if isinstance(v, torch.Tensor) else v for f, v in vars(batch).items()})
