"""lmms-eval (0.7.3) as a client of a ``--kv-policy`` server: the local task, the command, the samples.

The pure parts of ``benchmarks/lmms_eval.py``; nothing here imports lmms-eval, which lives in its own
virtualenv (``scripts/setup-lmms-eval.sh``) and runs as a subprocess.

- :func:`write_task` turns video questions (:mod:`cords_vllm.lab.vqa`) into an lmms-eval task that needs no
  download: each video as an mp4 file, a JSON Lines dataset (one question per line, the video's absolute
  path in ``video``) and a task YAML that reads it with the ``json`` builder of ``datasets``. The task's
  user turn is the video followed by the family's question text, so with the video sent as one video part
  the server renders exactly the prompt the shipped model was trained on (:mod:`cords_vllm.lab.vqa.prompt`).
- :func:`lmms_eval_command` runs lmms-eval's OpenAI chat model (``--model openai``) against a server in one
  of :data:`MODES`: frames decoded on the client and sent as images (lmms-eval's default; also with its
  frame cache fixed, :data:`FRAME_CACHE_FIX`), or the video's ``file://`` URL (``pass_video_url=True``).
  :func:`server_flags` gives the ``vllm serve`` flags both need.
- :func:`read_samples` and :func:`score_samples` read what lmms-eval logged per question
  (``--log_samples``). lmms-eval exits 0 even when every request failed (it records the failure as the
  response text), so a run is judged by its samples only: an empty or failed response is counted as a
  failure, and a question without a sample is counted as failed too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cords_vllm.lab.bench.offline import kv_bytes_per_block
from cords_vllm.lab.synthetic import encode_mp4
from cords_vllm.lab.vqa import VQAExample, answer_hits
from cords_vllm.utils import cdiv

#: Name of the generated task (``--tasks``).
TASK_NAME = "cords_vqa"
#: Prefixes lmms-eval 0.7.3's OpenAI model writes as the response of a request it gave up on.
FAILURE_PREFIXES = ("[LMMS_EVAL_REQUEST_FAILED", "[LMMS_EVAL_BUDGET_EXCEEDED]")
#: lmms-eval's model name for OpenAI-compatible chat servers (``lmms_eval/models/chat/openai.py``).
LMMS_EVAL_MODEL = "openai"


@dataclass(frozen=True)
class Mode:
    """How lmms-eval sends each video to the server.

    ``pass_video_url=False`` (lmms-eval's default): the client decodes ``max_frames_num`` frames with
    qwen-vl-utils, resizes them (to at least 128 vision tokens each, e.g. 112x112 -> 336x336) and sends
    them as PNG ``image_url`` parts. ``True``: one ``video_url`` part with a ``file://`` URL, plus per-request
    ``media_io_kwargs`` ``{"video": {"num_frames": max_frames_num}}``. ``fix_frame_cache``: run lmms-eval
    with :data:`FRAME_CACHE_FIX` (see there).
    """

    name: str
    pass_video_url: bool
    description: str
    fix_frame_cache: bool = False

    @property
    def inputs(self) -> str:
        """How the requests carry the video, in ``benchmarks/accuracy.py``'s terms: ``video`` or ``images``."""
        return "video" if self.pass_video_url else "images"


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("images", False, "frames decoded by lmms-eval, sent as image_url parts"),
    Mode("images_fixed", False, "frames as image_url parts, lmms-eval's frame cache fixed", fix_frame_cache=True),
    Mode("video_url", True, "pass_video_url=True: one file:// video_url part, decoded by the server"),
)}

#: lmms-eval run with its PNG cache keyed by content. lmms-eval 0.7.3 caches each frame's base64 PNG under
#: ``id(image)`` (``media_encoder._build_cache_key``) while ``ChatMessages.to_openai_messages`` creates one PIL
#: image per frame and drops it at once, so a later frame whose image reuses a freed one's id is sent as that
#: earlier frame's PNG: of 64 distinct frames, 9 to 51 distinct ones reached the server. This launcher keys
#: the cache by the image's size, mode and pixel hash instead, then starts lmms-eval's own CLI.
FRAME_CACHE_FIX = """\
import hashlib
import lmms_eval.models.model_utils.media_encoder as encoder
original = encoder._build_cache_key
def content_key(image, **kwargs):
    if hasattr(image, "tobytes") and hasattr(image, "mode"):
        digest = hashlib.sha1(image.tobytes()).hexdigest()
        return ("content", image.size, image.mode, digest, *sorted(kwargs.items()))
    return original(image, **kwargs)
encoder._build_cache_key = content_key
from lmms_eval.cli.dispatch import main
main()
"""


