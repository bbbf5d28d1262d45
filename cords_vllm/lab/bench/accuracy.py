"""Accuracy of KV policies on the trained video-QA model, through the real vLLM engine.

For each policy and budget, held-out questions (:mod:`cords_vllm.lab.vqa`) are answered by an in-process engine
that prefills in small chunks, so the video is compressed repeatedly while it streams in, exactly as in
serving. The measured effective budget (video tokens the request actually holds when the question is read)
is reported next to the nominal one: kept tokens are rounded up to whole KV blocks and the last chunk's
tokens are recent by construction.

Sanity controls, printed with the results: the needle frames blanked (accuracy must fall to chance), and an
oracle that keeps exactly the needle's tokens (must match the full cache). The oracle needs per-request
knowledge no ``--kv-policy`` selector has, so it runs in the HF reference
(:mod:`cords_vllm.lab.reference.hf`), which the tests prove equal to the engine for the same evictions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cords_vllm.config import kv_policy_args
from cords_vllm.lab.bench import pruning
from cords_vllm.lab.bench.workload import PolicySpec
from cords_vllm.lab.vqa import VQAExample, accuracy_report


@dataclass
class AccuracyRun:
    """One (policy, budget) cell: the accuracy report and the budget the requests really held.

    ``label`` names the variant (``cords:granularity=token``); ``policy`` is its registry name; ``inputs``
    how the requests carried the video (``video``, or ``images``: every frame as its own image);
    ``predictions`` the answer words in question order (for paired comparisons of cells).
    """

    label: str
    policy: str
    config: dict[str, Any]
    fraction: float | None
    budget: int | None
    report: dict[str, Any]
    effective_video_tokens: float
    seconds: float
    inputs: str = "video"
    predictions: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EngineShape:
    """How requests stream through the engine: KV block size, prefill chunk per request, batch."""

    block_size: int = 32
    chunk: int = 64
    batch: int = 16
    dtype: str = "float32"
    #: Frame rate the videos are sent with (their metadata; Qwen2.5-VL needs it); ``None``: bare frames.
    fps: float | None = None


def engine_args(checkpoint: str | Path, examples: Sequence[VQAExample], shape: EngineShape,
                inputs: str = "video") -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for ``examples`` sent as ``inputs`` (``video`` or ``images``)."""
    from cords_vllm.lab.vqa.serving import engine_kwargs

    geometry = examples[0].geometry
    kw = engine_kwargs(checkpoint, geometry, dtype=shape.dtype, inputs=inputs)
    kw.update(block_size=shape.block_size, max_num_seqs=shape.batch,
              max_num_batched_tokens=shape.batch * kw["max_model_len"],
              max_num_scheduled_tokens=shape.batch * shape.chunk, long_prefill_token_threshold=shape.chunk)
    return kw


def cell_llm(kwargs: dict[str, Any], spec: PolicySpec | str, budget: int | None, video_tokens: int = 0) -> Any:
    """The in-process ``LLM`` of one accuracy cell: ``kwargs`` (:func:`engine_args`) plus ``spec`` at ``budget``
    with slack 0, so compression runs whenever the held video tokens exceed the budget; video pruning
    (:mod:`~cords_vllm.lab.bench.pruning`) at the rate the cell asks for, for requests of ``video_tokens``."""
    from cords_vllm.integration.inprocess.llm import make_llm

    kwargs = dict(kwargs)
    model = kwargs.pop("model")
    if isinstance(spec, str):
        spec = pruning.parse(spec, {})
    config, engine = pruning.split(spec, budget, video_tokens)
    kwargs.update(engine)
    if spec.policy != "none":
        kwargs.update(kv_policy_args(spec.policy, **{**config, "budget": budget, "slack": 0}))
    return make_llm(model, **kwargs)


def run_policy(checkpoint: str | Path, examples: Sequence[VQAExample], spec: PolicySpec | str, budget: int | None,
               shape: EngineShape, inputs: str = "video") -> tuple[list[str], float]:
    """Greedy one-token answers under ``spec`` and the mean candidate (video or image) tokens held when
    answering, with the video sent as ``inputs`` (``video``, or ``images``: one image per frame).

    ``budget`` overrides the spec's; compression runs whenever the held candidate tokens exceed it (slack 0),
    so every policy holds the same number of tokens at the answer.
    """
    from vllm import SamplingParams

    outputs, held = run_cell(checkpoint, examples, spec, budget, shape, SamplingParams(temperature=0.0, max_tokens=1),
                             inputs)
    return [o.outputs[0].text for o in outputs], held


