"""Train the tiny Qwen2-VL on the synthetic needle-video QA task (:mod:`cords_vllm.lab.vqa`), CPU-friendly.

Teacher forcing on the one answer token (cross-entropy over the whole vocabulary at the last prompt token),
AdamW, linear warm-up then cosine decay, fixed seed. Every ``--eval-every`` steps the model is scored on a
fixed monitor split; the best monitor score is kept. At the end the best weights are scored on the
held-out split, converted to ``--save-dtype``, saved with tokenizer, processor and chat template, scored
again from the saved files (HF, fp32 compute) and, with ``--vllm-per-family``, through the real vLLM engine;
``training.json`` next to the weights records configuration, data description and results.

Examples (the four runs that made the shipped ``cords_vllm/lab/assets/tiny_vqa``, 38 + 36 + 24 + 22 minutes on 2
shared CPU cores; ``training.json`` there records all four, each earlier one under ``continued_from``)::

    python benchmarks/train_vqa.py --minutes 38 --curriculum colour@32:350 --train-frames 16,32,64 \
        --output .cache/vqa-runs/r2
    python benchmarks/train_vqa.py --init .cache/vqa-runs/r2/checkpoint --minutes 36 --lr 5e-4 \
        --train-frames 16,32,64 --heldout-frames 128 --output .cache/vqa-runs/r3
    # fine-tune on both request shapes: a batch is sent as one video or as one image per frame
    python benchmarks/train_vqa.py --init .cache/vqa-runs/r3/checkpoint --inputs video,images --steps 575 \
        --lr 3e-4 --warmup 10 --train-frames 16,32,64 --heldout-frames 128 --output .cache/vqa-runs/r4
    # then weight frames as images 2:1 and count questions 2:1 (repeats in --inputs / --family-weights)
    python benchmarks/train_vqa.py --init .cache/vqa-runs/r4/checkpoint --inputs video,images,images \
        --family-weights count=2 --steps 450 --lr 2e-4 --warmup 10 --train-frames 16,32,64 \
        --heldout-frames 128 --output .cache/vqa-runs/r5

    # re-measure a checkpoint without training (HF + vLLM), rewriting its training.json results
    python benchmarks/train_vqa.py --eval-only cords_vllm/lab/assets/tiny_vqa

Run with ``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import platform
import queue
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine for --vllm-per-family

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from cords_vllm.lab.vqa import (
    PROMPT_TEMPLATE,
    SPLIT_SEEDS,
    CountFamily,
    Family,
    VideoGeometry,
    VQAExample,
    accuracy_report,
    answer_vocabulary,
    base_model_spec,
    build_base_model,
    format_report,
    get_family,
    make_example,
    make_split,
)
from cords_vllm.lab.vqa.hf import HFEncoder, answer_logits, fast_vision_attention, predict, video_t_factor
from cords_vllm.lab.vqa.model import TRAINING_RECORD
from cords_vllm.lab.vqa.stream_task import (
    STREAM_SPLIT_SEEDS,
    StreamEncoder,
    StreamExample,
    make_stream_example,
    stream_logits,
    stream_split,
)

DEFAULT_FAMILIES = "colour,order,count,static"


def clip_range(text: str) -> tuple[int, int]:
    """``--stream-clips LO,HI`` as ``(lo, hi)``, with ``1 <= lo <= hi``."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want LO,HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("task")
    g.add_argument("--families", default=DEFAULT_FAMILIES, help="comma-separated question families")
    g.add_argument("--frames", type=int, default=64, help="frames per video (evaluation length)")
    g.add_argument("--train-frames", default=None,
                   help="comma-separated frame counts sampled per training batch (default: --frames)")
    g.add_argument("--size", type=int, default=112, help="frame side in pixels (multiple of 28)")
    g.add_argument("--inputs", default="video",
                   help="comma-separated ways the videos are sent, drawn per training batch and all monitored: "
                        "video (one video input) and images (every frame its own image, as evaluation clients "
                        "send a video); a shape listed twice is drawn twice as often")
    g.add_argument("--count-max", type=int, default=2, help="count family: answers 0..count-max")
    g.add_argument("--count-decoys", type=int, default=0, help="count family: up to this many decoy flashes")
    g.add_argument("--family-weights", default=None, metavar="NAME=W,...",
                   help="integer share of each family in the main phase's batches (default 1 each), "
                        "e.g. 'count=2'")
    g.add_argument("--curriculum", nargs="*", default=[], metavar="FAMILIES@FRAMES:STEPS",
                   help="stages run before the main phase, e.g. 'colour@32:300' trains 300 steps on the "
                        "colour family with 32-frame videos; then --families / --train-frames")
    g.add_argument("--stream-batch", type=int, default=0,
                   help="stream-shaped examples per step besides --batch (cords_vllm.lab.vqa.stream_task): several "
                        "marks, the latest asked about, older clips partly held, position gaps; 0: off")
    g.add_argument("--stream-size", type=int, default=112, help="frame side of the stream examples")
    g.add_argument("--stream-clips", type=clip_range, default=(4, 14), metavar="LO,HI",
                   help="held clips per stream example, inclusive range (the monitor and held-out splits too)")
    g.add_argument("--stream-hard", type=float, default=0.0,
                   help="share of stream examples drawn in the hard case: a mark of the other kind came after the "
                        "answer (StreamExample.other_kind_newer), as when the stream is asked about minutes ago "
                        "seconds after another event")
    g.add_argument("--stream-monitor", type=int, default=64, help="stream examples of the monitor split")
    g.add_argument("--stream-heldout", type=int, default=256, help="stream examples of the held-out split")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=0, help="optimizer steps (0: until --minutes)")
    g.add_argument("--minutes", type=float, default=30.0, help="wall-time budget of the training loop")
    g.add_argument("--batch", type=int, default=16)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.05, help="cosine decays to lr * this")
    g.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="after warm-up; cosine runs over --steps, or over --minutes when --steps is 0")
    g.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="seed of initialisation and training data")
    g.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--init", default=None, help="starting checkpoint (default: the untrained base model)")
    g.add_argument("--family", default="qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl"),
                   help="architecture of the untrained base model (default: %(default)s)")
    g.add_argument("--init-text", default=None,
                   help="copy the text model (embeddings, decoder, head) from this checkpoint of the same text "
                        "geometry and tokenizer, e.g. the shipped Qwen2-VL model when training a Qwen2.5-VL one")
    g.add_argument("--fps", type=float, default=2.0,
                   help="the videos' frame rate: Qwen2.5-VL's temporal positions follow it (default: %(default)s)")
    g.add_argument("--output", default=None, help="output directory (default: .cache/vqa-runs/<time>)")
    g.add_argument("--eval-every", type=int, default=50, help="monitor evaluation period in steps")
    g.add_argument("--monitor-per-family", type=int, default=32)
    g.add_argument("--heldout-per-family", type=int, default=256)
    g.add_argument("--heldout-frames", default=None,
                   help="comma-separated extra frame counts for the held-out evaluation (e.g. 128)")
    g.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    g.add_argument("--vllm-per-family", type=int, default=64,
                   help="held-out examples per family answered through vLLM at the end (0: skip)")
    g.add_argument("--test-per-family", type=int, default=12,
                   help="examples per family of the 'test' split recorded for the CI test (0: skip)")
    g.add_argument("--eval-only", default=None, metavar="CKPT",
                   help="skip training; re-measure CKPT (reads its training.json config) and update it")
    return p.parse_args(argv)