@dataclass(frozen=True)
class TaskQuestion:
    """One question of a written task: its ``doc_id`` (line in the dataset) and where it comes from."""

    doc_id: int
    family: str
    index: int
    seed: int
    question: str
    answer: str
    video: str

    @property
    def key(self) -> str:
        """Stable name of the question, ``family-seed-index`` (also the video's file stem)."""
        return f"{self.family}-{self.seed}-{self.index}"


@dataclass(frozen=True)
class LocalTask:
    """A task written by :func:`write_task`: the directory for ``--include_path`` and its files."""

    name: str
    root: Path
    yaml_path: Path
    data_path: Path
    videos_dir: Path
    questions: tuple[TaskQuestion, ...]


def task_yaml(name: str, data_path: str | os.PathLike) -> str:
    """The task YAML: a local JSON Lines dataset, the video then the question, one greedy answer token.

    Strings are written as JSON (which YAML reads as is), so any path works. ``doc_to_visual: video``
    hands lmms-eval the path string; a path whose extension is not an image's or audio's becomes a video
    part. ``exact_match`` is lmms-eval's own score; :func:`score_samples` recomputes it from the responses.
    """
    q = json.dumps
    return "\n".join([
        f"task: {q(name)}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {q(str(data_path))}",
        "test_split: test",
        "output_type: generate_until",
        "doc_to_visual: video",
        "doc_to_text: question",
        "doc_to_target: answer",
        "generation_kwargs:",
        "  max_new_tokens: 1",
        "  temperature: 0",
        "metric_list:",
        "  - metric: exact_match",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 0.0",
        "",
    ])


def write_task(examples: Sequence[VQAExample], root: str | os.PathLike, *, name: str = TASK_NAME,
               fps: float = 2.0) -> LocalTask:
    """Write ``examples`` as an lmms-eval task under ``root`` (``videos/*.mp4``, ``NAME.jsonl``,
    ``NAME.yaml``); every path written into the dataset and YAML is absolute. Existing files are replaced.
    """
    root = Path(root).resolve()
    videos = root / "videos"
    videos.mkdir(parents=True, exist_ok=True)
    questions = []
    for doc_id, ex in enumerate(examples):
        q = TaskQuestion(doc_id, ex.family, ex.index, ex.seed, ex.question, ex.answer, "")
        path = videos / f"{q.key}.mp4"
        path.write_bytes(encode_mp4(ex.frames, fps=fps))
        questions.append(TaskQuestion(**{**asdict(q), "video": str(path)}))
    data_path = root / f"{name}.jsonl"
    data_path.write_text("".join(json.dumps(asdict(q)) + "\n" for q in questions))
    yaml_path = root / f"{name}.yaml"
    yaml_path.write_text(task_yaml(name, data_path))
    return LocalTask(name, root, yaml_path, data_path, videos, tuple(questions))


def read_questions(data_path: str | os.PathLike) -> list[TaskQuestion]:
    """The questions of a written dataset, in ``doc_id`` order."""
    lines = Path(data_path).read_text().splitlines()
    return [TaskQuestion(**json.loads(line)) for line in lines if line.strip()]


def model_args(base_url: str, model: str, mode: Mode, *, max_frames: int, num_concurrent: int = 4,
               api_key: str = "EMPTY", max_retries: int = 2) -> str:
    """``--model_args`` of lmms-eval's OpenAI chat model for a server at ``base_url`` (without ``/v1``)."""
    args = {"model_version": model, "base_url": base_url.rstrip("/") + "/v1", "api_key": api_key,
            "max_frames_num": max_frames, "num_concurrent": num_concurrent, "max_retries": max_retries,
            "pass_video_url": mode.pass_video_url}
    for key, value in args.items():
        if "," in str(value) or "=" in str(value):
            raise ValueError(f"lmms-eval cannot parse model_args value {key}={value!r} (',' or '=')")
    return ",".join(f"{k}={v}" for k, v in args.items())


