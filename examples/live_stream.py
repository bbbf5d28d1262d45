"""A live camera streamed to a `vllm serve --kv-policy cords` server, with questions asked as it runs.

Start a server first (the stream API is on whenever --kv-policy is given), for example:

    vllm serve Qwen/Qwen2-VL-7B-Instruct --kv-policy cords --kv-policy-config '{"budget": 6144}' \
        --max-model-len 131072

then stream a video file (or, without --video, a synthetic camera) in real time and ask every few seconds:

    python examples/live_stream.py --url http://127.0.0.1:8000 --video cam.mp4 --fps 2 --ask-every 30 \
        --question "What is happening at the door?"

Behind vLLM's router in front of several servers (README "Scaling out"), give the router's address and
--router: every request of the stream carries one session key, so it reaches the server that holds the stream.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--router", action="store_true",
                   help="--url is vLLM's router (vllm-router) in front of several servers")
    p.add_argument("--video", default=None, help="a video file; default: a synthetic camera")
    p.add_argument("--seconds", type=float, default=16.0, help="how long the synthetic camera runs")
    p.add_argument("--fps", type=float, default=8.0)
    p.add_argument("--push-frames", type=int, default=8)
    p.add_argument("--ask-every", type=float, default=4.0, help="seconds of video between questions")
    p.add_argument("--question", default="What color was the square?")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--budget", type=int, default=None, help="narrow this stream's budget (at most the server's)")
    args = p.parse_args(argv)

    from cords_vllm.client import StreamClient, camera, video_file_frames

    if args.video:
        frames = video_file_frames(args.video)
    else:
        from cords_vllm.lab.synthetic import make_video

        n = int(args.seconds * args.fps) // 2 * 2
        frames = iter(make_video(n, 112, 112, seed=0).frames)

    client = StreamClient(args.url, api_key=args.api_key, router=args.router)
    answers = []
    with client.open(kv_policy={"budget": args.budget} if args.budget else None,
                     metadata={"source": args.video or "synthetic"}) as stream:
        print(f"stream {stream.id} open")
        streamed, next_question = 0.0, args.ask_every
        for clip in camera(frames, fps=args.fps, push_every=args.push_frames):
            t0 = time.monotonic()
            info = stream.append(clip)["stream"]
            streamed += len(clip) / args.fps
            kv = info["kv"] or {}
            print(f"  {streamed:6.1f} s streamed, push took {time.monotonic() - t0:.2f} s, "
                  f"KV held: {kv.get('blocks', '?')} blocks / {kv.get('tokens', '?')} tokens")
            if streamed >= next_question:
                next_question += args.ask_every
                print(f"  Q: {args.question}\n  A: ", end="", flush=True)
                parts = []
                for piece in stream.ask(args.question, max_tokens=args.max_tokens, stream_answer=True):
                    print(piece, end="", flush=True)  # the answer as the server streams it
                    parts.append(piece)
                print()
                answers.append("".join(parts))
    print(f"stream {stream.id} closed")
    return answers


if __name__ == "__main__":
    main()