def csv_ints(text: str | None, default: int) -> list[int]:
    return [int(x) for x in text.split(",")] if text else [default]


def make_families(args: argparse.Namespace) -> list[Family]:
    out: list[Family] = []
    for name in args.families.split(","):
        if name == "count":
            out.append(CountFamily(max_count=args.count_max, max_decoys=args.count_decoys))
        else:
            out.append(get_family(name))
    return out


@dataclasses.dataclass(frozen=True)
class Stage:
    """A training phase: the families its batches cycle through (a family listed twice gets twice the
    examples), the frame counts they use, and for how many steps (``None``: until the end of training)."""

    families: tuple[Family, ...]
    frames: tuple[int, ...]
    steps: int | None

    def describe(self) -> dict[str, Any]:
        return {"families": [f.name for f in self.families], "frames": list(self.frames), "steps": self.steps}


def make_stages(args: argparse.Namespace, families: Sequence[Family]) -> list[Stage]:
    """``--curriculum`` stages followed by the main phase."""
    by_name = {f.name: f for f in families}
    stages = []
    for item in args.curriculum:
        try:
            names, rest = item.split("@")
            frames, steps = rest.split(":")
            stage = Stage(tuple(by_name[n] for n in names.split(",")), tuple(csv_ints(frames, 0)), int(steps))
        except (ValueError, KeyError) as exc:
            raise SystemExit(f"bad --curriculum stage {item!r} (FAMILIES@FRAMES:STEPS over --families): "
                             f"{exc}") from exc
        stages.append(stage)
    weights = {f.name: 1 for f in families}
    for item in (args.family_weights.split(",") if args.family_weights else []):
        name, weight = item.split("=")
        if name not in weights or int(weight) < 0:
            raise SystemExit(f"bad --family-weights entry {item!r}")
        weights[name] = int(weight)
    cycle = tuple(f for f in families for _ in range(weights[f.name]))
    stages.append(Stage(cycle, tuple(csv_ints(args.train_frames, args.frames)), None))
    return stages