def lmms_eval_command(python: str | os.PathLike, task: LocalTask, output_dir: str | os.PathLike,
                      model_arguments: str, *, fix_frame_cache: bool = False) -> list[str]:
    """The lmms-eval command line: the local task, samples logged under ``output_dir``; with
    ``fix_frame_cache``, through :data:`FRAME_CACHE_FIX` instead of ``-m lmms_eval``."""
    launcher = ["-c", FRAME_CACHE_FIX] if fix_frame_cache else ["-m", "lmms_eval"]
    return [str(python), *launcher, "--model", LMMS_EVAL_MODEL, "--model_args", model_arguments,
            "--tasks", task.name, "--include_path", str(task.root), "--batch_size", "1", "--log_samples",
            "--output_path", str(output_dir), "--verbosity", "WARNING"]


def lmms_eval_env(cache_dir: str | os.PathLike, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for lmms-eval: offline hub and datasets, its datasets cache in ``cache_dir``, no
    tracking, and no proxy for the local server."""
    env = dict(os.environ if base is None else base)
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(name, None)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "LMMS_EVAL_DATASETS_CACHE": str(cache_dir), "WANDB_MODE": "disabled", "NO_PROXY": "127.0.0.1",
                "no_proxy": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false"})
    return env


#: Prompt tokens besides the vision tokens (system prompt, question, chat markup), rounded up generously.
TEXT_TOKENS = 64


def server_flags(model_dir: str | os.PathLike, media_dir: str | os.PathLike, *, budget: int, frames: int = 64,
                 frame_side: int = 112, concurrent: int = 4, block_size: int = 32, chunk: int = 64,
                 served_model_name: str = "tiny-vqa") -> list[str]:
    """``vllm serve`` flags for lmms-eval in both :data:`MODES` against the shipped video-QA model.

    The policy settings are those of a ``benchmarks/accuracy.py`` cell (``slack`` 0: compress whenever the
    held video passes ``budget``; ``recent`` its default) so the offline engine gives the same answers; the
    pool holds ``concurrent`` requests of ``--max-model-len``, which fits ``frames`` frames sent as images.
    ``media_dir``: the directory of the task's videos (absolute), which ``file://`` URLs may name.
    """
    frame_tokens = (frame_side // 28) ** 2
    max_len = cdiv(frames * (frame_tokens + 2) + TEXT_TOKENS, 256) * 256  # an image per frame, each with markers
    kv_bytes = (concurrent * cdiv(max_len, block_size) + 1) * kv_bytes_per_block(model_dir, block_size, 4)
    return [
        "--kv-policy", "cords",
        "--kv-policy-config", json.dumps({"budget": budget, "slack": 0}),
        "--served-model-name", served_model_name,
        "--dtype", "float32", "--enforce-eager", "--block-size", str(block_size),
        "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(max_len),
        # The encoder cache is sized by this: every prompt being prefilled keeps its vision output there.
        "--max-num-batched-tokens", str(concurrent * max_len),
        # Prefill chunk per request, as benchmarks/accuracy.py's --chunk.
        "--long-prefill-token-threshold", str(chunk),
        # Frames as images: one image part per frame (lmms-eval's default mode).
        "--limit-mm-per-prompt", json.dumps({"image": frames, "video": 1}),
        # lmms-eval sizes client-decoded frames to at least 128 vision tokens (112x112 -> 336x336, bicubic)
        # and offers no argument to change it; max_pixels resizes them back to the trained 112x112 (16 tokens
        # a frame instead of 64 at the processor's 224x224 cap). An exact 3x bicubic upscale keeps every
        # original pixel at the centre of its 3x3 block, and resample 0 (nearest, which transformers applies
        # as nearest-exact) picks those centres: the model sees the decoded frames exactly. Videos already at
        # 112x112 are not resized.
        "--mm-processor-kwargs", json.dumps({"max_pixels": frame_side * frame_side, "resample": 0}),
        # Every frame of a video_url (vLLM samples 32 by default); lmms-eval's pass_video_url sets it per
        # request anyway (num_frames = max_frames_num).
        "--media-io-kwargs", json.dumps({"video": {"num_frames": -1}}),
        # Lets clients set media-decoding kwargs per request: lmms-eval's pass_video_url always sends
        # media_io_kwargs, which vLLM otherwise refuses with 400.
        "--trust-request-mm-kwargs",
        # Lets the server read files under this directory: pass_video_url sends file:// URLs.
        "--allowed-local-media-path", str(media_dir),
    ]


def find_samples(output_dir: str | os.PathLike, task_name: str = TASK_NAME) -> Path:
    """The samples file lmms-eval wrote under ``output_dir``
    (``<model>/<date>_samples_<task>.jsonl``; the newest if several)."""
    found = sorted(Path(output_dir).rglob(f"*_samples_{task_name}.jsonl"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *_samples_{task_name}.jsonl under {output_dir}: lmms-eval logged no samples")
    return found[-1]


@dataclass(frozen=True)
class Sample:
    """One logged lmms-eval sample: the question's ``doc_id``, its target, the response text and the prompt
    tokens the server reported for it (0 when the request failed)."""

    doc_id: int
    target: str
    response: str
    input_tokens: int = 0

    @property
    def failed(self) -> bool:
        """The request produced no answer: empty response, or lmms-eval's failure text."""
        return is_failed_response(self.response)


def is_failed_response(text: str | None) -> bool:
    """Whether a response is a failed request rather than an answer (empty, or lmms-eval's failure marker)."""
    if text is None or not str(text).strip():
        return True
    return str(text).lstrip().startswith(FAILURE_PREFIXES)


def _response_text(record: dict[str, Any]) -> str:
    """The response of one sample: ``filtered_resps`` (``resps`` is dropped when equal), unwrapped from
    the one-element lists lmms-eval may leave."""
    value: Any = record.get("filtered_resps", record.get("resps", ""))
    while isinstance(value, list):
        value = value[0] if value else ""
    if isinstance(value, dict):  # a GenerationResult serialised as a dict
        value = value.get("text", "")
    return "" if value is None else str(value)


def read_samples(path: str | os.PathLike) -> list[Sample]:
    """The samples of an lmms-eval ``*_samples_<task>.jsonl`` file, in file order."""
    samples = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        counts = record.get("token_counts") or [{}]
        tokens = int((counts[0] if isinstance(counts, list) else counts).get("input_tokens") or 0)
        samples.append(Sample(int(record["doc_id"]), str(record.get("target", "")), _response_text(record), tokens))
    return samples


@dataclass(frozen=True)
class ModeScore:
    """Per-question outcome of one lmms-eval run, aligned with the task's questions.

    ``predictions[i]`` is the response to question ``i`` (``""`` when failed or missing); ``failed`` counts
    failed requests and questions without a sample; a failure is never right.
    """

    questions: int
    right: int
    failed: int
    predictions: tuple[str, ...]
    failed_doc_ids: tuple[int, ...]
    #: mean prompt tokens the server reported per answered request (0.0 when none was answered)
    mean_input_tokens: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.right / self.questions if self.questions else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "accuracy": self.accuracy}


