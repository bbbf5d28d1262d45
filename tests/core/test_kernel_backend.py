"""Which implementation runs the compress step (:mod:`cords_vllm.kernel_backend`): the rule, its overrides and its
refusals. A CUDA device is simulated by its compute capability (the choice reads nothing else of it)."""

from __future__ import annotations

import pytest
import torch

import cords_vllm.kernel_backend as kb

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _no_environment_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kb.ENV, raising=False)


def test_auto_runs_the_kernels_on_a_recent_gpu_only(monkeypatch):
    for capability, expected in (((9, 0), True), ((8, 0), True), ((7, 5), False)):
        monkeypatch.setattr(kb, "_capability", lambda index, c=capability: c)
        assert kb.use_triton(CUDA) is expected
    assert "compute capability below 8.0" in kb.describe(CUDA)
    assert not kb.use_triton(torch.device("cpu")) and not kb.use_triton(torch.device("meta"))
    assert kb.describe(torch.device("cpu")).startswith("PyTorch reference (no kernels for cpu")


def test_the_configuration_wins_over_the_environment_which_wins_over_auto(monkeypatch):
    monkeypatch.setattr(kb, "_capability", lambda index: (9, 0))
    monkeypatch.setenv(kb.ENV, "torch")
    assert not kb.use_triton(CUDA) and "from CORDS_VLLM_KERNELS" in kb.describe(CUDA)
    with kb.kernels_in_force("auto"):
        assert kb.use_triton(CUDA) and "from kv_policy_config 'kernels'" in kb.describe(CUDA)
    with kb.kernels_in_force(None):  # no configuration: the environment's choice stands
        assert not kb.use_triton(CUDA)


def test_forcing_the_kernels_where_they_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with kb.kernels_in_force("triton"), pytest.raises(RuntimeError, match="need CUDA"):
        kb.use_triton(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with kb.kernels_in_force("triton"):
        assert kb.use_triton(torch.device("cpu"))  # how the tests run them
    monkeypatch.setattr(kb, "triton_available", lambda: False)
    with kb.kernels_in_force("triton"), pytest.raises(RuntimeError, match="Triton is not installed"):
        kb.use_triton(CUDA)


def test_unknown_choices_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="kernels must be one of"), kb.kernels_in_force("cuda"):
        pass
    monkeypatch.setenv(kb.ENV, "fast")
    with pytest.raises(ValueError, match="CORDS_VLLM_KERNELS must be one of"):
        kb.requested()