class BatchProducer:
    """Renders training batches in a background thread (numpy releases the GIL while drawing).

    Batches follow ``stages``; within a stage, each batch cycles over the stage's families and takes each
    family's next example of the training stream (seed ``seed``), and its frame count is drawn from the
    stage's choices by a seeded generator, so the data order is a pure function of the seed.
    """

    def __init__(self, stages: Sequence[Stage], encoder: HFEncoder, *, batch: int, seed: int,
                 size: int, inputs: Sequence[str] = ("video",), depth: int = 3) -> None:
        self.stages, self.encoder, self.batch, self.seed = list(stages), encoder, batch, seed
        self.size, self.inputs = size, tuple(inputs)
        self.queue: queue.Queue[tuple[int, str, Any]] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        rng = np.random.default_rng([self.seed, 99])
        shapes = np.random.default_rng([self.seed, 98])  # its own stream: the video data order stays the same
        counters: dict[str, int] = {}
        k = stage_start = stage_index = 0
        while not self.stop.is_set():
            stage = self.stages[stage_index]
            if stage.steps is not None and k - stage_start >= stage.steps:
                stage_index, stage_start = stage_index + 1, k
                continue
            frames = stage.frames[int(rng.integers(0, len(stage.frames)))]
            geometry = VideoGeometry(frames, self.size)
            examples = []
            for j in range(self.batch):
                fam = stage.families[((k - stage_start) * self.batch + j) % len(stage.families)]
                index = counters.get(fam.name, 0)
                examples.append(make_example(fam, index, seed=self.seed, geometry=geometry))
                counters[fam.name] = index + 1
            inputs = self.inputs[int(shapes.integers(0, len(self.inputs)))]
            item = (frames, inputs, self.encoder.encode(examples, inputs))
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.5)
                    break
                except queue.Full:
                    continue
            k += 1

    def get(self) -> tuple[int, str, Any]:
        return self.queue.get()

    def close(self) -> None:
        self.stop.set()


