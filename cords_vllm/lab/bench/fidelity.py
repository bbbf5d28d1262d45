"""Per-question fidelity of KV policies against full KV, through the real engine: answer distributions, KL, and
paired comparisons that say where they are decided.

Every cell answers the same questions with an in-process engine that prefills in small chunks (compressing as
the video streams in, as in serving; :func:`~cords_vllm.lab.bench.accuracy.run_cell`) and returns the answer
token's log-probabilities over the **whole vocabulary** (vLLM's ``logprobs=-1``, the model's raw output). Full KV
runs once; each policy's per-question ``KL(p_full || p_policy)``
(:func:`~cords_vllm.lab.fidelity.paired_kl.kl_from_full`) and right/wrong then pair with every other policy's on
the same questions: :func:`compare` gives, per budget, the reference policy against each other one, the paired
bootstrap interval of the mean KL difference and of the accuracy difference, the verdict, and the questions a
decision would need (power 0.8 at the observed difference).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cords_vllm.lab.bench import pruning
from cords_vllm.lab.bench.accuracy import EngineShape, budget_cells, run_cell
from cords_vllm.lab.bench.paired import mcnemar_exact
from cords_vllm.lab.bench.workload import PolicySpec
from cords_vllm.lab.fidelity.paired_kl import decide, kl_from_full, paired_bootstrap, questions_needed
from cords_vllm.lab.vqa import VQAExample
from cords_vllm.lab.vqa.metrics import answer_hits


@dataclass
class CellFidelity:
    """One (policy, budget) cell on the questions: answers, right or wrong, KL from full KV (nats, per question),
    and the candidate tokens held at the answer."""

    label: str
    policy: str
    fraction: float | None
    budget: int | None
    held: float
    predictions: list[str]
    hits: list[bool]
    kl: list[float] = field(default_factory=list)
    #: Wall seconds of the cell (engine start-up included).
    seconds: float = 0.0
    #: The cell's compressions and their selection seconds (the engine's own timing): what selecting in every
    #: layer costs, beside accuracy.
    compressions: int = 0
    compress_seconds: float = 0.0
    #: ``[n][L]``: every attention layer's output error at the answer for the first ``n`` questions (or empty).
    layer_errors: list[list[float]] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.hits))

    @property
    def ms_per_compression(self) -> str:
        return f"{1e3 * self.compress_seconds / self.compressions:.2f}" if self.compressions else "-"

    @property
    def mean_kl(self) -> float:
        return float(np.mean(self.kl)) if self.kl else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "accuracy": self.accuracy, "mean_kl": self.mean_kl}


def vocab_size(checkpoint: str | Path) -> int:
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def answer_logprobs(outputs: Sequence[Any], vocab: int) -> torch.Tensor:
    """``[N, V]`` log-probabilities of each output's first token from vLLM's ``logprobs=-1`` (``-inf`` for a
    token the engine did not list)."""
    rows = torch.full((len(outputs), vocab), float("-inf"), dtype=torch.float64)
    for i, out in enumerate(outputs):
        listed = out.outputs[0].logprobs
        if not listed:
            raise RuntimeError("the engine returned no log-probabilities: run it with max_logprobs=-1 and "
                               "SamplingParams(logprobs=-1)")
        for token, lp in listed[0].items():
            if token < vocab:
                rows[i, token] = lp.logprob
    return rows


@dataclass
class CellOutputs:
    """What one cell's engine gave: ``[N, V]`` answer log-probabilities, greedy answers, the mean candidate tokens
    held, each question's prompt length and (traced runs) its evictions ``{at_token: kept per layer}``."""

    logprobs: torch.Tensor
    answers: list[str]
    held: float
    prompt_lens: list[int]
    evictions: list[dict[int, Any]] | None = None
    #: The engine's compressions and the seconds its selections took (the compress step's own timing).
    compressions: int = 0
    compress_seconds: float = 0.0


