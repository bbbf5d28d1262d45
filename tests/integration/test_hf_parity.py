"""Correctness harness: the in-process vLLM engine equals HF transformers on the tiny model (fp32)."""

import pytest

from cords_vllm.integration.inprocess.llm import make_llm
from cords_vllm.lab.reference.hf import HFQwen2VLReference
from cords_vllm.lab.synthetic import make_video

pytestmark = pytest.mark.engine

N = 12
TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
VIDEO = ("<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe the video.<|im_end|>\n"
         "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def cases():
    # 32 frames at 224x224: T = 16 temporal patches != H / merge = 8, so a reference that used
    # transformers' own M-RoPE rule would differ from vLLM after the video.
    return {"text": (TEXT, None), "video": (VIDEO, make_video(32, 224, 224, seed=5).frames)}


def test_greedy_tokens_and_logits_equal_hf(tiny_model, cases):
    from vllm import SamplingParams

    ref = HFQwen2VLReference(tiny_model)
    expected = {name: ref.run(p, v, max_new_tokens=N) for name, (p, v) in cases.items()}
    del ref
    llm = make_llm(tiny_model, max_model_len=4096, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=1)
    for name, (prompt, video) in cases.items():
        request = {"prompt": prompt} if video is None else {"prompt": prompt,
                                                             "multi_modal_data": {"video": video}}
        out = llm.generate(request, params, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == expected[name].token_ids, name
        # the engine's log-prob of each chosen token equals the reference's
        ref_logprobs = expected[name].logits.log_softmax(-1)
        for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert abs(lp[tok].logprob - float(ref_logprobs[step, tok])) < 1e-4, (name, step)
