"""Offline: an `LLM` answering a question about a long video, with its KV cache compressed by CoRDS.

    python examples/offline_llm_video.py                        # tiny local model, synthetic video
    python examples/offline_llm_video.py --model Qwen/Qwen2-VL-7B-Instruct --video my.mp4 --budget 6144
"""

from __future__ import annotations

import argparse

from _common import model_or_tiny, read_video


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--video", default=None, help="a video file (default: a synthetic 64-frame video)")
    p.add_argument("--budget", type=int, default=512, help="video tokens kept per request")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size (on CPU vLLM otherwise "
                   "reserves most of the machine's memory)")
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    from cords_vllm.config import kv_policy_args
    from cords_vllm.lab.synthetic import make_video

    frames = read_video(args.video) if args.video else make_video(64, 224, 224, seed=0).frames
    # vLLM builds EngineArgs before loading plugins, so the policy goes through `additional_config`;
    # kv_policy_args validates it now and returns {"additional_config": {...}}.
    llm = LLM(model=model_or_tiny(args.model), max_model_len=16384, enforce_eager=True,
              limit_mm_per_prompt={"image": 0, "video": 1}, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
              **kv_policy_args("cords", budget=args.budget, anchors=[0]))
    prompt = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What happens in this video?"
              "<|im_end|>\n<|im_start|>assistant\n")
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": frames}},
                       SamplingParams(temperature=0.0, max_tokens=args.max_tokens))[0]
    print(f"prompt: {len(out.prompt_token_ids)} tokens ({len(frames)} frames)")
    print(f"answer: {out.outputs[0].text!r}")


if __name__ == "__main__":  # vLLM on CPU starts worker processes with spawn
    main()
