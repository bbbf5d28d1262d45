"""The real `vllm serve` command line with the plugin installed (subprocesses).

Every invocation is started at once by one module fixture and each test reads its own result: each is a fresh
interpreter importing vLLM (about 10 s on 2 cores), so run one after another they cost a minute of the suite.
"""

from __future__ import annotations

import subprocess

import pytest

from cords_vllm.config import available_policies
from cords_vllm.lab.serving.process import server_env, vllm_executable

pytestmark = pytest.mark.server

#: name -> ``vllm`` arguments (``MODEL`` stands for the tiny model's directory).
INVOCATIONS: dict[str, tuple[str, ...]] = {
    "help": ("serve", "--help=all"),
    "unknown policy": ("serve", "MODEL", "--kv-policy", "bogus"),
    "bad key": ("serve", "MODEL", "--kv-policy", "cords", "--kv-policy-config", '{"budgett": 512}'),
    "bad additional config": ("serve", "MODEL", "--additional-config",
                              '{"kv_policy": "cords", "kv_policy_config": {"recent": -3}}'),
    "anchor the model lacks": ("serve", "MODEL", "--kv-policy", "cords", "--kv-policy-config", '{"anchors": [99]}',
                               "--max-model-len", "4096"),
    "layer scope vLLM would split": ("serve", "MODEL", "--kv-policy", "cords", "--kv-policy-config",
                                     '{"compressed_layers": 3}', "--max-model-len", "4096"),
}


@pytest.fixture(scope="module")
def runs(tiny_model) -> dict[str, subprocess.CompletedProcess]:
    procs = {name: subprocess.Popen([vllm_executable(), *(tiny_model if a == "MODEL" else a for a in args)],
                                    env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in INVOCATIONS.items()}
    out = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=400)
            out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


def test_help_lists_kv_policy_with_its_choices(runs):
    proc = runs["help"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--kv-policy" in proc.stdout and "--kv-policy-config" in proc.stdout
    choices = "{" + ",".join(available_policies()) + "}"
    assert choices in proc.stdout.replace("\n", "").replace(" ", "")
    assert "compressed_layers" in proc.stdout  # the configuration reference lists every engine key


def test_unknown_policy_exits_non_zero_naming_the_choices(runs):
    proc = runs["unknown policy"]
    assert proc.returncode != 0
    assert "bogus" in proc.stderr
    for name in available_policies():
        assert name in proc.stderr


def test_bad_config_key_exits_non_zero_naming_the_key(runs):
    proc = runs["bad key"]
    assert proc.returncode != 0
    assert "budgett" in proc.stderr
    assert "budget" in proc.stderr.replace("budgett", "")


def test_bad_additional_config_exits_non_zero_naming_the_key(runs):
    proc = runs["bad additional config"]
    assert proc.returncode != 0
    assert "recent" in proc.stderr


def test_settings_the_model_cannot_serve_exit_non_zero_at_start_up(runs):
    """A check against the model (tests/startup/test_startup_checks.py has one per case) stops `vllm serve`."""
    proc = runs["anchor the model lacks"]
    assert proc.returncode != 0
    assert "'anchors'" in proc.stderr and "layers 0..3" in proc.stderr
    proc = runs["layer scope vLLM would split"]
    assert proc.returncode != 0
    assert "'compressed_layers'" in proc.stderr and "at most 2 of the 4 layers" in proc.stderr