def run_cell(checkpoint: str | Path, examples: Sequence[VQAExample], spec: PolicySpec | str, budget: int | None,
             shape: EngineShape, params: Any, inputs: str = "video",
             engine_overrides: dict[str, Any] | None = None,
             on_llm: Callable[[Any], None] | None = None) -> tuple[list[Any], float]:
    """vLLM's ``RequestOutput`` of every example under ``spec`` at ``budget`` with sampling ``params``, and the
    mean candidate tokens held when answering (:func:`run_policy`; ``engine_overrides``: more ``LLM``
    arguments, e.g. ``max_logprobs``; ``on_llm``: called with the engine after the requests, before it goes,
    e.g. to read what it recorded)."""
    from cords_vllm.integration.inprocess.heap import settle
    from cords_vllm.integration.inprocess.introspect import answering_requests, observe_steps, requests_of
    from cords_vllm.lab.vqa.serving import candidate_tokens

    llm = cell_llm({**engine_args(checkpoint, examples, shape, inputs), **(engine_overrides or {})}, spec, budget,
                   candidate_tokens(examples[0].geometry, inputs))
    held_at_answer: list[int] = []

    def observe(scheduler, out) -> None:
        answering = answering_requests(scheduler, out)
        if answering:
            held = requests_of(scheduler)
            held_at_answer.extend(held[r].held_candidate_tokens for r in answering)

    observe_steps(llm, observe)
    outputs = llm.generate([e.vllm_request(inputs, fps=shape.fps) for e in examples], params, use_tqdm=False)
    if on_llm is not None:
        on_llm(llm)
    del llm
    settle()
    return outputs, float(np.mean(held_at_answer)) if held_at_answer else float("nan")


def blank_needles(example: VQAExample) -> VQAExample:
    """The example with every needle frame replaced by the nearest earlier (else later) clean frame."""
    frames = np.array(example.frames)
    needle = set(example.needle_frames)
    clean = [f for f in range(len(frames)) if f not in needle]
    if not clean:
        raise ValueError(f"{example.family} example {example.index}: every frame shows the needle")
    for f in needle:
        earlier = [c for c in clean if c < f]
        frames[f] = frames[earlier[-1] if earlier else min(c for c in clean if c > f)]
    frames.setflags(write=False)
    return dataclasses.replace(example, frames=frames)


def oracle_predictions(checkpoint: str | Path, examples: Sequence[VQAExample]) -> list[str]:
    """HF reference answers when, after the video, the cache keeps exactly the needle's video tokens."""
    from cords_vllm.lab.reference.hf import HFQwen2VLReference

    ref = HFQwen2VLReference(str(checkpoint))
    tok = ref.processor.tokenizer
    video_id = ref.config.video_token_id
    num_layers = ref.config.text_config.num_hidden_layers
    answers = []
    for ex in examples:
        ids, _, _, _ = ref.encode(ex.prompt, np.array(ex.frames))
        video = torch.nonzero(ids == video_id).flatten()
        start, end = int(video[0]), int(video[-1]) + 1
        needles = torch.tensor(ex.needle_token_indices(), dtype=torch.long) + start
        keep = torch.cat([torch.arange(start), needles])
        result = ref.run(ex.prompt, np.array(ex.frames), max_new_tokens=1, chunk_sizes=[end, len(ids) - end],
                         evictions={end: [keep] * num_layers})
        answers.append(tok.decode([result.token_ids[0]]))
    return answers


