"""Choosing the budget and the layer schedule, and seeing what each choice keeps.

`budget` is the number of video tokens a request holds after compression (the newest `recent` of them are
always kept); `anchors` are the layers that run the selector, the other layers reuse their anchor's choice.
The paper found the bottom layers (e.g. [0, 2, 4] on 28 layers) most accurate and one late anchor fastest;
"all" makes every layer select for itself. This example runs one video through several settings and prints
how many compressions ran, how many KV blocks the request held at most, and the selection time.

    python examples/budget_and_layers.py
"""

from __future__ import annotations

import argparse

from _common import model_or_tiny

SETTINGS = [
    {"budget": 256, "anchors": [0]},
    {"budget": 512, "anchors": [0]},
    {"budget": 512, "anchors": [0, 2]},
    {"budget": 512, "anchors": "all"},
    {"budget": 512, "anchors": [0], "per_head": True},
    {"budget": 512, "anchors": [0], "granularity": "frame"},
]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--frames", type=int, default=64)
    args = p.parse_args(argv)

    from cords_vllm.lab.bench.offline import EngineSettings, run_offline
    from cords_vllm.lab.bench.workload import PolicySpec, VideoWorkload

    model = model_or_tiny(args.model)
    workload = VideoWorkload(num_requests=1, frames=args.frames, size=224, max_tokens=4)
    engine = EngineSettings(block_size=32, chunk=256, step_tokens=256, pool_videos=1.5)
    rows = []
    for config in [None, *SETTINGS]:
        spec = PolicySpec("none", "none", {}) if config is None else PolicySpec(str(config), "cords", config)
        result = run_offline(model, spec, workload, engine)
        rows.append({"setting": spec.label, "compressions": result.compressions,
                     "peak_blocks": result.peak_blocks_in_use, "selection_ms": 1e3 * result.selection_seconds})
        print(f"{spec.label:<60} compressions={result.compressions:2d} peak KV blocks={result.peak_blocks_in_use:3d} "
              f"selection={1e3 * result.selection_seconds:7.1f} ms")
    return rows


if __name__ == "__main__":
    main()
