"""Compression timing: the host clock on CPU; on CUDA, device events read only once they have completed.

No GPU runs here, so the CUDA path is driven with a stand-in event that completes when the test says so (the
same ``record`` / ``query`` / ``elapsed_time`` surface as ``torch.cuda.Event``); ``tests/compress/test_cuda_core.py``
times real events on a GPU.
"""

from __future__ import annotations

import time

import torch

from cords_vllm.integration.worker.timing import CompressionTimer


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)``'s surface: a device clock the test advances."""

    clock_ms = 0.0
    completed_until = 0.0

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = FakeEvent.clock_ms

    def query(self) -> bool:
        return self.at is not None and self.at <= FakeEvent.completed_until

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an incomplete event would synchronise"
        return end.at - self.at


def test_cpu_timer_measures_the_host_clock_at_once() -> None:
    timer = CompressionTimer.for_device(torch.device("cpu"))
    assert not timer.on_device
    mark = timer.start()
    time.sleep(0.01)
    timer.stop("a", mark)
    (timing,) = timer.completed()
    assert timing.req_id == "a" and timing.seconds >= 0.01
    assert timer.completed() == []


def test_device_timer_reads_events_only_once_complete_and_in_order() -> None:
    FakeEvent.clock_ms = FakeEvent.completed_until = 0.0
    timer = CompressionTimer(FakeEvent)
    assert timer.on_device
    for req, cost in (("a", 30.0), ("b", 5.0)):
        mark = timer.start()
        FakeEvent.clock_ms += cost  # the device runs the compression's kernels
        timer.stop(req, mark)
    assert timer.completed() == [] and timer.pending == 2  # launched, nothing finished: nothing read, no wait
    FakeEvent.completed_until = 30.0
    assert [(t.req_id, t.seconds) for t in timer.completed()] == [("a", 0.03)]
    FakeEvent.completed_until = 35.0
    assert [(t.req_id, t.seconds) for t in timer.completed()] == [("b", 0.005)]
    assert timer.pending == 0


class RecordOnlyEvent:
    """What vLLM's CPU worker puts in place of ``torch.cuda.Event`` when it is imported: ``record`` and no more."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass


class FailingEvent(FakeEvent):
    def elapsed_time(self, end: FakeEvent) -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_timing_failure_costs_the_metric_never_the_step(caplog) -> None:
    """The GPU run's crash (``'_EventPlaceholder' object has no attribute 'query'``) and an event that fails to
    read: the timer logs once, drops what it held and stops measuring; start, stop and completed never raise."""
    for factory, cause in ((RecordOnlyEvent, "AttributeError"), (FailingEvent, "illegal memory access")):
        FakeEvent.clock_ms = FakeEvent.completed_until = 0.0
        timer = CompressionTimer(factory)
        timer.stop("a", timer.start())
        FakeEvent.completed_until = 1.0
        with caplog.at_level("WARNING"):
            assert timer.completed() == []
        assert timer.failure is not None and cause in timer.failure and timer.pending == 0
        assert caplog.text.count("compression timing is off") == 1
        timer.stop("b", timer.start())  # later compressions go on unmeasured
        assert timer.completed() == [] and timer.pending == 0
        caplog.clear()


def test_an_event_that_cannot_be_made_or_recorded_costs_the_metric_only() -> None:
    def broken() -> FakeEvent:
        raise RuntimeError("CUDA driver version is insufficient")

    timer = CompressionTimer(broken)
    mark = timer.start()
    assert mark is None and "creating or recording" in timer.failure
    timer.stop("a", mark)
    assert timer.completed() == []