def coverage_on_model(checkpoint: str | Path, examples: Sequence[VQAExample], fraction: float,
                      policies: Sequence[str] = ("cords", "infinipot_v", "uniform"), layer: int = 0
                      ) -> dict[str, Any]:
    """Coverage CDFs (joint, K-only, V-only) of each policy on the model's real video keys/values."""
    from cords_vllm.lab.fidelity.coverage import coverage_curves
    from cords_vllm.lab.reference.hf import HFQwen2VLReference
    from cords_vllm.selection import get_selector

    ref = HFQwen2VLReference(str(checkpoint))
    per_frame = examples[0].geometry.tokens_per_patch
    keys, values = [], []
    for ex in examples:
        ids, emb, pos, _ = ref.encode(ex.prompt, np.array(ex.frames))
        video = torch.nonzero(ids == ref.config.video_token_id).flatten()
        from transformers import DynamicCache

        cache = DynamicCache(config=ref.config.text_config)
        with torch.no_grad():
            ref.model.model.language_model(inputs_embeds=emb, position_ids=pos[:, None], past_key_values=cache,
                                           use_cache=True)
        entry = cache.layers[layer]
        keys.append(entry.keys[0][:, video])
        values.append(entry.values[0][:, video])
    k, v = torch.stack(keys), torch.stack(values)  # [B, H, N, D]
    budget = int(fraction * k.shape[2])
    curves = {}
    for name in policies:
        keep = get_selector(name).select(k, v, budget, group_size=per_frame).keep
        curves[name] = coverage_curves(k, v, keep)
    return curves


def plot_accuracy(runs: Sequence[AccuracyRun], out: Path, split: str = "heldout") -> list[Path]:
    """Accuracy vs budget per policy, and per-family grouped bars at each budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    full = next((r for r in runs if r.policy == "none" and r.fraction is None), None)
    policies = list(dict.fromkeys(r.label for r in runs if r.fraction is not None))
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors  # 20 distinct colours; the marker changes too past ten lines
    for i, policy in enumerate(policies):
        cells = sorted((r for r in runs if r.label == policy and r.fraction is not None), key=lambda r: r.fraction)
        ax.plot([r.fraction for r in cells], [100 * r.report["overall"] for r in cells], marker="os^"[i // 10 % 3],
                color=colours[(2 * i + i // 10) % 20], linewidth=2.5 if policy == "cords" else 1.5, label=policy)
    if full:
        ax.axhline(100 * full.report["overall"], color="black", linestyle="--", label="full KV")
    ax.set_xscale("log", base=2)
    ticks = sorted({r.fraction for r in runs if r.fraction is not None})
    ax.set_xticks(ticks, [f"1/{round(1 / f)}" for f in ticks])
    ax.minorticks_off()
    ax.set_xlabel("budget (fraction of the video's tokens)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{'Held-out' if split == 'heldout' else split.capitalize() + '-split'} accuracy vs KV budget")
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out / "accuracy_vs_budget.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fractions = sorted({r.fraction for r in runs if r.fraction is not None}, reverse=True)
    families = list(runs[0].report["families"])
    fig, axes = plt.subplots(1, len(fractions), figsize=(4.5 * len(fractions), 4.5), sharey=True, squeeze=False)
    width = 0.8 / max(len(policies), 1)
    for ax, fraction in zip(axes[0], fractions, strict=True):
        for i, policy in enumerate(policies):
            cell = next((r for r in runs if r.label == policy and r.fraction == fraction), None)
            if cell is None:
                continue
            accs = [100 * (cell.report["families"][f]["accuracy"] or 0) for f in families]
            ax.bar(np.arange(len(families)) + i * width, accs, width, label=policy)
        ax.set_xticks(np.arange(len(families)) + width * (len(policies) - 1) / 2, families)
        ax.set_title(f"budget 1/{round(1 / fraction)}")
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # outside the bars
    fig.tight_layout()
    paths.append(out / "accuracy_by_family.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def plot_inputs_comparison(rows: Sequence[dict[str, Any]], path: Path, title: str | None = None) -> Path:
    """Paired bars per policy, one panel per budget: each input shape's accuracy on the same questions, the
    exact McNemar p-value of their difference above each pair.

    ``rows``: the comparison rows of the accuracy benchmark (``label``, ``fraction``, ``accuracy`` by shape,
    ``mcnemar``); full KV (``fraction`` ``None``) is drawn as a dashed line per shape in every panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs = list(rows[0]["accuracy"])
    full = next((r for r in rows if r["fraction"] is None), None)
    by_cell = {(r["label"], r["fraction"]): r for r in rows if r["fraction"] is not None}
    fractions = sorted({fraction for _, fraction in by_cell}, reverse=True)
    labels = list(dict.fromkeys(label for label, _ in by_cell))
    fig, axes = plt.subplots(1, len(fractions), figsize=(1.6 * len(labels) * len(fractions) + 1.5, 4.5),
                             sharey=True, squeeze=False)
    width = 0.8 / len(inputs)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, fraction in zip(axes[0], fractions, strict=True):
        cells = [by_cell[(label, fraction)] for label in labels]
        for i, shape in enumerate(inputs):
            ax.bar(np.arange(len(labels)) + i * width, [100 * c["accuracy"][shape] for c in cells], width,
                   label=shape, color=colours[i])
            if full is not None:
                ax.axhline(100 * full["accuracy"][shape], color=colours[i], linestyle="--", linewidth=1)
        for j, cell in enumerate(cells):
            top = 100 * max(cell["accuracy"].values())
            p_value = cell["mcnemar"]["p_value"]
            ax.text(j + width * (len(inputs) - 1) / 2, top + 1.5, "p<0.01" if p_value < 0.01 else f"p={p_value:.2f}",
                    ha="center", fontsize=8)
        ax.set_xticks(np.arange(len(labels)) + width * (len(inputs) - 1) / 2, labels)
        ax.set_ylim(0, 110)
        ax.set_title(f"budget 1/{round(1 / fraction)}")
    axes[0][0].set_ylabel("accuracy (%)  (dashed: full KV)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def budget_cells(policies: Sequence[PolicySpec | str], fractions: Sequence[float], video_tokens: int,
                 block_size: int) -> list[tuple[PolicySpec, float | None, int | None]]:
    """``(policy, fraction, budget)`` of every cell: full KV once, then each policy at each fraction of the
    video's tokens (at least one block)."""
    specs = [pruning.parse(p, {}) if isinstance(p, str) else p for p in policies]
    cells: list[tuple[PolicySpec, float | None, int | None]] = [(PolicySpec.parse("none", {}), None, None)]
    cells += [(p, f, max(block_size, round(f * video_tokens))) for f in fractions for p in specs
              if pruning.budgeted(p)]
    return cells