def score_samples(questions: Sequence[TaskQuestion], samples: Sequence[Sample]) -> ModeScore:
    """Match samples to questions by ``doc_id`` and count right answers (stripped exact match) and failures.

    Raises ``ValueError`` when a sample names an unknown question, a question has two samples, or a
    sample's target is not the question's answer (the samples belong to another dataset).
    """
    by_id: dict[int, Sample] = {}
    for s in samples:
        if not 0 <= s.doc_id < len(questions) or questions[s.doc_id].doc_id != s.doc_id:
            raise ValueError(f"sample for unknown doc_id {s.doc_id} ({len(questions)} questions)")
        if s.doc_id in by_id:
            raise ValueError(f"two samples for doc_id {s.doc_id}")
        if s.target.strip() != questions[s.doc_id].answer:
            raise ValueError(f"doc_id {s.doc_id}: sample target {s.target!r} is not the answer "
                             f"{questions[s.doc_id].answer!r}: samples of another dataset?")
        by_id[s.doc_id] = s
    predictions, failed = [], []
    for q in questions:
        s = by_id.get(q.doc_id)
        if s is None or s.failed:
            failed.append(q.doc_id)
            predictions.append("")
        else:
            predictions.append(s.response)
    right = sum(answer_hits(questions, predictions))
    tokens = [s.input_tokens for s in by_id.values() if not s.failed]
    return ModeScore(len(questions), right, len(failed), tuple(predictions), tuple(failed),
                     sum(tokens) / len(tokens) if tokens else 0.0)
