"""One check a GPU user runs: install, serve, stream, compare, count, and the CUDA tests, in one table.

``bash scripts/gpu-check.sh`` (which runs ``python -m cords_vllm.lab.gpu_check``) on a CUDA machine:

1. **install** ``.[cuda,dev,ray]`` into its own virtualenv (``--venv``, default ``.venv-cuda``; ``--skip-install``
   uses it, or the running Python, as it is; ``--no-install`` installs nothing and uses what the running Python
   imports, for a GPU host with no network), then continues under that environment's Python;
2. **CUDA device**: the one vLLM will use;
3. **tiny model**: the tests' tiny Qwen2-VL (:func:`~cords_vllm.lab.synthetic.build_tiny_qwen2vl`), bf16;
4. per attention backend the plugin supports on CUDA (:data:`CUDA_BACKENDS`: FLASH_ATTN, TRITON_ATTN):
   ``vllm serve <tiny>`` as plain vLLM with no plugin loaded (the control, :data:`PLAIN_ENV`), with
   ``--kv-policy none`` (vLLM's own runner, Model Runner V2 on CUDA) and with ``--kv-policy cords``; on the first
   backend also ``cords`` with ``--kv-cache-dtype fp8`` and on Ray (the plugin must load in Ray workers through
   its entry point: the worker-side compressions prove it), and with ``--eager`` one ``cords`` server at vLLM's
   default CUDA graphs. Each gets the same concurrent OpenAI chat completions with synthetic videos (some
   shorter than the budget, some longer, so compressed) and one live stream through ``/v1/streams``, then
   ``/metrics`` is read (``cords_vllm_compressions_total > 0`` under ``cords``, no ``cords_vllm_`` series at all
   for plain vLLM) and every KV block must come back (``vllm:kv_cache_usage_perc`` back to 0, no stream open);
5. **none = plain vLLM** and **cords = none**, per backend: the videos shorter than the budget get the same
   greedy tokens, log-probabilities within bf16 noise (:data:`LOGPROB_TOL`);
6. **HF exactness**: the compressed engine (in-process, fp32) equals the HF reference that drops the same
   tokens (:mod:`cords_vllm.lab.reference.exactness`), with every layer compressed and with layer-selective
   compression (layers 0-1 of the tiny model's 4; the reference keeps the others whole);
7. **CUDA-gated tests**: pytest on ``tests/compress`` and every test file skipped without CUDA.
8. **compress-step benchmark**: ``benchmarks/compress_step.py``, the Triton kernels against the PyTorch path and
   the copy floor at a 7B model's shape (the kept tokens must be the same; the speed targets are reported).
9. **a step's compressions together**: ``benchmarks/step_together.py`` at token granularity, a step of 1-8
   compressions together (one greedy run on the fused path) against one after another, per implementation (the
   tokens and caches must be the same; the speed-up is reported).

It prints one summary table (step, PASS / FAIL / SKIP with the reason, seconds), writes it with every server's
log under ``--out``, and exits 1 when any step failed. A failed step never stops the others.

``--cpu`` runs the same steps on vLLM's CPU build in the project's ``.venv``: ``--enforce-eager``, 32-token
blocks and a 64 MiB pool; fp8 KV needs a bf16 model and AVX-512 there. The install and the CUDA tests are
skipped, so is Ray (vLLM's CPU platform refuses it), and the servers start ``--jobs`` at a time (3 by default:
their start-up is mostly imports).

Its parts: :mod:`~.rows` (a step's row and the table), :mod:`~.settings` (the servers and the workload),
:mod:`~.serve` (one server's run), :mod:`~.compare` (the servers' answers compared), :mod:`~.steps` (the other
steps), :mod:`~.install` and :mod:`~.cli` (the command line; ``__main__`` runs it).
"""

from __future__ import annotations

from cords_vllm.lab.gpu_check.cli import main, parse_args, report
from cords_vllm.lab.gpu_check.compare import LOGPROB_TOL, agreement, compare_rows, comparison_rows
from cords_vllm.lab.gpu_check.install import install_row
from cords_vllm.lab.gpu_check.processes import OFFLINE_ENV, REPO, first_error, python_env
from cords_vllm.lab.gpu_check.rows import FAIL, PASS, SKIP, Fail, Row, Skip, format_table, timed
from cords_vllm.lab.gpu_check.serve import Answer, ServerRun, engine_settings, run_server
from cords_vllm.lab.gpu_check.settings import (
    BUDGET,
    COMMON_FLAGS,
    CPU_FLAGS,
    CUDA_BACKENDS,
    CUDA_FLAGS,
    PLAIN_ENV,
    QUESTION,
    SLACK,
    ServerSpec,
    Workload,
    cpu_binds,
    cpu_has_avx512,
    ray_missing,
    server_specs,
)
from cords_vllm.lab.gpu_check.steps import (
    build_model,
    compress_step_row,
    cuda_device_row,
    cuda_gated_tests,
    exactness_row,
    pytest_row,
    step_together_row,
)

__all__ = [
    "BUDGET", "COMMON_FLAGS", "CPU_FLAGS", "CUDA_BACKENDS", "CUDA_FLAGS", "FAIL", "LOGPROB_TOL", "OFFLINE_ENV",
    "PASS", "PLAIN_ENV", "QUESTION", "REPO", "SKIP", "SLACK", "Answer", "Fail", "Row", "ServerRun", "ServerSpec",
    "Skip", "Workload", "agreement", "build_model", "compare_rows", "comparison_rows", "compress_step_row",
    "cpu_binds", "cpu_has_avx512", "cuda_device_row", "cuda_gated_tests", "engine_settings", "exactness_row",
    "first_error", "format_table", "install_row", "main", "parse_args", "pytest_row", "python_env", "ray_missing",
    "report", "run_server", "server_specs", "step_together_row", "timed",
]
