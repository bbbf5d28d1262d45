"""Why one ``alpha`` does not fit every model: the scales of the keys and values CoRDS selects on.

The paper's joint distance is ``alpha |k_i - k_j|^2 + (1 - alpha) |v_i - v_j|^2`` over raw keys (after rotary)
and values. When one space's vectors are far larger, it decides the distance whatever ``alpha`` says. This
benchmark runs the shipped trained checkpoint (HF transformers, fp32) on held-out video questions and reads the
video tokens' keys and values out of its cache, per layer and KV head:

* the mean key and value norms, and their ratio;
* the keys' share of the joint distance at the default ``alpha`` (0.25), summed over random pairs of video tokens, in
  the paper's space and in the normalized one (``space="normalized"``: each space divided by its RMS spread over
  the candidates);
* how the selection moves with ``alpha``: the overlap of CoRDS's kept tokens at each ``alpha`` (anchor layer 0,
  the engine's default) with the keys-only (``alpha = 1``) and values-only (``alpha = 0``) selections, in both
  spaces.

    .venv/bin/python benchmarks/kv_scales.py --examples 8 --out benchmarks/results/kv_scales

Prints the tables, writes ``kv_scales.json`` and ``kv_scales.png`` under ``--out``. CPU only (a few seconds per
example).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

ALPHAS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)


def capture(reference, example) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per attention layer, the video tokens' ``[H, N, D]`` keys (after rotary) and values of one prefill."""
    from transformers import DynamicCache

    from cords_vllm.lab.vqa import build_prompt

    enc = reference.encoded(build_prompt(example.question), example.frames)
    lm = reference.model.model.language_model
    cache = DynamicCache(config=reference.config.text_config)
    with torch.no_grad():
        lm(inputs_embeds=enc.embeds, position_ids=enc.positions[:, None], past_key_values=cache, use_cache=True)
    video = enc.ids == reference.config.video_token_id
    keys = [layer.keys[0][:, video] for layer in cache.layers]
    values = [layer.values[0][:, video] for layer in cache.layers]
    return keys, values


def key_share(keys: torch.Tensor, values: torch.Tensor, alpha: float, pairs: int = 4096, seed: int = 0) -> float:
    """The keys' share of the joint distance summed over random token pairs, ``sum alpha |dk|^2 / sum (alpha |dk|^2
    + (1 - alpha) |dv|^2)`` (``keys``, ``values``: ``[N, D]``): ``alpha`` itself where neither space outweighs the
    other."""
    g = torch.Generator().manual_seed(seed)
    i, j = torch.randint(len(keys), (pairs,), generator=g), torch.randint(len(keys), (pairs,), generator=g)
    dk = alpha * (keys[i] - keys[j]).square().sum()
    dv = (1 - alpha) * (values[i] - values[j]).square().sum()
    return float(dk / (dk + dv)) if dk + dv > 0 else alpha


