"""The OpenAI Python client sending videos to a `vllm serve --kv-policy cords` server.

Start a server first, for example (add --allowed-local-media-path to let it read local files):

    vllm serve Qwen/Qwen2-VL-7B-Instruct --kv-policy cords --kv-policy-config '{"budget": 6144}' \
        --allowed-local-media-path /data/videos

then:

    python examples/openai_client_video.py --url http://127.0.0.1:8000 --video /data/videos/clip.mp4
"""

from __future__ import annotations

import argparse
import base64
import os


def ask(client, model: str, video_url: str, question: str, max_tokens: int) -> str:
    """One chat completion with a `video_url` part (a data URL or a file:// / http(s):// URL)."""
    response = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0.0,
        messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": video_url}},
            {"type": "text", "text": question},
        ]}],
    )
    return response.choices[0].message.content or ""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--video", required=True, help="a local .mp4 file")
    p.add_argument("--question", default="What happens in this video?")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)

    from openai import OpenAI

    client = OpenAI(base_url=args.url + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    model = client.models.list().data[0].id
    # 1. the video inline, as a base64 data URL (works with any server)
    with open(args.video, "rb") as f:
        data_url = "data:video/mp4;base64," + base64.b64encode(f.read()).decode()
    print("data URL :", repr(ask(client, model, data_url, args.question, args.max_tokens)))
    # 2. the same file by path (the server must be started with --allowed-local-media-path covering it)
    file_url = "file://" + os.path.abspath(args.video)
    print("file URL :", repr(ask(client, model, file_url, args.question, args.max_tokens)))


if __name__ == "__main__":
    main()
