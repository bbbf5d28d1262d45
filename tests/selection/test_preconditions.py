"""Preconditions of the helpers behind ``select`` raise explicit errors, and ``base`` keeps its public names."""

from __future__ import annotations

import pytest
import torch
from kv_cases import random_kv

import cords_vllm.selection.base as base
from cords_vllm.selection import batch, get_selector, params, result
from cords_vllm.selection.batch import UnitBatch, build_units
from cords_vllm.selection.cords import cords_greedy
from cords_vllm.selection.exact import select_exact
from cords_vllm.selection.infinipot_v import InfiniPotVSelector
from cords_vllm.selection.result import kept_candidate_count


def test_base_reexports_the_names_other_modules_import() -> None:
    # config, compress and lab import these from cords_vllm.selection.base
    for name in ("GRANULARITIES", "compute_dtype", "Selector", "SelectionResult"):
        assert name in base.__all__
    for name in base.__all__:
        assert hasattr(base, name), name
    assert base.GRANULARITIES is batch.GRANULARITIES and base.compute_dtype is batch.compute_dtype
    assert base.UnitBatch is batch.UnitBatch
    assert base.SelectionResult is result.SelectionResult
    assert base.kept_candidate_count is result.kept_candidate_count
    assert base.ParamSpec is params.ParamSpec and base.hyperparameter is params.hyperparameter


def test_kept_candidate_count_needs_the_group_size_of_groups() -> None:
    assert kept_candidate_count(10, 4, "token", None) == 4
    assert kept_candidate_count(10, 12, "block", None) == 10  # the budget covers everything
    with pytest.raises(ValueError, match=r"group_size: required \(tokens per block\)"):
        kept_candidate_count(10, 4, "block", None)


def test_build_units_needs_the_group_size_of_groups() -> None:
    keys, values = random_kv(0, 1, 1, 8, 2)
    with pytest.raises(ValueError, match=r"group_size: required \(tokens per frame\)"):
        build_units(keys, values, 4, candidates=None, granularity="frame", group_size=None, group_index=None,
                    per_head=False, generator=None)


def test_select_exact_labelled_frames_need_a_group_size() -> None:
    keys, values = random_kv(0, 1, 1, 8, 2)
    cand = torch.ones(1, 8, dtype=torch.bool)
    labels = torch.arange(8).div(2, rounding_mode="floor")[None, :]
    with pytest.raises(ValueError, match="group_size: required"):
        select_exact(get_selector("cords"), keys, values, 3, candidates=cand, granularity="frame",
                     group_index=labels)


def test_cords_greedy_refuses_an_unknown_novelty() -> None:
    feats = torch.randn(1, 5, 4)
    valid = torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="novelty: must be one of max_cosine, exact"):
        cords_greedy(feats, 2, valid, torch.tensor([2]), 2, alpha=0.5, eta=0.5, lam=0.5, eps0=1e-6,
                     novelty="cosine")


def test_infinipot_v_refuses_a_batch_without_frame_period() -> None:
    p, m = 1, 4
    units = UnitBatch(feats=torch.randn(p, m, 4), key_dim=2, valid=torch.ones(p, m, dtype=torch.bool),
                      rank=torch.arange(m)[None, :], count=torch.tensor([m]), k=torch.tensor([2]), k_max=2,
                      period=None, granularity="token", group_size=None)
    with pytest.raises(ValueError, match="period"):
        InfiniPotVSelector()._order_units(units)
