"""The main job in one command: serve a tiny local Qwen2-VL with a KV policy and answer video requests.

``python -m cords_vllm.demo`` (``make demo``) builds the tiny model (cached), starts
``vllm serve <tiny> --kv-policy POLICY`` on 127.0.0.1, sends several concurrent chat requests that carry
synthetic videos through the OpenAI client, prints each answer with its latency and token counts, and stops
the server (by PID, checking that no process is left behind).

The tiny model is randomly initialised: its answers are fluent-looking noise. The point is the serving
path (video over HTTP, the KV policy in the engine), not what the model says.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from dataclasses import dataclass

from cords_vllm.testing import TinyModelSpec, build_tiny_qwen2vl, make_video, mp4_data_url
from cords_vllm.testing.server import VLLMServer


@dataclass
class Answer:
    index: int
    text: str
    seconds: float
    prompt_tokens: int
    completion_tokens: int


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cords_vllm.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="none", help="--kv-policy of the server (default: %(default)s)")
    p.add_argument("--policy-config", default=None, help="--kv-policy-config JSON of the server")
    p.add_argument("--requests", type=int, default=4, help="concurrent video requests (default: %(default)s)")
    p.add_argument("--frames", type=int, default=16, help="frames per video (default: %(default)s)")
    p.add_argument("--size", type=int, default=224, help="frame height and width (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens per answer (default: %(default)s)")
    return p.parse_args(argv)


def _ask(client, model: str, index: int, url: str, max_tokens: int) -> Answer:
    t0 = time.perf_counter()
    response = client.chat.completions.create(
        model=model, temperature=0.0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": "What color was the square?"},
        ]}],
    )
    return Answer(index=index, text=response.choices[0].message.content or "",
                  seconds=time.perf_counter() - t0, prompt_tokens=response.usage.prompt_tokens,
                  completion_tokens=response.usage.completion_tokens)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from openai import OpenAI

    print("==> building the tiny Qwen2-VL (cached after the first run)", flush=True)
    model_dir = build_tiny_qwen2vl(TinyModelSpec())
    videos = [make_video(args.frames, args.size, args.size, seed=i) for i in range(args.requests)]
    urls = [mp4_data_url(v.frames, fps=2.0) for v in videos]
    serve_args = ["--kv-policy", args.policy, "--enforce-eager", "--max-model-len", "16384",
                  "--kv-cache-memory-bytes", str(512 << 20), "--limit-mm-per-prompt", '{"image": 0, "video": 1}']
    if args.policy_config:
        serve_args += ["--kv-policy-config", args.policy_config]
    server = VLLMServer(model_dir, serve_args)
    print(f"==> starting: vllm serve <tiny-qwen2vl> --kv-policy {args.policy} on {server.base_url}", flush=True)
    t0 = time.perf_counter()
    with server:
        print(f"==> server healthy after {time.perf_counter() - t0:.0f}s; sending {args.requests} concurrent "
              f"video requests ({args.frames} frames of {args.size}x{args.size} each)", flush=True)
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        model = server.model_id()
        t1 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.requests) as pool:
            answers = list(pool.map(lambda iu: _ask(client, model, iu[0], iu[1], args.max_tokens),
                                    enumerate(urls)))
        wall = time.perf_counter() - t1
    for a, v in zip(answers, videos, strict=True):
        print(f"  request {a.index}: needle={v.needle_colour:<8} prompt={a.prompt_tokens:5d} tok  "
              f"answer={a.text!r}  ({a.seconds:.1f}s)")
    total_out = sum(a.completion_tokens for a in answers)
    total_in = sum(a.prompt_tokens for a in answers)
    print(f"==> {len(answers)} requests in {wall:.1f}s: {len(answers) / wall:.2f} req/s, "
          f"{total_in / wall:.0f} prompt tok/s, {total_out / wall:.1f} output tok/s")
    print("==> server stopped cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