def run_distributions(checkpoint: str | Path, examples: Sequence[VQAExample], spec: PolicySpec | str,
                      budget: int | None, shape: EngineShape, *, trace: bool = False) -> CellOutputs:
    """One cell through the engine; ``trace``: record what each compression kept (for
    :func:`~cords_vllm.lab.reference.layer_outputs.attention_outputs`)."""
    from vllm import SamplingParams

    from cords_vllm.integration.inprocess.introspect import snapshot
    from cords_vllm.integration.worker.compressor import TRACE_ENV
    from cords_vllm.lab.reference.exactness import evictions_of

    snapshots: list[Any] = []
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1)
    previous = os.environ.get(TRACE_ENV)
    if trace:
        os.environ[TRACE_ENV] = "1"  # read when the engine is built; this cell's alone
    try:
        outputs, held = run_cell(checkpoint, examples, spec, budget, shape, params,
                                 engine_overrides={"max_logprobs": -1},
                                 on_llm=lambda llm: snapshots.append(snapshot(llm)))
    finally:
        if previous is None:
            os.environ.pop(TRACE_ENV, None)
        else:
            os.environ[TRACE_ENV] = previous
    (snap,) = snapshots
    events = list(snap.events)
    # the engine's request ids are the outputs' (possibly with a "-suffix"): "1" must not take "10"'s events
    evictions = [evictions_of([e for e in events if e.req_id == o.request_id or e.req_id.startswith(
        o.request_id + "-")]) for o in outputs] if trace else None
    return CellOutputs(answer_logprobs(outputs, vocab_size(checkpoint)), [o.outputs[0].text for o in outputs], held,
                       [len(o.prompt_token_ids) for o in outputs], evictions, snap.compressions,
                       snap.selection_seconds)


def evaluate_fidelity(checkpoint: str | Path, examples: Sequence[VQAExample], policies: Sequence[PolicySpec | str],
                      fractions: Sequence[float], shape: EngineShape,
                      on_cell: Callable[[CellFidelity], None] | None = None,
                      attention_questions: int = 0) -> list[CellFidelity]:
    """Full KV, then every (policy, fraction) cell; each policy cell's KL from full KV, question by question, and
    for the first ``attention_questions`` questions the attention-output error of every layer (HF reference
    replaying the engine's evictions)."""
    cells: list[CellFidelity] = []
    full: torch.Tensor | None = None
    reference, full_outputs = None, {}
    if attention_questions:
        from cords_vllm.lab.reference.hf import HFReference

        reference = HFReference(str(checkpoint))
    for spec, fraction, budget in budget_cells(policies, fractions, examples[0].geometry.num_video_tokens,
                                               shape.block_size):
        started = time.perf_counter()
        run = run_distributions(checkpoint, examples, spec, budget, shape, trace=bool(attention_questions))
        if full is None:
            full = run.logprobs
        cell = CellFidelity(spec.label, spec.policy, fraction, budget, run.held, run.answers,
                            answer_hits(examples, run.answers), kl_from_full(full, run.logprobs).tolist(),
                            time.perf_counter() - started, run.compressions, run.compress_seconds)
        if reference is not None and fraction is not None:
            cell.layer_errors = layer_errors_of(reference, examples[:attention_questions], run.evictions,
                                                run.prompt_lens, full_outputs)
        cells.append(cell)
        if on_cell:
            on_cell(cell)
    return cells


def layer_errors_of(reference: Any, examples: Sequence[VQAExample], evictions: Sequence[dict[int, Any]],
                    prompt_lens: Sequence[int], full_outputs: dict[int, torch.Tensor]) -> list[list[float]]:
    """``[n][L]`` attention-output errors of each question's evictions against full KV (``prompt_lens``: the
    engine's prompt lengths; ``full_outputs``: the full-KV outputs by question, filled on first use)."""
    from cords_vllm.lab.reference.layer_outputs import attention_outputs, layer_errors

    errors = []
    for i, example in enumerate(examples):
        if i not in full_outputs:
            full_outputs[i] = attention_outputs(reference, example.prompt, example.frames, prompt_lens[i])
        mine = attention_outputs(reference, example.prompt, example.frames, prompt_lens[i], evictions[i])
        errors.append(layer_errors(full_outputs[i], mine).tolist())
    return errors


