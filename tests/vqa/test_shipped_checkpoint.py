"""The shipped video-QA checkpoints (Qwen2-VL, Qwen2.5-VL) load in the real vLLM engine and answer as recorded.

``cords_vllm/lab/assets/tiny_vqa/training.json`` records, for the ``test`` split (a few examples per family,
64 frames), the data fingerprint and the predictions vLLM gave when the checkpoint was measured. This test
regenerates that split, serves it through an in-process engine (fp32, full KV cache) and checks the
accuracy against the record (and a floor). Nothing is trained here.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from cords_vllm.lab.vqa import (
    FAMILIES,
    CountFamily,
    Family,
    VideoGeometry,
    accuracy_report,
    get_family,
    make_split,
    shipped_checkpoint,
    training_record,
)

pytestmark = pytest.mark.engine

#: Accuracy may move by at most this much from the recorded value (fp32: in practice it does not move).
TOLERANCE = 0.03
#: Whatever was recorded, each shipped model must answer at least this well on the full-KV test split.
FLOORS = {"qwen2_vl": 0.90, "qwen2_5_vl": 0.70}


def _families(config: dict) -> list[Family]:
    out: list[Family] = []
    for name in config["families"].split(","):
        if name == "count":
            out.append(CountFamily(max_count=config["count_max"], max_decoys=config["count_decoys"]))
        else:
            out.append(get_family(name))
    return out


#: The Qwen2.5-VL checkpoint's engine check runs with ``-m slow`` (keeps the default suite under 20 minutes).
@pytest.fixture(scope="module", params=[f if f == "qwen2_vl" else pytest.param(f, marks=pytest.mark.slow)
                                        for f in sorted(FLOORS)])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def record(family) -> dict:
    return training_record(shipped_checkpoint(family))


@pytest.fixture(scope="module")
def test_split(record):
    rec = record["results"]["vllm"]["test_split"]
    cfg = record["config"]
    geometry = VideoGeometry(cfg["frames"], cfg["size"])
    examples = make_split(_families(cfg), rec["per_family"], "test", geometry=geometry)
    h = hashlib.sha256()
    for e in examples:
        h.update(e.answer.encode())
        h.update(np.ascontiguousarray(e.frames).tobytes())
    assert h.hexdigest() == rec["fingerprint"], (
        "the task generator no longer produces the data the checkpoint was measured on; "
        "re-measure with `benchmarks/train_vqa.py --eval-only cords_vllm/lab/assets/tiny_vqa`")
    return examples, rec


def test_record_describes_checkpoint(record, family) -> None:
    ckpt = shipped_checkpoint(family)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(ckpt).model_type == family
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
                 "processor_config.json"):
        assert (ckpt / name).is_file(), name
    assert set(record["config"]["families"].split(",")) <= set(FAMILIES)
    assert "{question}" in record["prompt"]["template"]
    summary = record["results"]["summary"]
    assert summary["hf"] and summary["vllm"]


def test_shipped_checkpoint_answers_in_vllm(test_split, record, family) -> None:
    examples, rec = test_split
    from cords_vllm.lab.vqa.serving import engine_kwargs, predict_vllm

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        from vllm import LLM

        llm = LLM(**engine_kwargs(shipped_checkpoint(family), examples[0].geometry, kv_cache_memory_bytes=64 << 20))
        try:
            predictions = predict_vllm(llm, examples, fps=record["model"].get("fps") if family != "qwen2_vl" else None)
        finally:
            del llm
    report = accuracy_report(examples, predictions)
    recorded = rec["report"]
    agree = np.mean([p == q for p, q in zip(predictions, rec["predictions"], strict=True)])
    msg = f"accuracy {report['overall']:.3f} vs recorded {recorded['overall']:.3f}; agreement {agree:.3f}"
    assert abs(report["overall"] - recorded["overall"]) <= TOLERANCE, msg
    assert report["overall"] >= FLOORS[family], msg
    assert agree >= 1 - TOLERANCE, msg
    if os.environ.get("CORDS_VQA_VERBOSE"):
        print(msg, {f: v["accuracy"] for f, v in report["families"].items()})
