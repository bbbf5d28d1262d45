"""Compare KV policies on your own video files: throughput, concurrency and KV blocks, in one run.

    python examples/compare_policies.py clip1.mp4 clip2.mp4 --policies none cords recency --budget 1024

Every policy runs the same requests (each file + a question) through a fresh in-process engine whose KV pool
holds `--pool-videos` uncompressed videos of the longest file.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
from _common import model_or_tiny, read_video


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("videos", nargs="+", help="video files")
    p.add_argument("--model", default=None)
    p.add_argument("--policies", nargs="+", default=["none", "cords", "uniform", "recency"])
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--max-frames", type=int, default=128)
    p.add_argument("--pool-videos", type=float, default=2.0)
    args = p.parse_args(argv)

    from cords_vllm.lab.bench.offline import EngineSettings, run_offline
    from cords_vllm.lab.bench.report import format_table
    from cords_vllm.lab.bench.workload import PROMPT, QUESTION, BenchRequest, PolicySpec, VideoWorkload

    clips = [read_video(path, args.max_frames) for path in args.videos]
    frames = min(len(c) for c in clips)
    size = min(min(c.shape[1], c.shape[2]) for c in clips) // 28 * 28
    if args.model is None:
        size = min(size, 224)  # the tiny model's processor keeps frames up to 224x224 as they are
    clips = [np.ascontiguousarray(c[:frames, :size, :size]) for c in clips]  # one shape: same token count

    @dataclass(frozen=True)
    class FileWorkload(VideoWorkload):
        def requests(self) -> list[BenchRequest]:
            return [BenchRequest(f"req-{i}", clip, PROMPT.format(question=QUESTION), 0.0)
                    for i, clip in enumerate(clips)]

    workload = FileWorkload(num_requests=len(clips), frames=frames, size=size, max_tokens=8)
    engine = EngineSettings(pool_videos=args.pool_videos)
    model = model_or_tiny(args.model)
    rows = [run_offline(model, PolicySpec.parse(name, {"budget": args.budget}), workload, engine).summary()
            for name in args.policies]
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