def spread_normalized(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[N, D]``) divided by its RMS spread, as ``space="normalized"`` scales each space."""
    return x / (x - x.mean(0)).square().sum(-1).mean().sqrt().clamp_min(1e-30)


def kept(keys: torch.Tensor, values: torch.Tensor, budget: int, alpha: float, space: str) -> set[int]:
    """Tokens CoRDS keeps (token granularity, all heads jointly) from ``[H, N, D]`` keys and values."""
    from cords_vllm.selection import get_selector

    result = get_selector("cords", alpha=alpha, space=space).select(keys[None], values[None], budget,
                                                                   granularity="token")
    return set(torch.nonzero(result.keep[0]).flatten().tolist())


def run(examples: int, budget_fraction: float, out: Path) -> dict:
    from cords_vllm.lab.reference.hf import HFReference
    from cords_vllm.lab.vqa import FAMILIES, make_split, shipped_checkpoint

    reference = HFReference(shipped_checkpoint())
    split = make_split(sorted(FAMILIES), max(1, examples // len(FAMILIES)) + 1)[:examples]
    layers: dict[int, dict[str, list[float]]] = {}
    overlap = {space: {a: {"keys": [], "values": []} for a in ALPHAS} for space in ("paper", "normalized")}
    for n, example in enumerate(split, start=1):
        keys, values = capture(reference, example)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            row = layers.setdefault(layer, {"key_norm": [], "value_norm": [], "key_share": [], "key_share_norm": []})
            for h in range(k.shape[0]):
                row["key_norm"].append(float(k[h].norm(dim=-1).mean()))
                row["value_norm"].append(float(v[h].norm(dim=-1).mean()))
                row["key_share"].append(key_share(k[h], v[h], 0.25))
                row["key_share_norm"].append(key_share(spread_normalized(k[h]), spread_normalized(v[h]), 0.25))
        budget = max(1, int(budget_fraction * keys[0].shape[1]))
        for space in overlap:
            picks = {a: kept(keys[0], values[0], budget, a, space) for a in ALPHAS}
            for a in ALPHAS:
                overlap[space][a]["keys"].append(len(picks[a] & picks[1.0]) / budget)
                overlap[space][a]["values"].append(len(picks[a] & picks[0.0]) / budget)
        print(f"example {n}/{len(split)}: {example.family}, {keys[0].shape[1]} video tokens", flush=True)
    summary = {
        "checkpoint": "shipped tiny_vqa (Qwen2-VL)", "examples": len(split), "budget_fraction": budget_fraction,
        "layers": {layer: {name: float(np.mean(vals)) for name, vals in row.items()} for layer, row in layers.items()},
        "overlap": {space: {str(a): {side: float(np.mean(v)) for side, v in sides.items()} for a, sides in rows.items()}
                    for space, rows in overlap.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_scales.json").write_text(json.dumps(summary, indent=1))
    _plot(summary, out / "kv_scales.png")
    return summary


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    layers = sorted(summary["layers"], key=int)
    ratio = [summary["layers"][layer]["key_norm"] / summary["layers"][layer]["value_norm"] for layer in layers]
    share = [summary["layers"][layer]["key_share"] for layer in layers]
    share_norm = [summary["layers"][layer]["key_share_norm"] for layer in layers]
    x = [int(layer) for layer in layers]
    left.bar([i - 0.2 for i in x], ratio, width=0.4, label="mean |k| / mean |v|")
    left.set_xlabel("layer")
    left.set_ylabel("key norm / value norm")
    twin = left.twinx()
    twin.plot(x, share, "o-", color="C1", label="keys' share of d at alpha 0.25 (paper)")
    twin.plot(x, share_norm, "s--", color="C2", label="keys' share (normalized)")
    twin.axhline(0.25, color="grey", lw=0.8)
    twin.set_ylim(0, 1)
    twin.set_ylabel("keys' share of the joint distance")
    left.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    for space, style in (("paper", "-"), ("normalized", "--")):
        rows = summary["overlap"][space]
        alphas = [float(a) for a in rows]
        right.plot(alphas, [rows[a]["values"] for a in rows], style, color="C0", label=f"= values-only ({space})")
        right.plot(alphas, [rows[a]["keys"] for a in rows], style, color="C3", label=f"= keys-only ({space})")
    right.set_xlabel("alpha")
    right.set_ylabel("share of kept tokens in common")
    right.set_title("CoRDS selection (layer 0) as alpha moves")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--examples", type=int, default=8, help="held-out questions (default 8)")
    p.add_argument("--budget-fraction", type=float, default=1 / 8, help="kept share of the video tokens (1/8)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_scales"))
    args = p.parse_args()
    if args.examples < 1 or not 0 < args.budget_fraction < 1:
        p.error("--examples must be >= 1 and --budget-fraction in (0, 1)")
    summary = run(args.examples, args.budget_fraction, args.out)
    print(f"\n{'layer':>5}  {'|k|':>8}  {'|v|':>8}  {'|k|/|v|':>8}  {'keys share (paper)':>18}  {'(normalized)':>12}")
    for layer, row in sorted(summary["layers"].items(), key=lambda kv: int(kv[0])):
        ratio = row["key_norm"] / row["value_norm"]
        print(f"{layer:>5}  {row['key_norm']:8.3f}  {row['value_norm']:8.3f}  {ratio:8.2f}"
              f"  {row['key_share']:18.3f}  {row['key_share_norm']:12.3f}")
    print(f"\nkept tokens in common with the values-only / keys-only selection (layer 0, budget "
          f"{args.budget_fraction:g} of the video):")
    for space, rows in summary["overlap"].items():
        print(f"  {space:>10}: " + "  ".join(f"a={a}: {r['values']:.2f}/{r['keys']:.2f}" for a, r in rows.items()))
    print(f"\nwritten: {args.out / 'kv_scales.json'}, {args.out / 'kv_scales.png'}")


if __name__ == "__main__":
    main()
