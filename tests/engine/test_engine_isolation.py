"""A failure inside the plugin's engine-side hooks ends the one request concerned, with its reason, never the
engine core (in-process engine: an exception that escaped ``Scheduler.schedule`` would reach the test).

* The numbers a stream's API refuses (``fps`` 1e-310: Qwen2.5-VL's processor makes its seconds per temporal patch
  infinite) reach the engine through ``EngineSession`` here: the scheduler's rotary-position rule raised
  ``OverflowError`` (``int(inf)``) inside ``Scheduler.schedule``, which ended the engine core; that stream now ends
  alone, and another stream keeps pushing and answering.
* A compression whose planning fails in the scheduler, or whose preparation or selection fails in the worker (where
  a step's compressions are carried out together), ends its request alone (the failures injected into the real
  engine; the worker's reaches the scheduler when both share the
  process, as with one GPU or an in-process engine).
"""

from __future__ import annotations

import pytest

from cords_vllm.config import kv_policy_args
from cords_vllm.integration.inprocess.llm import make_llm
from cords_vllm.integration.inprocess.session import EngineSession, SessionClosed
from cords_vllm.lab.synthetic import TinyModelSpec, build_tiny_model
from tests.engine.conftest import BLOCK, VIDEO_PROMPT, video

pytestmark = pytest.mark.engine

OPEN, CLIP = "<|im_start|>user\n", "<|vision_start|><|video_pad|><|vision_end|>"


def clip(frames, fps):
    n = len(frames)
    return frames, {"fps": fps, "duration": n / fps, "total_num_frames": n, "frames_indices": list(range(n)),
                    "video_backend": "opencv", "do_sample_frames": False}


@pytest.fixture(scope="module")
def llm():
    path = str(build_tiny_model(TinyModelSpec(family="qwen2_5_vl", dtype="float32")))
    engine = make_llm(path, block_size=BLOCK, max_num_batched_tokens=4096, max_num_scheduled_tokens=256,
                      limit_mm_per_prompt={"image": 0, "video": 8}, **kv_policy_args("cords", budget=128, slack=64))
    yield engine
    del engine


def test_a_stream_whose_frame_times_overflow_ends_alone(llm):
    healthy = EngineSession(llm, "camera-ok")
    healthy.push({"prompt": OPEN + CLIP, "multi_modal_data": {"video": clip(video(4, seed=1), 2.0)}})
    broken = EngineSession(llm, "camera-overflow")
    with pytest.raises(SessionClosed, match="ended session camera-overflow with an error"):
        broken.push({"prompt": OPEN + CLIP, "multi_modal_data": {"video": clip(video(4, seed=2), 1e-310)}})
    healthy.push({"prompt": CLIP, "multi_modal_data": {"video": clip(video(4, seed=3), 2.0)}})
    assert len(healthy.push({"prompt": "What color was the square?<|im_end|>\n<|im_start|>assistant\n"}, 2)) == 2
    healthy.close()


def _fail_for(name: str, original, req_id_of):
    from cords_vllm.integration.engine_core.requests import external_request_id

    def failing(*args, **kwargs):
        if external_request_id(req_id_of(args)) == name:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)
    return failing


def _refused_by_selection(original):
    """``WorkerCompressor._begin`` whose compression of ``doomed`` asks for every candidate, which the selection
    refuses (a ``ValueError`` inside the step's compressions, carried out together with the other request's)."""
    from dataclasses import replace

    from cords_vllm.integration.engine_core.requests import external_request_id

    def begin(self, runner, plan):
        started = original(self, runner, plan)
        if external_request_id(plan.req_id) != "doomed":
            return started
        batch = replace(started.compression.batch, num_keep_candidates=started.compression.batch.num_candidates)
        return replace(started, compression=replace(started.compression, batch=batch))
    return begin


@pytest.mark.parametrize("where", ["scheduler", "worker", "selection"])
def test_a_compression_that_fails_ends_its_request_alone(llm, monkeypatch, where):
    from vllm import SamplingParams

    import cords_vllm.integration.engine_core.scheduler as scheduler
    import cords_vllm.integration.worker.compressor as compressor

    if where == "scheduler":  # plan_compression(req_id, ...)
        monkeypatch.setattr(scheduler, "plan_compression",
                            _fail_for("doomed", scheduler.plan_compression, lambda args: args[0]))
    elif where == "worker":  # WorkerCompressor._begin(self, runner, plan)
        monkeypatch.setattr(compressor.WorkerCompressor, "_begin",
                            _fail_for("doomed", compressor.WorkerCompressor._begin, lambda args: args[2].req_id))
    else:
        monkeypatch.setattr(compressor.WorkerCompressor, "_begin",
                            _refused_by_selection(compressor.WorkerCompressor._begin))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": clip(video(16, seed=s), 2.0)}} for s in (4, 5)]
    engine = llm.llm_engine
    for name, prompt in zip(("doomed", "fine"), prompts, strict=True):
        engine.add_request(name, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["doomed"].finish_reason == "error"
    assert finished["fine"].finish_reason == "length" and len(finished["fine"].token_ids) == 3


def test_a_worker_with_no_scheduler_in_its_process_is_told_so(monkeypatch):
    """With workers in processes of their own nothing reaches the scheduler: the worker must not carry on."""
    from cords_vllm.integration.handoff import failures

    monkeypatch.setattr(failures, "_schedulers", 0)
    monkeypatch.setattr(failures, "_reported", {})
    assert failures.report("r", "why") is False and failures.drain() == {}
    failures.scheduler_here()
    assert failures.report("r", "why") is True and failures.drain() == {"r": "why"} and failures.drain() == {}
