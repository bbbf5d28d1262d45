"""The lmms-eval task written from the video-QA generator, and the reading of lmms-eval's samples.

Fast and self-contained: no lmms-eval, no server. The sample lines follow what lmms-eval 0.7.3 writes with
``--log_samples`` (``<output>/<model>/<date>_samples_<task>.jsonl``), including its failed-request marker.
The slow test runs the real thing when lmms-eval's virtualenv exists (``scripts/setup-lmms-eval.sh``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from cords_vllm.client import video_file_frames
from cords_vllm.lab.bench.lmms_eval import (
    FRAME_CACHE_FIX,
    MODES,
    TASK_NAME,
    Sample,
    find_samples,
    is_failed_response,
    lmms_eval_command,
    model_args,
    read_questions,
    read_samples,
    score_samples,
    server_flags,
    write_task,
)
from cords_vllm.lab.vqa import VideoGeometry, make_example, shipped_checkpoint

REPO = Path(__file__).resolve().parents[2]
SMALL = VideoGeometry(num_frames=16, size=56)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    examples = [make_example(family, 0, seed=3_000_017, geometry=SMALL) for family in ("colour", "count", "static")]
    return write_task(examples, tmp_path_factory.mktemp("task")), examples


def _line(doc_id: int, target: str, response: str, tokens: int = 541) -> str:
    """One sample line as lmms-eval 0.7.3 logs it (``doc`` and ``arguments`` dropped; ``resps`` dropped when
    equal to ``filtered_resps``)."""
    return json.dumps({"doc_id": doc_id, "target": target, "filtered_resps": response,
                       "token_counts": [{"input_tokens": tokens, "output_tokens": 1, "reasoning_tokens": 0}],
                       "doc_hash": "74234e98", "exact_match": float(response == target),
                       "input": "What color was the square?"}) + "\n"


def test_task_files_hold_the_questions_videos_and_yaml(task):
    written, examples = task
    assert written.yaml_path == written.root / f"{TASK_NAME}.yaml" and written.root.is_absolute()
    config = yaml.safe_load(written.yaml_path.read_text())
    assert config["task"] == TASK_NAME and config["dataset_path"] == "json"
    assert config["dataset_kwargs"]["data_files"]["test"] == str(written.data_path)
    assert (config["test_split"], config["doc_to_visual"], config["doc_to_text"], config["doc_to_target"]) == (
        "test", "video", "question", "answer")
    assert config["generation_kwargs"]["max_new_tokens"] == 1
    questions = read_questions(written.data_path)
    assert questions == list(written.questions)
    for doc_id, (q, ex) in enumerate(zip(questions, examples, strict=True)):
        assert (q.doc_id, q.family, q.question, q.answer, q.seed) == (doc_id, ex.family, ex.question, ex.answer,
                                                                      ex.seed)
        video = Path(q.video)
        assert video.is_absolute() and video.parent == written.videos_dir and video.suffix == ".mp4"
        frames = np.stack(list(video_file_frames(video)))
        assert frames.shape == ex.frames.shape
        assert np.abs(frames.astype(int) - ex.frames).mean() < 20  # lossy mp4, same pictures


def test_task_text_is_the_trained_question(task):
    written, _ = task
    questions = {q.family: q.question for q in written.questions}
    assert questions == {"colour": "What color was the square?", "count": "How many red flashes?",
                         "static": "What color is the dot?"}
    assert all(q.answer and q.answer == q.answer.strip() for q in written.questions)  # "0" stays a string


def test_samples_score_right_wrong_failed_and_missing(task, tmp_path):
    written, _ = task
    qs = written.questions
    path = tmp_path / "tiny-vqa" / f"20261124_105857_samples_{TASK_NAME}.jsonl"
    path.parent.mkdir()
    path.write_text(_line(0, qs[0].answer, f" {qs[0].answer}") + _line(1, qs[1].answer, "7", tokens=539))
    assert find_samples(tmp_path) == path
    samples = read_samples(path)
    assert samples == [Sample(0, qs[0].answer, f" {qs[0].answer}", 541), Sample(1, qs[1].answer, "7", 539)]
    score = score_samples(qs, samples)  # question 2 has no sample: failed, not skipped
    assert (score.questions, score.right, score.failed, score.failed_doc_ids) == (3, 1, 1, (2,))
    assert score.accuracy == pytest.approx(1 / 3) and score.mean_input_tokens == 540
    assert score.predictions == (f" {qs[0].answer}", "7", "")


def test_failed_requests_never_pass(task, tmp_path):
    written, _ = task
    qs = written.questions
    path = tmp_path / "samples.jsonl"
    failure = "[LMMS_EVAL_REQUEST_FAILED after 2 retries] Error code: 400 - {'error': 'media_io_kwargs'}"
    path.write_text(_line(0, qs[0].answer, failure, tokens=0) + _line(1, qs[1].answer, "", tokens=0)
                    + _line(2, qs[2].answer, qs[2].answer))
    score = score_samples(qs, read_samples(path))
    assert (score.right, score.failed, score.failed_doc_ids) == (1, 2, (0, 1))
    assert is_failed_response("[LMMS_EVAL_BUDGET_EXCEEDED]") and is_failed_response("  ")
    assert not is_failed_response("red")


def test_nested_responses_are_unwrapped(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"doc_id": 0, "target": "red", "resps": [["red "]], "filtered_resps": ["red"]}))
    assert read_samples(path) == [Sample(0, "red", "red", 0)]


def test_samples_of_another_dataset_are_refused(task):
    written, _ = task
    with pytest.raises(ValueError, match="not the answer"):
        score_samples(written.questions, [Sample(0, "not-an-answer", "red")])
    with pytest.raises(ValueError, match="unknown doc_id"):
        score_samples(written.questions, [Sample(9, "red", "red")])
    with pytest.raises(ValueError, match="two samples"):
        a = written.questions[0].answer
        score_samples(written.questions, [Sample(0, a, a), Sample(0, a, a)])


def test_no_samples_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*_samples_"):
        find_samples(tmp_path)


def test_command_and_model_args(task):
    written, _ = task
    args = model_args("http://127.0.0.1:8000/", "tiny-vqa", MODES["video_url"], max_frames=64)
    assert args.split(",")[:2] == ["model_version=tiny-vqa", "base_url=http://127.0.0.1:8000/v1"]
    assert "pass_video_url=True" in args and "max_frames_num=64" in args
    assert "pass_video_url=False" in model_args("http://h:1", "m", MODES["images"], max_frames=8)
    with pytest.raises(ValueError, match="cannot parse"):
        model_args("http://h:1", "a,b", MODES["images"], max_frames=8)
    cmd = lmms_eval_command("python", written, "/out", args)
    assert cmd[:3] == ["python", "-m", "lmms_eval"] and "--log_samples" in cmd
    assert cmd[cmd.index("--include_path") + 1] == str(written.root) and cmd[cmd.index("--tasks") + 1] == TASK_NAME
    fixed = lmms_eval_command("python", written, "/out", args, fix_frame_cache=True)
    assert fixed[:3] == ["python", "-c", FRAME_CACHE_FIX] and fixed[3:] == cmd[3:]
    compile(FRAME_CACHE_FIX, "<launcher>", "exec")
    assert [m.inputs for m in MODES.values()] == ["images", "images", "video"]
    assert [m.fix_frame_cache for m in MODES.values()] == [False, True, False]


def test_server_flags_expose_what_lmms_eval_needs(tmp_path):
    flags = server_flags(shipped_checkpoint(), tmp_path, budget=128)
    assert "--trust-request-mm-kwargs" in flags
    assert flags[flags.index("--allowed-local-media-path") + 1] == str(tmp_path)
    assert json.loads(flags[flags.index("--mm-processor-kwargs") + 1]) == {"max_pixels": 112 * 112, "resample": 0}
    assert json.loads(flags[flags.index("--limit-mm-per-prompt") + 1]) == {"image": 64, "video": 1}
    assert json.loads(flags[flags.index("--kv-policy-config") + 1]) == {"budget": 128, "slack": 0}
    assert int(flags[flags.index("--max-model-len") + 1]) >= 64 * 18 + 29  # 64 frames as images fit


LMMS_EVAL_VENV = Path(os.environ.get("LMMS_EVAL_VENV", REPO / ".lmms-eval-venv"))


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.skipif(not (LMMS_EVAL_VENV / ".lmms-eval-0.7.3-installed").is_file(),
                    reason="lmms-eval's virtualenv is absent (scripts/setup-lmms-eval.sh)")
def test_lmms_eval_against_a_cords_server_end_to_end(tmp_path):
    """lmms-eval in video_url mode against a real cords server: no failed request, compressions, and the
    same answers as this project's own chat requests and offline engine."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/lmms_eval.py"), "--per-family", "1",
                           "--modes", "video_url", "--venv", str(LMMS_EVAL_VENV), "--work", str(tmp_path / "work"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {r["run"]: r for r in json.loads((tmp_path / "out/results.json").read_text())["runs"]}
    lmms = runs["lmms-eval video_url"]
    assert lmms["failed"] == 0 and lmms["compressions_per_request"] > 0
    for other in ("http chat (ours)", "offline engine (ours)"):
        assert [p.strip() for p in runs[other]["predictions"]] == [p.strip() for p in lmms["predictions"]]
