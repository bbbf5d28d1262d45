"""``scripts/gpu-check.sh --cpu``: the GPU user's one check, end to end on vLLM's CPU build, and its parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cords_vllm.lab import gpu_check
from cords_vllm.lab.gpu_check import FAIL, PASS, SKIP, Fail, Row, Skip, first_error, format_table, timed

REPO = Path(__file__).resolve().parents[2]

#: Rows skipped on CPU by design; every other row must pass.
CPU_SKIPS = {"install .[cuda,dev,ray]", "CUDA-gated tests (pytest)", "compress-step benchmark (kernels vs PyTorch)",
             "a step's compressions together (token granularity)",
             "plain vLLM bf16: live stream",
             *(f"cords bf16 + Ray: {part}" for part in ("serve", "video chats", "live stream",
                                                         "/metrics compressions", "KV blocks returned"))}
#: Rows the check must have (a step silently dropped would pass otherwise).
REQUIRED = [
    "tiny model (bf16)",
    *(f"{server}: {part}" for server in ("cords bf16", "none bf16", "plain vLLM bf16", "cords bf16 + fp8 KV",
                                         "cords bf16 + Ray")
      for part in ("serve", "video chats", "live stream", "/metrics compressions", "KV blocks returned")),
    "answers: none bf16 = plain vLLM bf16 (the plugin loaded, no policy)",
    "answers: cords bf16 = none bf16 (videos under the budget)",
    "HF exactness (fp32, compressed engine = HF reference)",
    "HF exactness, layers 0..1 compressed, the others whole",
    "CUDA-gated tests (pytest)",
    "compress-step benchmark (kernels vs PyTorch)",
    "a step's compressions together (token granularity)",
]


def check_command(out: Path) -> tuple[list[str], dict[str, str]]:
    """The script when this Python is a venv the project set up (what ``make test`` runs), else the module."""
    if (Path(sys.prefix) / ".cords-vllm-installed").is_file():
        return ["bash", str(REPO / "scripts" / "gpu-check.sh"), "--cpu", "--out", str(out)], {"VENV": sys.prefix}
    return [sys.executable, "-m", "cords_vllm.lab.gpu_check", "--cpu", "--out", str(out)], {}


#: Runs with ``-m slow`` (about 60 s: every step of the GPU check, served on CPU; keeps the default suite under
#: 20 minutes on 2 cores). What its steps serve is tested in the default suite by the server tests, and its
#: failure handling by the tests below.
@pytest.mark.slow
@pytest.mark.server
def test_cpu_mode_passes_every_step_and_prints_one_table(tmp_path):
    command, env = check_command(tmp_path)
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=900, check=False)
    summary_file = tmp_path / "summary.json"
    assert summary_file.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_file.read_text())
    rows = {r["step"]: r for r in summary["rows"]}
    assert [step for step in REQUIRED if step not in rows] == []
    wrong = {step: f"{r['result']}: {r['detail']}" for step, r in rows.items()
             if r["result"] != (SKIP if step in CPU_SKIPS else PASS)}
    assert wrong == {}
    assert proc.returncode == 0 and summary["failed"] == 0
    assert proc.stdout.count("\nstep ") == 1 and "0 failed" in proc.stdout  # one table (its header line), on stdout
    assert "cudagraph NONE, kv fp8" in rows["cords bf16 + fp8 KV: serve"]["detail"]
    assert sorted(p.name for p in tmp_path.glob("serve-*.log")) == [
        "serve-cords-bf16-fp8-kv.log", "serve-cords-bf16.log", "serve-none-bf16.log", "serve-plain-vllm-bf16.log"]


def test_a_step_that_raises_fails_alone_and_the_table_says_why():
    def broken() -> str:
        raise ValueError("boom")

    def missing() -> str:
        raise Skip("not here")

    def wrong() -> str:
        raise Fail("tokens differ")

    rows = [timed("a", lambda: "fine"), timed("b", broken), timed("c", missing), timed("d", wrong)]
    assert [(r.result, r.detail) for r in rows] == [(PASS, "fine"), (FAIL, "ValueError: boom"), (SKIP, "not here"),
                                                    (FAIL, "tokens differ")]
    table = format_table([*rows, Row("e", PASS, 1.25, "x" * 500)], width=100).splitlines()
    assert table[0].split() == ["step", "result", "seconds", "detail"]
    assert len(table) == 7 and all(len(line) <= 100 for line in table)
    assert table[-1].endswith("...") and "1.2" in table[-1]


def test_a_dead_server_is_named_by_the_first_error_of_its_log():
    log = ("WARNING Found ulimit of 20000 and failed to automatically increase with error current limit\n"
           "(Worker pid=1) ERROR [multiproc_executor.py:1063] NotImplementedError: \"op\" not implemented for 'Byte'\n"
           "(EngineCore pid=2) ERROR [core.py:1512] RuntimeError: Worker failed\n")
    assert first_error(log) == "NotImplementedError: \"op\" not implemented for 'Byte'"
    assert first_error("just a line\nthe last line\n") == "the last line"


def test_the_cuda_gated_tests_include_every_file_skipped_without_cuda():
    gated = gpu_check.cuda_gated_tests()
    assert {"tests/compress", "tests/engine/test_cuda.py", "tests/selection/test_selector_contract.py"} <= set(gated)
    assert "tests/core/test_config.py" not in gated


def _answer(tokens, logprobs, runner_up=None):
    """An answer whose token ``t`` reads ``"t"``; ``runner_up``: ``{position: (token, logprob)}``."""
    texts = [str(t) for t in tokens]
    top = [{texts[k]: logprobs[k]} for k in range(len(tokens))]
    for k, (token, lp) in (runner_up or {}).items():
        top[k][str(token)] = lp
    return gpu_check.Answer(list(tokens), list(logprobs), top, texts)


def test_answers_agree_on_every_token_or_up_to_a_near_tie():
    same = _answer([1, 2, 3], [-0.1, -0.2, -0.3])
    assert gpu_check.agreement(same, _answer([1, 2, 3], [-0.1, -0.21, -0.3])) == (pytest.approx(0.01), None)
    # a near-tie: each server's choice is the other's runner-up, equally likely within bf16 noise
    a = _answer([1, 2, 5, 5], [-0.1, -0.69, -0.69, -0.2], {2: (7, -0.71)})
    b = _answer([1, 2, 7, 7], [-0.1, -0.69, -0.70, -0.1], {2: (5, -0.70)})
    assert gpu_check.agreement(a, b)[1] == 2
    # a real difference: the other server's choice is far less likely here
    c = _answer([1, 2, 7, 7], [-0.1, -0.69, -0.1, -0.1], {2: (5, -2.5)})
    with pytest.raises(Fail, match="not as a near-tie"):
        gpu_check.agreement(a, c)
    with pytest.raises(Fail, match="position 1"):
        gpu_check.agreement(same, _answer([1, 2, 3], [-0.1, -0.5, -0.3]))


def test_each_attention_backend_compares_none_with_plain_vllm_and_cords_with_none():
    specs = gpu_check.server_specs(cpu=False, eager=True)
    runs = [gpu_check.ServerRun(s, short_answers=[_answer([1, 2], [-0.1, -0.2])]) for s in specs]
    rows = gpu_check.comparison_rows(runs)
    assert [r.step for r in rows] == [
        f"answers: {a} bf16 {b} = {c} bf16 {b} ({why})" for b in gpu_check.CUDA_BACKENDS
        for a, c, why in (("none", "plain vLLM", "the plugin loaded, no policy"), ("cords", "none",
                                                                                  "videos under the budget"))]
    assert all(r.result == PASS for r in rows)
    plain = [s for s in specs if s.policy is None]
    assert len(plain) == 2 and all(s.env == {"VLLM_PLUGINS": ""} and "--kv-policy" not in s.args() for s in plain)
    assert {s.backend for s in specs} == set(gpu_check.CUDA_BACKENDS)
    assert any("--enforce-eager" not in s.args() for s in specs if s.policy == "cords")  # CUDA graphs too