def lr_at(args: argparse.Namespace, step: int, elapsed: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based) after ``elapsed`` seconds of training."""
    warm = min(1.0, (step + 1) / max(1, args.warmup))
    if args.schedule == "constant":
        return args.lr * warm
    progress = step / args.steps if args.steps else elapsed / (60 * args.minutes)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def evaluate(model: Any, encoder: HFEncoder, examples: Sequence[VQAExample], inputs: str = "video"
             ) -> dict[str, Any]:
    """HF accuracy report of ``model`` on ``examples`` sent as ``inputs`` (switched to eval mode and back)."""
    was_training = model.training
    model.eval()
    preds = predict(model, encoder, examples, batch_size=32, inputs=inputs)
    model.train(was_training)
    return accuracy_report(examples, preds)


def evaluate_shapes(model: Any, encoder: HFEncoder, examples: Sequence[VQAExample], shapes: Sequence[str]
                    ) -> tuple[float, dict[str, float]]:
    """Monitor score (mean macro accuracy over ``shapes``) and per-family accuracies (``family`` for video,
    ``family/images`` for frames sent as images)."""
    scores, accs = [], {}
    for inputs in shapes:
        report = evaluate(model, encoder, examples, inputs)
        scores.append(report["macro"])
        suffix = "" if inputs == "video" else f"/{inputs}"
        accs.update({f"{f}{suffix}": v["accuracy"] for f, v in report["families"].items()})
    return sum(scores) / len(scores), accs


def monitor_score(model: Any, encoder: HFEncoder, examples: Sequence[VQAExample], shapes: Sequence[str],
                  streams: StreamEncoder | None, stream_examples: Sequence[StreamExample]
                  ) -> tuple[float, dict[str, float]]:
    """:func:`evaluate_shapes`, with the stream examples' accuracy (``stream``) weighing as much as the one-shot
    score when there are any."""
    score, accs = evaluate_shapes(model, encoder, examples, shapes)
    if streams is not None and stream_examples:
        accs["stream"] = evaluate_stream(model, streams, stream_examples)
        score = (score + accs["stream"]) / 2
    return score, accs


def stream_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The stream examples' options of the training data and the monitor split (the held-out split draws the
    default mix, ``hard=0``, over the same clip range)."""
    return {"clips": args.stream_clips, "hard": args.stream_hard}


def evaluate_stream(model: Any, encoder: StreamEncoder, examples: Sequence[StreamExample]) -> float:
    """HF accuracy of ``model`` on stream examples (eval mode, then back)."""
    return float(np.mean(stream_correct(model, encoder, examples))) if examples else 0.0


def stream_correct(model: Any, encoder: StreamEncoder, examples: Sequence[StreamExample]) -> list[bool]:
    """Per example, whether ``model``'s greedy answer is right (eval mode, then back)."""
    was_training = model.training
    model.eval()
    right: list[bool] = []
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            batch = encoder.encode(model, examples[i:i + 16])
            right += (stream_logits(model, batch).argmax(-1) == batch.answer_ids).tolist()
    model.train(was_training)
    return right


def stream_report(model: Any, encoder: StreamEncoder, examples: Sequence[StreamExample]) -> dict[str, Any]:
    """Held-out stream accuracy, overall and split by :attr:`StreamExample.other_kind_newer` (the hard case)."""
    right = stream_correct(model, encoder, examples)
    report: dict[str, Any] = {"examples": len(examples), "accuracy": float(np.mean(right))}
    for name, hard in (("latest_mark_asked", False), ("other_kind_newer", True)):
        sub = [r for r, e in zip(right, examples, strict=True) if e.other_kind_newer == hard]
        report[name] = {"examples": len(sub), "accuracy": float(np.mean(sub)) if sub else None}
    return report


def data_description(families: Sequence[Family], geometry: VideoGeometry, args: argparse.Namespace
                     ) -> dict[str, Any]:
    """Git-independent description of the task data (enough to regenerate it with :mod:`cords_vllm.lab.vqa`)."""
    fams = {}
    for f in families:
        entry: dict[str, Any] = {"question": f.question, "answers": list(f.answers()),
                                 "class": type(f).__name__}
        if dataclasses.is_dataclass(f):
            entry["params"] = dataclasses.asdict(f)
        fams[f.name] = entry
    return {
        "generator": "cords_vllm.lab.vqa.tasks.make_example(family, index, seed=seed, geometry=geometry)",
        "video": {"frames": geometry.num_frames, "size": geometry.size,
                  "video_tokens": geometry.num_video_tokens,
                  "train_frames": csv_ints(args.train_frames, args.frames),
                  "background": "near-gray gradient with tint, 2 slowly moving gray discs/boxes, pixel noise",
                  "marks": "square: saturated, side 26-40 px, one temporal patch; flash: whole frame 75% "
                           "colour, one temporal patch; dot: disc of 12-16 px for the whole video"},
        "families": fams,
        "splits": {"train": f"seed={args.seed}, indices 0.. per family, families cycled within each batch",
                   **{k: f"seed={v}" for k, v in SPLIT_SEEDS.items()}},
    }


