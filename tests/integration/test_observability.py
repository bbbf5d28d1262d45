"""Plugin logs under vLLM's logging configuration; policy counters published off the hot path (no engine)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cords_vllm.integration.handoff import published
from cords_vllm.integration.handoff.published import Publisher, read_totals
from cords_vllm.log import follow_vllm_logging


@pytest.fixture
def metrics_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(published.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(published.MULTIPROC_ENV, raising=False)
    return tmp_path


def test_add_does_no_file_io_and_flush_publishes(metrics_dir, monkeypatch):
    sink = Publisher("scheduler", interval=60.0)

    def no_io(*args, **kwargs):
        raise AssertionError("Publisher.add touched the file system")

    with monkeypatch.context() as m:
        for owner, name in ((os, "replace"), (Path, "write_text"), (Path, "is_dir"), (Path, "exists"),
                            (Path, "open")):
            m.setattr(owner, name, no_io)
        for _ in range(100):
            sink.add(compressions=1, evicted_tokens=10, kept_tokens=4, selection_seconds=0.5)
    assert list(metrics_dir.iterdir()) == []
    sink.flush()
    assert read_totals(metrics_dir) == {"compressions": 100, "evicted_tokens": 1000, "kept_tokens": 400,
                                        "selection_seconds": 50, "nonfinite_compressions": 0,
                                        "request_kv_blocks_peak": 0}
    with pytest.raises(KeyError, match="bogus"):
        sink.add(bogus=1)
    with pytest.raises(KeyError, match="request_kv_blocks_peak"):
        sink.add(request_kv_blocks_peak=1)  # a high-water mark is raised, never added to
    with pytest.raises(KeyError, match="compressions"):
        sink.raise_to(compressions=1)


def test_high_water_marks_only_rise_and_show_the_largest_producer(metrics_dir):
    first, second = Publisher("scheduler", interval=60.0), Publisher("scheduler", interval=60.0)
    for value in (5, 3, 9, 7):
        first.raise_to(request_kv_blocks_peak=value)
    second.raise_to(request_kv_blocks_peak=4)
    second.add(compressions=2)
    first.add(compressions=1)
    first.flush()
    second.flush()
    # two sinks of one producer name in one process (two engines) keep separate files
    assert len(list(metrics_dir.glob("*.json"))) == 2
    assert read_totals(metrics_dir)["request_kv_blocks_peak"] == 9
    assert read_totals(metrics_dir)["compressions"] == 3


def test_changes_are_published_within_the_interval(metrics_dir):
    scheduler, worker = Publisher("scheduler", interval=0.05), Publisher("worker", interval=0.05)
    scheduler.add(compressions=2)
    worker.add(selection_seconds=0.25)
    deadline = time.monotonic() + 10
    while read_totals(metrics_dir)["selection_seconds"] == 0 or read_totals(metrics_dir)["compressions"] == 0:
        assert time.monotonic() < deadline, "counters were not published"
        time.sleep(0.02)
    assert read_totals(metrics_dir) == {"compressions": 2, "evicted_tokens": 0, "kept_tokens": 0,
                                        "selection_seconds": 0.25, "nonfinite_compressions": 0,
                                        "request_kv_blocks_peak": 0}
    assert sorted(p.suffix for p in metrics_dir.iterdir()) == [".json", ".json"]


def test_streams_are_published_by_external_id_and_replaced_not_merged(metrics_dir):
    from cords_vllm.integration.handoff.published import ENDED_KEPT, HeldKV, read_published

    scheduler, other = Publisher("scheduler", interval=60.0), Publisher("scheduler", interval=60.0)
    scheduler.hold({"cam-1": HeldKV(blocks=3, tokens=90, stream_tokens=400)})
    other.hold({"cam-2": HeldKV(blocks=5, tokens=150, stream_tokens=900)})
    assert list(metrics_dir.iterdir()) == []  # memory only until the timer or a flush
    scheduler.flush()
    other.flush()
    published = read_published(metrics_dir)
    assert published.streams == {"cam-1": HeldKV(3, 90, 400), "cam-2": HeldKV(5, 150, 900)}
    scheduler.hold({})  # the stream ended: the next publication drops it
    scheduler.flush()
    assert read_published(metrics_dir).streams == {"cam-2": HeldKV(5, 150, 900)}
    assert read_published(metrics_dir).counters["compressions"] == 0
    for i in range(300):  # why requests ended: the most recent kept, by external id
        scheduler.end(f"cam-{i}", f"reason {i}")
    scheduler.flush()
    ended = read_published(metrics_dir).ended
    assert len(ended) == ENDED_KEPT and ended["cam-299"] == "reason 299" and "cam-0" not in ended


def test_the_external_id_is_the_engine_id_without_vllms_random_suffix(monkeypatch):
    from cords_vllm.integration.engine_core.requests import external_request_id

    monkeypatch.delenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", raising=False)
    assert external_request_id("str-3f2a-1b2c3d4e") == "str-3f2a"
    assert external_request_id("x") == "x"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert external_request_id("str-3f2a-1b2c3d4e") == "str-3f2a-1b2c3d4e"


PRODUCER = """
import os
from cords_vllm.integration.handoff.published import Publisher
sink = Publisher("worker", interval=60.0)
sink.add(compressions=1, evicted_tokens=7)
sink.add(compressions=2)
sink.raise_to(request_kv_blocks_peak=int(os.environ["PEAK"]) - 1)
sink.flush()
sink.add(compressions=1)  # published by the flush at exit
sink.raise_to(request_kv_blocks_peak=int(os.environ["PEAK"]))
"""


def test_several_api_servers_read_the_counters_from_prometheus_multiprocess_files(tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR set (``--api-server-count > 1``), every API server answers /metrics
    from a fresh registry holding only a MultiProcessCollector over that directory: producers' counters
    must be there, summed over processes."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    prom = tmp_path / "prometheus"
    prom.mkdir()
    env = {**os.environ, published.MULTIPROC_ENV: str(prom), published.DIR_ENV: str(tmp_path)}
    for peak in (11, 6):  # two producer processes (e.g. two engine cores)
        subprocess.run([sys.executable, "-c", PRODUCER], env={**env, "PEAK": str(peak)}, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(prom))
    text = generate_latest(registry).decode()
    assert "cords_vllm_compressions_total 8.0" in text
    assert "cords_vllm_evicted_tokens_total 14.0" in text
    assert "cords_vllm_kept_tokens_total 0.0" in text
    assert "cords_vllm_request_kv_blocks_peak 11.0" in text  # the largest over processes, not their sum


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_plugin_loggers_follow_vllm_logging_configuration():
    """Level and handlers come from the ``vllm`` logger, also after vLLM reconfigures logging."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    follow_vllm_logging()
    assert follow_vllm_logging() is logging.getLogger("cords_vllm")  # idempotent
    worker = logging.getLogger("cords_vllm.integration.worker.compressor")
    vllm_logger = logging.getLogger("vllm")
    records = _Records()
    try:
        configure_logging(LoggingConfig(log_level="DEBUG"))  # replaces vLLM's handler objects
        assert worker.isEnabledFor(logging.DEBUG)
        vllm_logger.addHandler(records)
        worker.debug("cords-vllm: compressed r at token 1")
        assert [r.getMessage() for r in records.records] == ["cords-vllm: compressed r at token 1"]
        assert any(h.name == "vllm" for h in vllm_logger.handlers)  # and vLLM's own handler got it too
        configure_logging(LoggingConfig(log_level="INFO"))
        assert not worker.isEnabledFor(logging.DEBUG)
        assert worker.isEnabledFor(logging.INFO)
    finally:
        configure_logging(LoggingConfig())
        vllm_logger.removeHandler(records)


def test_plugin_loggers_propagate_to_root_when_vllm_does_not_configure_logging():
    """``VLLM_CONFIGURE_LOGGING=0`` leaves the ``vllm`` logger bare: records go on to the root's handlers."""
    follow_vllm_logging()
    vllm_logger, root = logging.getLogger("vllm"), logging.getLogger()
    handlers, level, propagate = vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate
    root_level = root.level
    records = _Records()
    try:
        vllm_logger.handlers, vllm_logger.propagate = [], True
        vllm_logger.setLevel(logging.NOTSET)
        root.setLevel(logging.DEBUG)
        root.addHandler(records)
        logging.getLogger("cords_vllm.integration.engine_core.scheduler").debug("cords-vllm: plan r")
        assert [r.name for r in records.records] == ["cords_vllm.integration.engine_core.scheduler"]
    finally:
        root.removeHandler(records)
        vllm_logger.handlers, vllm_logger.propagate = handlers, propagate
        vllm_logger.setLevel(level)
        root.setLevel(root_level)
