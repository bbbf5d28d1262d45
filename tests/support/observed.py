"""Observation queries for the compress-step tests of attention-scored policies (SnapKV, StreamMem)."""

from __future__ import annotations

from dataclasses import replace

import torch

from cords_vllm.compress.region import ObservedQueries, RegionBatch, SelectionSetup

#: Query rows and query heads per KV head of the test observations.
ROWS, GROUP = 4, 2


def observed_queries(setup: SelectionSetup, batch: RegionBatch, heads: int, dim: int, seed: int = 0
                     ) -> ObservedQueries:
    """Random queries for ``setup``'s anchors, ``[A, heads * GROUP, ROWS, dim]``, made on the host and moved to the
    batch's device; a window policy's rows are the newest entering tokens (causal), a proxy's the first (rotated,
    where the policy reads them after the newest token, by the engine: here as captured)."""
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(len(setup.anchors), heads * GROUP, ROWS, dim, generator=g)
    causal = setup.selector.observation_source == "newest_candidates"
    ids = batch.new_ids[-ROWS:] if causal else batch.new_ids[:ROWS]
    return ObservedQueries(queries.to(batch.new_ids.device), ids, causal)


def with_observation(setup: SelectionSetup, batch: RegionBatch, heads: int, dim: int) -> RegionBatch:
    """``batch`` with observation queries when ``setup``'s policy reads them, else as is."""
    if not setup.selector.needs_observation:
        return batch
    return replace(batch, observed=observed_queries(setup, batch, heads, dim))