def copy_text_model(model: Any, source: Path) -> None:
    """Load the text model's weights (embeddings, decoder layers, final norm, LM head) of ``source`` into
    ``model``; every copied tensor must exist with the same shape (the tokenizers must agree too)."""
    from transformers import AutoModelForImageTextToText

    src = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32).state_dict()
    own = model.state_dict()
    text = {k: v for k, v in src.items() if k.startswith(("model.language_model.", "lm_head."))}
    missing = [k for k in text if k not in own or own[k].shape != text[k].shape]
    if missing or not text:
        raise SystemExit(f"--init-text {source}: text weights do not match this model ({missing[:3]} ...)")
    model.load_state_dict(text, strict=False)
    print(f"text model ({len(text)} tensors) copied from {source}", flush=True)


def fingerprint(examples: Sequence[VQAExample]) -> str:
    """sha256 of the frames and answers of ``examples`` (detects a changed generator)."""
    h = hashlib.sha256()
    for e in examples:
        h.update(e.answer.encode())
        h.update(np.ascontiguousarray(e.frames).tobytes())
    return h.hexdigest()


def heldout_eval_hf(ckpt: Path, families: Sequence[Family], args: argparse.Namespace,
                    frame_counts: Sequence[int]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """HF (fp32 compute) held-out reports and predictions of the saved checkpoint, per frame count."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    encoder = HFEncoder(processor.tokenizer, video_t_factor(model.config, args.fps))
    out, predictions = {}, {}
    cells = [(frames, "video") for frames in frame_counts]
    if "images" in input_shapes(args):
        cells.append((args.frames, "images"))
    with fast_vision_attention():
        for frames, inputs in cells:
            geometry = VideoGeometry(frames, args.size)
            exs = make_split(families, args.heldout_per_family, "heldout", geometry=geometry)
            t0 = time.time()
            key = f"T{frames}" + ("" if inputs == "video" else f"-{inputs}")
            predictions[key] = predict(model, encoder, exs, batch_size=32, inputs=inputs)
            out[key] = accuracy_report(exs, predictions[key])
            print(f"HF held-out {key} ({time.time() - t0:.0f} s):\n{format_report(out[key])}", flush=True)
    return out, predictions


def input_shapes(args: argparse.Namespace) -> list[str]:
    """The distinct input shapes of ``--inputs``, in order; unknown names are refused."""
    from cords_vllm.lab.vqa.prompt import INPUT_SHAPES

    shapes = [x for x in (args.inputs or "video").split(",") if x]
    if not shapes or set(shapes) - set(INPUT_SHAPES):
        raise SystemExit(f"--inputs takes a comma-separated list of {INPUT_SHAPES}, got {args.inputs!r}")
    return list(dict.fromkeys(shapes))


def vllm_fps(args: argparse.Namespace) -> float | None:
    """The frame rate videos are sent to vLLM with (``None``: bare frames, as the Qwen2-VL model was trained)."""
    return None if args.family == "qwen2_vl" else args.fps


def vllm_eval(ckpt: Path, families: Sequence[Family], args: argparse.Namespace) -> dict[str, Any]:
    """Held-out accuracy through the in-process vLLM engine (fp32), plus the CI test split's predictions."""
    from vllm import LLM

    from cords_vllm.lab.vqa.serving import engine_kwargs, predict_vllm

    geometry = VideoGeometry(args.frames, args.size)
    llm = LLM(**engine_kwargs(ckpt, geometry))
    result: dict[str, Any] = {"dtype": "float32"}
    if args.vllm_per_family:
        exs = make_split(families, args.vllm_per_family, "heldout", geometry=geometry)
        t0 = time.time()
        result["heldout_predictions"] = predict_vllm(llm, exs, fps=vllm_fps(args))
        result["heldout"] = accuracy_report(exs, result["heldout_predictions"])
        result["heldout_seconds"] = round(time.time() - t0, 1)
        print(f"vLLM held-out ({args.vllm_per_family}/family):\n{format_report(result['heldout'])}",
              flush=True)
    if args.test_per_family:
        exs = make_split(families, args.test_per_family, "test", geometry=geometry)
        preds = predict_vllm(llm, exs, fps=vllm_fps(args))
        report = accuracy_report(exs, preds)
        result["test_split"] = {"per_family": args.test_per_family, "fingerprint": fingerprint(exs),
                                "predictions": preds, "report": report}
        print(f"vLLM test split ({args.test_per_family}/family):\n{format_report(report)}", flush=True)
    del llm
    return result


def save_checkpoint(model: Any, processor: Any, out: Path, dtype: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    to_save = copy.deepcopy(model).to(getattr(torch, dtype))
    to_save.config.dtype = dtype
    to_save.config.text_config.dtype = dtype
    to_save.config.vision_config.dtype = dtype
    to_save.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    for stray in ("cords_tiny_spec.json",):
        (out / stray).unlink(missing_ok=True)


def measure(ckpt: Path, families: Sequence[Family], args: argparse.Namespace, record: dict[str, Any]) -> None:
    """Fill ``record["results"]`` with HF and vLLM held-out accuracy of the saved checkpoint."""
    frame_counts = [args.frames] + [f for f in csv_ints(args.heldout_frames, 0) if f and f != args.frames]
    results = record.setdefault("results", {})
    results["hf_heldout"], hf_predictions = heldout_eval_hf(ckpt, families, args, frame_counts)
    results["hf_heldout_per_family"] = args.heldout_per_family
    if args.vllm_per_family or args.test_per_family:
        results["vllm"] = vllm_eval(ckpt, families, args)
        vllm_predictions = results["vllm"].pop("heldout_predictions", None)
        if vllm_predictions and args.vllm_per_family <= args.heldout_per_family:
            # splits are index-major, so the vLLM split is a prefix of the HF one
            hf = hf_predictions[f"T{args.frames}"][:len(vllm_predictions)]
            same = sum(a == b for a, b in zip(hf, vllm_predictions, strict=True))
            results["vllm"]["agreement_with_hf"] = same / len(vllm_predictions)
    summary = {"hf": {k: {"overall": r["overall"], **{f: v["accuracy"] for f, v in r["families"].items()}}
                      for k, r in results["hf_heldout"].items()}}
    if "heldout" in results.get("vllm", {}):
        r = results["vllm"]["heldout"]
        summary["vllm"] = {f"T{args.frames}": {"overall": r["overall"],
                                               **{f: v["accuracy"] for f, v in r["families"].items()}}}
    results["summary"] = summary
    (ckpt / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)


def train(args: argparse.Namespace) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    families = make_families(args)
    out = Path(args.output or Path(".cache/vqa-runs") / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    init = Path(args.init) if args.init else build_base_model(seed=args.seed, family=args.family)
    processor = AutoProcessor.from_pretrained(init)
    model = AutoModelForImageTextToText.from_pretrained(init, dtype=torch.float32)
    if args.init_text:
        copy_text_model(model, Path(args.init_text))
    model.train()
    encoder = HFEncoder(processor.tokenizer, video_t_factor(model.config, args.fps))
    for word in answer_vocabulary(families):
        encoder.answer_id(word)  # fails early if an answer is not one token
    geometry = VideoGeometry(args.frames, args.size)
    monitor = make_split(families, args.monitor_per_family, "monitor", geometry=geometry)
    stages = make_stages(args, families)
    shapes = input_shapes(args)
    streams = StreamEncoder(processor.tokenizer) if args.stream_batch else None
    stream_monitor = (stream_split(args.stream_monitor, "monitor", size=args.stream_size, **stream_kwargs(args))
                      if streams else [])
    producer = BatchProducer(stages, encoder, batch=args.batch, seed=args.seed, size=args.size,
                             inputs=[x for x in args.inputs.split(",") if x])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f} M parameters; families {[f.name for f in families]}; "
          f"{geometry.num_video_tokens} video tokens; output {out}", flush=True)

    log = (out / "log.jsonl").open("w")
    best: dict[str, Any] = {"score": -1.0}
    best_state: dict[str, torch.Tensor] | None = None
    ema_loss: float | None = None
    ema_acc: float | None = None
    history: list[dict[str, Any]] = []
    total = args.steps or None
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, mininterval=2.0)
    t_start = time.time()
    step = 0
    with fast_vision_attention():
        while True:
            elapsed = time.time() - t_start
            if (args.steps and step >= args.steps) or (not args.steps and elapsed > 60 * args.minutes):
                break
            frames, inputs, batch = producer.get()
            lr = lr_at(args, step, elapsed)
            for group in opt.param_groups:
                group["lr"] = lr
            logits = answer_logits(model, batch).float()                 # [B, vocab]
            loss = F.cross_entropy(logits, batch.answer_ids)
            if streams is not None:
                examples = [make_stream_example(step * args.stream_batch + j, size=args.stream_size,
                                                seed=STREAM_SPLIT_SEEDS["train"] + args.seed, **stream_kwargs(args))
                            for j in range(args.stream_batch)]
                stream_batch = streams.encode(model, examples)
                loss = loss + F.cross_entropy(stream_logits(model, stream_batch).float(), stream_batch.answer_ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
            opt.step()
            step += 1
            acc = float((logits.argmax(-1) == batch.answer_ids).float().mean())
            loss_value = float(loss.detach())
            ema_loss = loss_value if ema_loss is None else 0.95 * ema_loss + 0.05 * loss_value
            ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
            rec: dict[str, Any] = {"step": step, "t": round(time.time() - t_start, 1), "frames": frames,
                                   "inputs": inputs,
                                   "loss": round(loss_value, 4), "acc": acc, "lr": lr,
                                   "grad_norm": round(grad_norm, 3)}
            if step % args.eval_every == 0:
                score, accs = monitor_score(model, encoder, monitor, shapes, streams, stream_monitor)
                rec["monitor"] = accs
                history.append({"step": step, "t": rec["t"], "monitor": accs})
                if score >= best["score"]:
                    best = {"score": score, "step": step, "t": rec["t"], "monitor": accs}
                    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                tqdm.write(f"step {step} t={rec['t']:.0f}s loss~{ema_loss:.3f} monitor "
                           + " ".join(f"{f}={a:.2f}" for f, a in accs.items())
                           + f" (best {best['score']:.3f} @ {best['step']})")
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{ema_loss:.3f}", acc=f"{ema_acc:.2f}", lr=f"{lr:.1e}",
                            best=f"{best['score']:.2f}")
    bar.close()
    producer.close()
    train_seconds = time.time() - t_start
    # Final monitor evaluation of the last weights (they may beat the last periodic check).
    score, accs = monitor_score(model, encoder, monitor, shapes, streams, stream_monitor)
    if score >= best["score"]:
        best = {"score": score, "step": step, "t": round(train_seconds, 1), "monitor": accs}
        best_state = None
    if best_state is not None:
        model.load_state_dict(best_state)
    print(f"training: {step} steps in {train_seconds / 60:.1f} min; best monitor {best}", flush=True)

    ckpt = out / "checkpoint"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    save_checkpoint(model, processor, ckpt, args.save_dtype)
    full = out / "checkpoint-fp32"  # the unrounded weights, to continue training from (not shipped)
    if args.save_dtype != "float32":
        save_checkpoint(model, processor, full, "float32")
    record: dict[str, Any] = {
        "model": {"architecture": type(model).__name__, "parameters": n_params,
                  "base_spec": dataclasses.asdict(base_model_spec(seed=args.seed, family=args.family)),
                  "text_model_from": args.init_text, "fps": args.fps,
                  "weights_dtype": args.save_dtype,
                  "init": "untrained base model (cords_vllm.lab.vqa.build_base_model)" if args.init is None
                  else "continued from an earlier run (training.continued_from)"},
        "prompt": {"template": PROMPT_TEMPLATE,
                   "note": "raw prompt with one <|video_pad|> (frames sent as images: one "
                           "<|vision_start|><|image_pad|><|vision_end|> per frame); the shipped chat template "
                           "renders exactly this for one user message [video or image parts, text part] "
                           "(default system prompt added)",
                   "answer": "one token, greedy; the answer word is the whole completion"},
        "config": {k: v for k, v in vars(args).items() if k not in ("output", "init", "eval_only", "argv")},
        "data": data_description(families, geometry, args),
        "training": {"steps": step, "seconds": round(train_seconds, 1), "best": best, "history": history,
                     "stages": [st.describe() for st in stages],
                     "argv": [Path(a).name if os.path.isabs(a) else a for a in args.argv],
                     "objective": "cross-entropy of the answer token at the last prompt token "
                                  "(teacher forcing)",
                     "optimizer": f"AdamW(betas=(0.9, 0.98), weight_decay={args.weight_decay}), warm-up "
                                  f"{args.warmup} steps, {args.schedule} to {args.min_lr_ratio} x lr",
                     "environment": {"torch": torch.__version__, "python": platform.python_version(),
                                     "threads": torch.get_num_threads()}},
    }
    if args.init and (Path(args.init) / TRAINING_RECORD).is_file():
        # continued training: keep the earlier run's record (its config, stages and history)
        earlier = json.loads((Path(args.init) / TRAINING_RECORD).read_text())
        record["training"]["continued_from"] = {k: earlier.get(k) for k in ("config", "training")}
    if streams is not None:
        record["data"]["stream"] = {
            "generator": "cords_vllm.lab.vqa.stream_task.make_stream_example(index, seed=seed, size=size, "
                         "hard=hard, clips=clips)",
            "size": args.stream_size, **stream_kwargs(args),
            "train_seed": STREAM_SPLIT_SEEDS["train"] + args.seed,
            "splits": {k: f"seed={v}" for k, v in STREAM_SPLIT_SEEDS.items() if k != "train"},
            "questions": "the latest square or dot of 1-5 marks in the held clips (clips) of 8 frames"}
        heldout = stream_split(args.stream_heldout, "heldout", size=args.stream_size, clips=args.stream_clips)
        record.setdefault("results", {})["hf_stream_heldout"] = stream_report(model, streams, heldout)
        print(f"stream held-out accuracy (HF): {record['results']['hf_stream_heldout']}", flush=True)
    (ckpt / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    measure(ckpt, families, args, record)
    if full.is_dir():
        shutil.copy(ckpt / TRAINING_RECORD, full / TRAINING_RECORD)
    print(f"checkpoint: {ckpt}", flush=True)


def eval_only(args: argparse.Namespace) -> None:
    ckpt = Path(args.eval_only)
    record = json.loads((ckpt / TRAINING_RECORD).read_text())
    for key in ("families", "frames", "size", "count_max", "count_decoys", "seed", "train_frames", "inputs"):
        if key in record.get("config", {}):
            setattr(args, key, record["config"][key])
    record.setdefault("config", {}).update({k: getattr(args, k) for k in (
        "heldout_per_family", "heldout_frames", "vllm_per_family", "test_per_family")})
    families = make_families(args)
    record["data"] = data_description(families, VideoGeometry(args.frames, args.size), args)
    measure(ckpt, families, args, record)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.eval_only:
        eval_only(args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
