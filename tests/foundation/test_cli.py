"""The real `vllm serve` command line with the plugin installed (subprocesses)."""

import subprocess

import pytest

from cords_vllm.config import available_policies
from cords_vllm.lab.serving.process import server_env, vllm_executable

pytestmark = pytest.mark.server


def _vllm(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([vllm_executable(), *args], env=server_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_help_lists_kv_policy_with_its_choices():
    proc = _vllm("serve", "--help=all")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--kv-policy" in proc.stdout and "--kv-policy-config" in proc.stdout
    choices = "{" + ",".join(available_policies()) + "}"
    assert choices in proc.stdout.replace("\n", "").replace(" ", "")


def test_unknown_policy_exits_non_zero_naming_the_choices(tiny_model):
    proc = _vllm("serve", tiny_model, "--kv-policy", "bogus")
    assert proc.returncode != 0
    assert "bogus" in proc.stderr
    for name in available_policies():
        assert name in proc.stderr


def test_bad_config_key_exits_non_zero_naming_the_key(tiny_model):
    proc = _vllm("serve", tiny_model, "--kv-policy", "cords", "--kv-policy-config", '{"budgett": 512}')
    assert proc.returncode != 0
    assert "budgett" in proc.stderr
    assert "budget" in proc.stderr.replace("budgett", "")


def test_bad_additional_config_exits_non_zero_naming_the_key(tiny_model):
    proc = _vllm("serve", tiny_model, "--additional-config",
                 '{"kv_policy": "cords", "kv_policy_config": {"recent": -3}}')
    assert proc.returncode != 0
    assert "recent" in proc.stderr


def test_settings_the_model_cannot_serve_exit_non_zero_at_start_up(tiny_model):
    """A check against the model (tests/foundation/test_startup_checks.py has one per case) stops `vllm serve`."""
    proc = _vllm("serve", tiny_model, "--kv-policy", "cords", "--kv-policy-config", '{"anchors": [99]}',
                 "--max-model-len", "4096")
    assert proc.returncode != 0
    assert "'anchors'" in proc.stderr and "layers 0..3" in proc.stderr
