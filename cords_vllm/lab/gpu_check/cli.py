"""The GPU check's command line: every step in order (the servers and exactness checks ``--jobs`` at a time), the
summary table printed and written to ``summary.json``, exit status 1 when a step failed."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from cords_vllm.lab.gpu_check.compare import comparison_rows
from cords_vllm.lab.gpu_check.install import install_row
from cords_vllm.lab.gpu_check.processes import REPO
from cords_vllm.lab.gpu_check.rows import FAIL, PASS, SKIP, Row, format_table, timed
from cords_vllm.lab.gpu_check.serve import ServerRun, run_server
from cords_vllm.lab.gpu_check.settings import ServerSpec, Workload, cpu_binds, server_specs
from cords_vllm.lab.gpu_check.steps import (
    build_model,
    compress_step_row,
    cuda_device_row,
    exactness_row,
    pytest_row,
    step_together_row,
)

#: ``--help``'s first line.
DESCRIPTION = "One check a GPU user runs: install, serve, stream, compare, count, and the CUDA tests, in one table."


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=DESCRIPTION)
    p.add_argument("--cpu", action="store_true", help="run the steps on vLLM's CPU build (no install, no CUDA tests)")
    p.add_argument("--skip-install", action="store_true", help="use --venv (or this Python) as it is")
    p.add_argument("--no-install", action="store_true",
                   help="install nothing and use what this Python can import (a GPU host with no network or "
                        "package index: vLLM brought in by hand, the project on PYTHONPATH)")
    p.add_argument("--eager", action="store_true",
                   help="serve with --enforce-eager (faster start-up); one cords server keeps vLLM's CUDA graphs")
    p.add_argument("--venv", type=Path, default=REPO / ".venv-cuda",
                   help="the virtualenv the GPU mode installs into and runs in (default: .venv-cuda)")
    p.add_argument("--out", type=Path, default=REPO / "gpu-check-out",
                   help="where the summary (summary.json) and every log go (default: gpu-check-out)")
    p.add_argument("--jobs", type=int, default=None,
                   help="servers (and the exactness check) run at once (default: 1 on a GPU, 3 with --cpu)")
    p.add_argument("--install-row", help=argparse.SUPPRESS)  # the install's row, handed to the re-executed check
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every step, print the summary table, return 1 when any step failed."""
    args = parse_args(argv)
    started = time.perf_counter()
    rows: list[Row] = []
    if args.cpu:
        rows.append(Row("install .[cuda,dev,ray]", SKIP, 0.0, "--cpu uses the project's .venv (make setup)"))
    elif args.no_install:
        rows.append(Row("install .[cuda,dev,ray]", SKIP, 0.0, f"--no-install: {sys.executable} as it is"))
    elif args.install_row:
        rows.append(Row(**json.loads(args.install_row)))
    elif args.skip_install:
        rows.append(Row("install .[cuda,dev,ray]", SKIP, 0.0, "--skip-install"))
        python = args.venv / "bin" / "python"
        if python.is_file() and Path(sys.prefix).resolve() != args.venv.resolve():
            os.execv(str(python), [str(python), "-m", "cords_vllm.lab.gpu_check", *(argv or sys.argv[1:])])
    else:
        row = install_row(args.venv)
        if row.result == PASS:
            python = str(args.venv / "bin" / "python")
            os.execv(python, [python, "-m", "cords_vllm.lab.gpu_check", *(argv or sys.argv[1:]), "--skip-install",
                              "--install-row", json.dumps(asdict(row))])
        rows.append(row)
        rows.append(Row("everything else", SKIP, 0.0, "no environment to run in: the install failed"))
        return report(rows, args, started)

    args.out.mkdir(parents=True, exist_ok=True)
    if not args.cpu:
        rows.append(cuda_device_row())
        if rows[-1].result != PASS:
            rows.append(Row("everything else", SKIP, 0.0, "no CUDA device"))
            return report(rows, args, started)
    model: list[str] = []

    def tiny_model() -> str:
        model.append(build_model())
        return model[0]

    rows.append(timed("tiny model (bf16)", tiny_model))
    if not model:
        rows.append(Row("everything else", SKIP, 0.0, "no model"))
        return report(rows, args, started)

    workload = Workload()
    specs = server_specs(args.cpu, args.eager)
    jobs = max(1, args.jobs or (3 if args.cpu else 1))
    # CPU servers started together each get cores of their own (OpenMP threads that share cores spin-wait)
    binds = cpu_binds(jobs) if args.cpu and jobs > 1 else []
    envs = [{"VLLM_CPU_OMP_THREADS_BIND": binds[i % len(binds)]} if binds else None for i in range(len(specs))]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        servers = [pool.submit(run_server, spec, model[0], workload, args.out, env)
                   for spec, env in zip(specs, envs, strict=True)]
        exact = [pool.submit(exactness_row, model[0], args.out, layers) for layers in (None, 2)]
        runs = [_result(f, spec) for f, spec in zip(servers, specs, strict=True)]
        for run in runs:
            rows.extend(run.rows)
        rows.extend(comparison_rows(runs))
        rows.extend(f.result() for f in exact)
    rows.append(pytest_row(args.cpu, args.out))
    rows.append(compress_step_row(args.cpu, args.out))
    rows.append(step_together_row(args.cpu, args.out))
    return report(rows, args, started)


def _result(future: concurrent.futures.Future, spec: ServerSpec) -> ServerRun:
    """A server's run, or one FAIL row when the run itself broke (the other servers' rows stand)."""
    try:
        return future.result()
    except Exception as exc:
        return ServerRun(spec, [Row(f"{spec.label}: serve", FAIL, 0.0, f"{type(exc).__name__}: {exc}")])


def report(rows: list[Row], args: argparse.Namespace, started: float) -> int:
    """Print the table, write ``summary.json`` under ``--out``; 1 when any row failed."""
    failed = [r for r in rows if r.result == FAIL]
    total = time.perf_counter() - started
    mode = "--cpu (vLLM's CPU build)" if args.cpu else "CUDA"
    print(f"\ncords-vllm gpu-check, {mode}: {len(rows) - len(failed)} of {len(rows)} steps passed or skipped, "
          f"{len(failed)} failed, {total:.0f} s\n")
    print(format_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"mode": "cpu" if args.cpu else "cuda", "seconds": total, "failed": len(failed),
               "rows": [asdict(r) for r in rows]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nlogs and summary.json: {args.out}", flush=True)
    return 1 if failed else 0
