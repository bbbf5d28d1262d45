"""lmms-eval 0.7.3, a real evaluation client, against ``vllm serve --kv-policy cords``.

    .venv/bin/python benchmarks/lmms_eval.py                      # 8 test questions per family (32)
    .venv/bin/python benchmarks/lmms_eval.py --per-family 32 --modes video_url

Sets up lmms-eval in its own virtualenv (``scripts/setup-lmms-eval.sh``), writes a local lmms-eval task
from the video-QA generator's test split (mp4 files, a JSON Lines dataset and a task YAML; no download),
serves the shipped tiny Qwen2-VL with ``--kv-policy cords`` and runs lmms-eval's OpenAI chat model against
it in each mode: ``images``, frames decoded by lmms-eval and sent as ``image_url`` parts (its default);
``images_fixed``, the same with lmms-eval's frame cache fixed (``FRAME_CACHE_FIX`` in
``cords_vllm/lab/bench/lmms_eval.py``: as released, lmms-eval 0.7.3 sends some frames as copies of earlier
ones); ``video_url``, ``pass_video_url=True`` (the server reads and decodes the mp4). A mode is judged by
lmms-eval's logged samples, never by its exit status (0 even when every request failed). One server per way
of carrying the video (images, video) serves its modes.

The budget is ``--fraction`` of the tokens the video occupies in that mode's requests, as in
``benchmarks/accuracy.py`` (frames as images occupy 64 x (16 + 2) tokens, a video 512), with slack 0. The
same questions also go through this project's own measurements with the same settings: the offline engine
of ``benchmarks/accuracy.py`` (``run_policy``) on the frames decoded from the same mp4 files, sent the same
way, and plain chat requests to the same server carrying those frames (an mp4 data URL, or PNG
``image_url`` parts). Compressions per request come from the server's ``cords_vllm_compressions_total``
before and after each run. Prints a table and writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the offline reference engine runs in process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # quiet in-process engines (the servers log at INFO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from cords_vllm.lab.bench.lmms_eval import (
    MODES,
    LocalTask,
    Mode,
    TaskQuestion,
    find_samples,
    lmms_eval_command,
    lmms_eval_env,
    model_args,
    read_samples,
    score_samples,
    server_flags,
    write_task,
)
from cords_vllm.lab.vqa import answer_hits

REPO = Path(__file__).resolve().parent.parent
COMPRESSIONS = "cords_vllm_compressions_total"
BLOCK = 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-family", type=int, default=8, help="test questions per family (default: %(default)s)")
    p.add_argument("--families", nargs="+", default=["colour", "order", "count", "static"])
    p.add_argument("--split", default="test", help="evaluation split of cords_vllm.lab.vqa (default: %(default)s)")
    p.add_argument("--frames", type=int, default=64, help="frames per video; the model was trained on 64")
    p.add_argument("--fraction", type=float, default=0.25,
                   help="cords budget as a fraction of the tokens the video occupies (default: %(default)s)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--concurrent", type=int, default=4, help="requests in flight (lmms-eval num_concurrent)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline-engine reference runs")
    p.add_argument("--venv", type=Path, default=Path(os.environ.get("LMMS_EVAL_VENV", REPO / ".lmms-eval-venv")),
                   help="lmms-eval's virtualenv (created by scripts/setup-lmms-eval.sh; default: %(default)s)")
    p.add_argument("--work", type=Path, default=REPO / "benchmarks/out/lmms_eval",
                   help="task files and lmms-eval outputs (default: %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/lmms_eval",
                   help="where results.json goes (default: %(default)s)")
    return p.parse_args(argv)


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


def setup_lmms_eval(venv: Path) -> Path:
    """Create or reuse lmms-eval's virtualenv; returns its Python."""
    step(f"lmms-eval's virtualenv: {venv} (first run: several minutes)")
    subprocess.run(["bash", str(REPO / "scripts/setup-lmms-eval.sh")], check=True,
                   env={**os.environ, "LMMS_EVAL_VENV": str(venv)})
    return venv / "bin" / "python"


def decoded(example: Any, video: str) -> Any:
    """``example`` with the frames decoded from its mp4 (what a server or client reading the file gets)."""
    import numpy as np

    from cords_vllm.client import video_file_frames

    frames = np.stack(list(video_file_frames(video)))
    frames.setflags(write=False)
    return dataclasses.replace(example, frames=frames)


def run_offline(checkpoint: Path, examples: Sequence[Any], budget: int, inputs: str) -> dict[str, Any]:
    """``benchmarks/accuracy.py``'s cell: the in-process engine, cords at ``budget`` with slack 0."""
    from cords_vllm.lab.bench.accuracy import EngineShape, run_policy

    step(f"offline engine (benchmarks/accuracy.py's run_policy), frames as {inputs}, budget {budget}")
    t0 = time.perf_counter()
    predictions, held = run_policy(checkpoint, examples, "cords", budget, EngineShape(block_size=BLOCK), inputs)
    right = sum(answer_hits(examples, predictions))
    return {"run": "offline engine (ours)", "questions": len(examples), "right": right, "failed": 0,
            "accuracy": right / len(examples), "compressions_per_request": None, "input_tokens": None,
            "seconds": time.perf_counter() - t0, "predictions": predictions, "held_tokens_at_answer": held}


