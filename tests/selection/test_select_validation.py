"""Bad inputs to ``select`` raise a ValueError that names the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_cases import random_kv

from cords_vllm.selection import get_selector

KEYS, VALUES = random_kv(0, 2, 2, 12, 4, torch.float32)
SEL = get_selector("cords")


def call(**overrides):
    args = dict(keys=KEYS, values=VALUES, budget=4)
    args.update(overrides)
    return SEL.select(args.pop("keys"), args.pop("values"), args.pop("budget"), **args)


@pytest.mark.parametrize(("overrides", "pattern"), [
    (dict(keys=KEYS[0]), r"keys: expected a 4-D tensor \[B, H, N, D\]"),
    (dict(values=VALUES[..., :3]), r"values: shape \(2, 2, 12, 3\) does not match keys"),
    (dict(keys=KEYS.numpy()), r"keys: expected a torch.Tensor"),
    (dict(keys=KEYS.to(torch.int32), values=VALUES.to(torch.int32)), r"keys: expected a floating-point"),
    (dict(values=VALUES.double()), r"values: dtype torch.float64 does not match keys dtype torch.float32"),
    (dict(keys=torch.zeros(0, 2, 12, 4), values=torch.zeros(0, 2, 12, 4)), r"keys: B, H and D must be >= 1"),
    (dict(budget=-1), r"budget: must be >= 0, got -1"),
    (dict(budget=2.5), r"budget: expected a non-negative int"),
    (dict(budget=True), r"budget: expected a non-negative int"),
    (dict(budget="4"), r"budget: expected a non-negative int"),
    (dict(candidates=torch.ones(2, 12)), r"candidates: expected dtype torch.bool"),
    (dict(candidates=torch.ones(2, 11, dtype=torch.bool)), r"candidates: expected shape \[B, N\]"),
    (dict(candidates=[True] * 12), r"candidates: expected a bool torch.Tensor"),
    (dict(granularity="frames"), r"granularity: must be one of token, frame, block, got 'frames'"),
    (dict(granularity="frame"), r"group_size: required \(tokens per frame\)"),
    (dict(granularity="block", group_size=0), r"group_size: expected a positive int"),
    (dict(group_size=2.0), r"group_size: expected a positive int"),
    (dict(per_head=1), r"per_head: expected a bool"),
    (dict(generator=0), r"generator: expected a torch.Generator"),
])
def test_bad_arguments(overrides: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        call(**overrides)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", ["keys", "values"])
def test_non_finite_features(bad: float, which: str) -> None:
    t = (KEYS if which == "keys" else VALUES).clone()
    t[1, 0, 5, 2] = bad
    with pytest.raises(ValueError, match=f"{which}: contains NaN or inf"):
        call(**{which: t})


def test_mismatched_devices() -> None:
    meta_values = torch.empty(VALUES.shape, device="meta")
    with pytest.raises(ValueError, match="values: device meta does not match keys device cpu"):
        call(values=meta_values)
    with pytest.raises(ValueError, match="candidates: device meta does not match keys device cpu"):
        call(candidates=torch.empty(2, 12, dtype=torch.bool, device="meta"))


def test_numpy_integer_budget_is_accepted() -> None:
    assert torch.equal(call(budget=np.int64(4)).keep, call(budget=4).keep)


def test_empty_token_axis() -> None:
    res = SEL.select(KEYS[:, :, :0], VALUES[:, :, :0], 3)
    assert res.keep.shape == (2, 0) and res.kept_indices().shape == (2, 0)