def evaluate(checkpoint: str | Path, examples: Sequence[VQAExample], policies: Sequence[PolicySpec | str],
             fractions: Sequence[float], shape: EngineShape,
             on_cell: Callable[[AccuracyRun], None] | None = None, inputs: Sequence[str] = ("video",),
             equal: str = "frames") -> list[AccuracyRun]:
    """Full KV once, then every (policy, fraction) cell, for each input shape in ``inputs``.

    Frames sent as images occupy about twice the tokens of the same frames sent as a video (an image is one
    frame, a video token covers a two-frame patch), so shapes can be compared two ways (``equal``):

    * ``"frames"``: a budget is a fraction of the tokens the video occupies in that shape's request
      (:func:`~cords_vllm.lab.vqa.serving.candidate_tokens`); every shape keeps the same share of its frames, and
      images hold twice the KV.
    * ``"kv"``: a budget is a fraction of the tokens of the first shape in ``inputs``; every shape holds the
      same KV, and images keep half the share of their frames.
    """
    from cords_vllm.lab.vqa.serving import candidate_tokens

    if equal not in ("frames", "kv"):
        raise ValueError(f"equal must be 'frames' or 'kv', got {equal!r}")
    runs = []
    per_shape = {name: budget_cells(policies, fractions,
                                    candidate_tokens(examples[0].geometry, name if equal == "frames" else inputs[0]),
                                    shape.block_size) for name in inputs}
    for i in range(len(per_shape[inputs[0]])):
        for shape_name in inputs:
            spec, fraction, budget = per_shape[shape_name][i]
            t0 = time.perf_counter()
            predictions, held = run_policy(checkpoint, examples, spec, budget, shape, shape_name)
            run = AccuracyRun(spec.label, spec.policy, spec.config, fraction, budget,
                              accuracy_report(examples, predictions), held, time.perf_counter() - t0, shape_name,
                              list(predictions))
            runs.append(run)
            if on_cell:
                on_cell(run)
    return runs