def compressions(server: Any) -> float:
    """The server's compression counter now (published at most ~0.5 s after a change: wait that long)."""
    from cords_vllm.integration.handoff.published import PUBLISH_INTERVAL_S
    from cords_vllm.lab.bench.http import scrape

    time.sleep(2 * PUBLISH_INTERVAL_S)
    return scrape(server.base_url).get(COMPRESSIONS, 0.0)


def measured(server: Any, questions: int, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s result with its wall time and the compressions per request it caused."""
    before = compressions(server)
    t0 = time.perf_counter()
    result = run()
    result["seconds"] = time.perf_counter() - t0
    result["compressions_per_request"] = (compressions(server) - before) / questions
    return result


def run_lmms_eval(python: Path, task: LocalTask, server: Any, mode: Mode, args: argparse.Namespace
                  ) -> dict[str, Any]:
    """One lmms-eval run in ``mode``; scored from its samples (its exit status is only reported)."""
    out = args.work / "runs" / mode.name
    log = args.work / f"lmms_eval_{mode.name}.log"
    margs = model_args(server.base_url, "tiny-vqa", mode, max_frames=args.frames, num_concurrent=args.concurrent)
    cmd = lmms_eval_command(python, task, out, margs, fix_frame_cache=mode.fix_frame_cache)
    shutil.rmtree(out, ignore_errors=True)  # samples of an earlier run must not be read as this one's
    step(f"lmms-eval --model openai, {mode.description} (its log: {log})")
    with log.open("w") as f:  # results table and INFO lines to the log; progress bars and errors shown
        proc = subprocess.run(cmd, env=lmms_eval_env(args.work / "datasets_cache"), stdout=f, check=False)
    try:
        score = score_samples(task.questions, read_samples(find_samples(out, task.name)))
    except FileNotFoundError as exc:
        raise RuntimeError(f"lmms-eval ({mode.name}) exited {proc.returncode} and logged no samples; see {log}"
                           ) from exc
    return {"run": f"lmms-eval {mode.name}", "exit_status": proc.returncode, **score.to_json(),
            "input_tokens": score.mean_input_tokens, "predictions": list(score.predictions)}


def chat_content(example: Any, question: TaskQuestion, inputs: str) -> list[dict[str, Any]]:
    """This project's chat messages for one question (:func:`cords_vllm.lab.vqa.chat_messages`, the trained
    prompt): the mp4 as a data URL video part, or the decoded frames as PNG image parts."""
    from cords_vllm.client import frame_data_url
    from cords_vllm.lab.vqa import chat_messages

    if inputs == "video":
        url = "data:video/mp4;base64," + base64.b64encode(Path(question.video).read_bytes()).decode()
        return chat_messages(question.question, url)
    return chat_messages(question.question, images=[frame_data_url(f, "png") for f in example.frames])


def run_http_chat(server: Any, examples: Sequence[Any], questions: Sequence[TaskQuestion], inputs: str,
                  concurrent: int) -> dict[str, Any]:
    """One plain chat request per question to ``server``, ``concurrent`` at a time, one greedy token."""

    def ask(i: int) -> tuple[str, int]:
        body = {"model": "tiny-vqa", "messages": chat_content(examples[i], questions[i], inputs), "max_tokens": 1,
                "temperature": 0}
        status, reply = server.post_json("/v1/chat/completions", body)
        if status != 200:
            print(f"    {questions[i].key}: HTTP {status}: {str(reply)[:200]}", flush=True)
            return "", 0
        return reply["choices"][0]["message"]["content"] or "", reply["usage"]["prompt_tokens"]

    step(f"this project's chat requests to the same server (frames as {inputs}), {concurrent} at a time")
    with ThreadPoolExecutor(max_workers=concurrent) as pool:
        answers = list(pool.map(ask, range(len(questions))))
    predictions = [a for a, _ in answers]
    answered = [t for a, t in answers if a]
    right = sum(answer_hits(questions, predictions))
    return {"run": "http chat (ours)", "questions": len(questions), "right": right,
            "failed": sum(not a for a in predictions), "accuracy": right / len(questions),
            "input_tokens": sum(answered) / len(answered) if answered else 0.0, "predictions": predictions}


def run_shape(inputs: str, modes: Sequence[Mode], python: Path, checkpoint: Path, task: LocalTask,
              examples: Sequence[Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """For one way of carrying the video (``video`` or ``images``): the offline reference, then one server
    for every lmms-eval mode of that shape, then this project's chat requests to the same server."""
    from cords_vllm.lab.serving.process import VLLMServer
    from cords_vllm.lab.vqa.serving import candidate_tokens

    budget = max(BLOCK, round(args.fraction * candidate_tokens(examples[0].geometry, inputs)))
    rows = [] if args.no_offline else [run_offline(checkpoint, examples, budget, inputs)]
    flags = server_flags(checkpoint, task.videos_dir, budget=budget, frames=args.frames,
                         concurrent=args.concurrent, block_size=BLOCK)
    server = VLLMServer(checkpoint, flags, env={"VLLM_LOGGING_LEVEL": "INFO"})
    step(f"vllm serve {checkpoint.name} --kv-policy cords (budget {budget}) on {server.base_url} "
         f"(log: {server.log_path})")
    t0 = time.perf_counter()
    with server:
        step(f"healthy after {time.perf_counter() - t0:.0f}s")
        for mode in modes:
            rows.append(measured(server, len(examples), lambda m=mode: run_lmms_eval(python, task, server, m, args)))
            r = rows[-1]
            step(f"{r['run']}: {r['right']}/{r['questions']} right, {r['failed']} failed requests, "
                 f"{r['compressions_per_request']:.1f} compressions per request ({r['seconds']:.0f}s; "
                 f"exit status {r['exit_status']})")
        rows.append(measured(server, len(examples),
                             lambda: run_http_chat(server, examples, task.questions, inputs, args.concurrent)))
    for r in rows:
        r.update(inputs=inputs, budget=budget)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("sent as", "run", "budget", "questions", "right", "accuracy", "failed", "compressions/request",
            "prompt tokens", "seconds")
    table = [head]
    for r in rows:
        cpr, tokens = r.get("compressions_per_request"), r.get("input_tokens")
        table.append((r["inputs"], r["run"], r["budget"], r["questions"], r["right"], f"{100 * r['accuracy']:.1f}%",
                      r["failed"], "-" if cpr is None else f"{cpr:.1f}", "-" if tokens is None else f"{tokens:.0f}",
                      f"{r['seconds']:.0f}"))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("    " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("    " + "  ".join("-" * w for w in widths))


def agreement(rows: list[dict[str, Any]], run: str, other: str) -> str | None:
    """Run ``run``'s answers against run ``other``'s, question by question (``None``: either did not run)."""
    ours = next((r for r in rows if r["run"] == run), None)
    theirs = next((r for r in rows if r["run"] == other and ours is not None and r["inputs"] == ours["inputs"]),
                  None)
    if ours is None or theirs is None:
        return None
    same = sum(x.strip() == y.strip() for x, y in zip(ours["predictions"], theirs["predictions"], strict=True))
    verdict = "equal accuracy" if ours["right"] == theirs["right"] else "DIFFERENT accuracy"
    return f"{run} vs {other}: {verdict}, {same}/{len(ours['predictions'])} identical answers"


def main(argv: list[str] | None = None) -> int:
    from cords_vllm.lab.vqa import VideoGeometry, make_split, shipped_checkpoint

    args = parse_args(argv)
    t_start = time.perf_counter()
    python = setup_lmms_eval(args.venv)
    checkpoint = shipped_checkpoint()
    examples = make_split(args.families, args.per_family, args.split, geometry=VideoGeometry(num_frames=args.frames))
    shutil.rmtree(args.work / "datasets_cache", ignore_errors=True)  # lmms-eval's copy of an earlier dataset
    task = write_task(examples, args.work / "task")
    from_mp4 = [decoded(e, q.video) for e, q in zip(examples, task.questions, strict=True)]
    step(f"task {task.name}: {len(examples)} {args.split} questions ({args.per_family} per family), "
         f"{args.frames}-frame 112x112 mp4s in {task.videos_dir}")
    rows: list[dict[str, Any]] = []
    for inputs in ("images", "video"):
        modes = [MODES[name] for name in args.modes if MODES[name].inputs == inputs]
        if modes:
            rows += run_shape(inputs, modes, python, checkpoint, task, from_mp4, args)
    print(f"\n==> {len(examples)} questions, total {time.perf_counter() - t_start:.0f}s")
    print_table(rows)
    checks = [agreement(rows, f"lmms-eval {m}", other) for m in args.modes
              for other in ("http chat (ours)", "offline engine (ours)")]
    for line in filter(None, checks):
        print(f"    {line}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"questions": [dataclasses.asdict(q) | {"video": Path(q.video).name} for q in task.questions],
              "settings": {k: v for k, v in vars(args).items() if k not in ("venv", "work", "out")},
              "server_flags": {r["inputs"]: server_flags(checkpoint, "VIDEO_DIR", budget=r["budget"],
                                                         frames=args.frames, concurrent=args.concurrent,
                                                         block_size=BLOCK) for r in rows},
              "runs": rows, "agreement": [c for c in checks if c]}
    path = args.out / "results.json"
    path.write_text(json.dumps(result, indent=1))
    step(f"results: {path}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