def compare(cells: Sequence[CellFidelity], reference: str = "cords", *, kl_margin: float = 0.0,
            accuracy_margin: float = 0.0, resamples: int = 10_000, seed: int = 0) -> list[dict[str, Any]]:
    """``reference`` against every other policy at each budget, on the same questions.

    Per pair: the paired bootstrap 95% interval of ``mean KL(reference) - mean KL(other)`` and its verdict (lower
    is better; non-inferior within ``kl_margin`` nats), the same for accuracy (higher is better; margin in
    accuracy points as a fraction), McNemar's exact p on the discordant questions, and the questions each
    comparison would need to be decided at the observed difference (power 0.8, two-sided 0.05).
    """
    rows = []
    for fraction in sorted({c.fraction for c in cells if c.fraction is not None}, reverse=True):
        here = {c.label: c for c in cells if c.fraction == fraction}
        if reference not in here:
            continue
        ref = here[reference]
        for label, other in here.items():
            if label == reference:
                continue
            kl = paired_bootstrap(ref.kl, other.kl, resamples=resamples, seed=seed)
            acc = paired_bootstrap(np.asarray(ref.hits, float), np.asarray(other.hits, float), resamples=resamples,
                                   seed=seed)
            kl_diff = np.asarray(ref.kl) - np.asarray(other.kl)
            acc_diff = np.asarray(ref.hits, float) - np.asarray(other.hits, float)
            rows.append({
                "fraction": fraction, "budget": ref.budget, "reference": reference, "other": label,
                "kl": kl.to_json(), "kl_verdict": decide(kl, margin=kl_margin),
                "kl_questions_needed": questions_needed(kl_diff),
                "accuracy": acc.to_json(), "accuracy_verdict": decide(acc, lower_is_better=False,
                                                                       margin=accuracy_margin),
                "accuracy_questions_needed": questions_needed(acc_diff) if acc_diff.any() else None,
                "mcnemar": mcnemar_exact(ref.hits, other.hits).to_json()})
    return rows


def markdown(cells: Sequence[CellFidelity], rows: Sequence[dict[str, Any]], header: str) -> str:
    """The cells' table (accuracy, mean KL, tokens held) and the paired comparisons' table."""
    lines = [header, "", "| policy | fraction | budget | held | accuracy | mean KL from full (nats) | attention-output "
             "error by layer (mean) | compress ms each | cell s |", "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        by_layer = " / ".join(f"{e:.3f}" for e in np.mean(c.layer_errors, axis=0)) if c.layer_errors else "-"
        lines.append(f"| {c.label} | {c.fraction if c.fraction is not None else 'full'} | {c.budget or '-'} | "
                     f"{c.held:.0f} | {100 * c.accuracy:.1f}% | {c.mean_kl:.4f} | {by_layer} | "
                     f"{c.ms_per_compression} | {c.seconds:.1f} |")
    lines += ["", "Paired against the reference, same questions (95% paired bootstrap; reference minus other):", "",
              "| fraction | other | KL difference [95%] | verdict (KL) | n to decide | accuracy difference [95%] | "
              "verdict (accuracy) | McNemar p |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kl, acc = r["kl"], r["accuracy"]
        lines.append(f"| {r['fraction']:g} | {r['other']} | {kl['mean']:+.4f} [{kl['low']:+.4f}, {kl['high']:+.4f}] | "
                     f"{r['kl_verdict']} | {r['kl_questions_needed'] or '-'} | {100 * acc['mean']:+.1f} "
                     f"[{100 * acc['low']:+.1f}, {100 * acc['high']:+.1f}] | {r['accuracy_verdict']} | "
                     f"{r['mcnemar']['p_value']:.3g} |")
    return "\n".join(lines) + "\n"


def plot_comparisons(rows: Sequence[dict[str, Any]], out: Path, kl_margin: float = 0.0) -> list[Path]:
    """One plot per budget: each other policy's paired KL difference (reference minus other) with its interval;
    left of zero the reference is closer to full KV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for fraction in sorted({r["fraction"] for r in rows}, reverse=True):
        here = [r for r in rows if r["fraction"] == fraction]
        fig, ax = plt.subplots(figsize=(6.5, 0.45 * len(here) + 1.4))
        for y, r in enumerate(here):
            kl = r["kl"]
            colour = {"first better": "tab:green", "second better": "tab:red"}.get(r["kl_verdict"], "tab:gray")
            ax.errorbar(kl["mean"], y, xerr=[[kl["mean"] - kl["low"]], [kl["high"] - kl["mean"]]], fmt="o",
                        color=colour, capsize=3)
        ax.axvline(0.0, color="black", lw=0.8)
        if kl_margin:
            ax.axvline(kl_margin, color="black", lw=0.8, ls="--")
        ax.set_yticks(range(len(here)), [r["other"] for r in here])
        ax.set_xlabel(f"mean KL difference, {here[0]['reference']} minus other (nats; < 0: {here[0]['reference']} "
                      "closer to full KV)")
        ax.set_title(f"budget {fraction:g} of the video ({here[0]['budget']} tokens), n = {here[0]['kl']['n']}")
        fig.tight_layout()
        path = out / f"fidelity_kl_{fraction:g}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def parse_policies(names: Sequence[str]) -> list[PolicySpec]:
    return [pruning.parse(n, {}) for n in names]
