"""Streams under data parallelism and several API servers (real ``vllm serve --data-parallel-size 2`` over HTTP).

vLLM runs one API server per data-parallel engine by default (``--api-server-count`` = 2 here), both accepting
on one port: a stream's requests reach either, and the one that does not hold the stream relays them to its
owner. Admission is shared: every API server sees every stream's footprint on every engine's pool, and each
new stream goes to the engine with most room.

Checked: streams are placed on both engines; every request for every stream succeeds whichever API server takes
it (without relaying about half would answer 404); the same pushes answer the same and keep the same tokens on
either engine; both engines compress and ``/metrics`` adds their counters up (evicted tokens = what the streams
sent minus what they hold); the pools fill to exactly what they hold, then a 429 names the engines; listings
show every API server's streams; every block returns. ``--api-server-count 2`` with one engine: ``-m slow``.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

import pytest

from cords_vllm.client import StreamAPIError, StreamClient
from cords_vllm.lab.bench.http import scrape
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import make_video
from cords_vllm.lab.vqa import shipped_checkpoint
from tests.streams.test_stream_api import pool_empty, wait_until

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))

pytestmark = [pytest.mark.server, pytest.mark.slow,  # about two minutes on 2 cores, most of it two engines starting
              pytest.mark.skipif(len(CORES) < 2, reason="two engines on CPU need two cores (one each)")]

BLOCK = 32
CONFIG = json.dumps({"budget": 128, "recent": 32, "slack": 32, "max_text_tokens": 256})
COMMON = ["--kv-policy", "cords", "--kv-policy-config", CONFIG, "--dtype", "float32", "--enforce-eager",
          "--block-size", str(BLOCK), "--max-model-len", "1024", "--limit-mm-per-prompt", '{"image": 0, "video": 1}',
          "--kv-cache-memory-bytes", str(6 << 20)]
BIND = {"VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}|{CORES[1]}"}
QUESTION = "What color was the square?"


def _start(args: list[str], env: dict[str, str]) -> VLLMServer:
    return VLLMServer(shipped_checkpoint(), [*COMMON, *args], env=env, startup_timeout=600)


@pytest.fixture(scope="module")
def dp_server():
    with _start(["--data-parallel-size", "2"], BIND) as srv:
        yield srv


def _capacity(client: StreamClient) -> dict:
    return client.request("GET", "/v1/streams")["capacity"]


def _wait_blocks_back(server: VLLMServer) -> None:
    # vLLM's usage gauge follows each engine's next stats
    assert wait_until(lambda: pool_empty(server), timeout=30), "blocks were not returned to the pools"


def _engines_in_use(server: VLLMServer) -> set[str]:
    """The engines whose KV cache vLLM reports in use (``vllm:kv_cache_usage_perc`` by its ``engine`` label)."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    used = set()
    for labels, value in re.findall(r'^vllm:kv_cache_usage_perc\{([^}]*)\} ([0-9.eE+-]+)$', text, re.M):
        engine = re.search(r'engine="(\d+)"', labels)
        if engine and float(value) > 0:
            used.add(engine.group(1))
    return used


def _every_request_reaches_its_stream(client: StreamClient, streams: list) -> None:
    """Each request is a new connection, which the kernel gives to either API server."""
    for stream in streams:
        for _ in range(6):
            assert client.request("GET", f"/v1/streams/{stream.id}")["id"] == stream.id


def test_streams_spread_over_both_engines_and_answer_the_same_on_either(dp_server):
    client = StreamClient(dp_server.base_url, timeout=300)
    empty = _capacity(client)
    assert empty["engines"] == 2 and empty["pool_blocks"] == 2 * empty["engine_pool_blocks"]
    assert empty["engine_committed_blocks"] == [0, 0]
    footprint = empty["stream_footprint_blocks"]

    streams = [client.open() for _ in range(4)]
    owners = {s.id.split("-")[1] for s in streams}
    capacity = _capacity(client)
    assert capacity["engine_committed_blocks"] == [2 * footprint, 2 * footprint]  # most room first
    assert capacity["open_streams"] == 4
    _every_request_reaches_its_stream(client, streams)

    clips = [make_video(8, 112, 112, seed=s).frames for s in range(3)]
    answers = []
    for stream in streams:  # the same pushes on every stream: two on each engine
        for frames in clips:
            stream.append(frames)
        answers.append(stream.ask(QUESTION, max_tokens=3))
    assert all(answers) and len(set(answers)) == 1, answers

    time.sleep(1.5)  # the engines publish what each stream holds within ~0.5 s
    assert _engines_in_use(dp_server) == {"0", "1"}  # vLLM's own view: both engines hold streams' KV
    listing = client.request("GET", "/v1/streams")
    held = {item["id"]: item["kv"] for item in listing["data"]}
    assert set(held) == {s.id for s in streams}, "the listing misses another API server's streams"
    assert all(kv is not None and kv["tokens"] < kv["stream_tokens"] for kv in held.values()), held  # compressed
    assert len({(kv["tokens"], kv["stream_tokens"]) for kv in held.values()}) == 1, held  # same on both engines
    metrics = scrape(dp_server.base_url)
    sent_minus_held = sum(kv["stream_tokens"] - kv["tokens"] for kv in held.values())
    assert metrics["cords_vllm_evicted_tokens_total"] == sent_minus_held  # both engines' counters, added up
    assert metrics["cords_vllm_compressions_total"] >= len(streams)

    for stream in streams:
        stream.close()
    assert _capacity(client)["engine_committed_blocks"] == [0, 0]
    _wait_blocks_back(dp_server)
    print(f"stream owners (API servers): {sorted(owners)}")


def test_the_pools_fill_to_what_they_hold_then_open_refuses(dp_server):
    client = StreamClient(dp_server.base_url, timeout=300)
    capacity = _capacity(client)
    fits = capacity["max_streams"]
    assert fits == 2 * (capacity["engine_pool_blocks"] // capacity["stream_footprint_blocks"])
    streams = [client.open() for _ in range(fits)]
    assert _capacity(client)["available_streams"] == 0
    with pytest.raises(StreamAPIError) as refused:
        client.open()
    assert refused.value.status == 429 and "every engine's KV pool" in refused.value.message
    streams[0].append(make_video(8, 112, 112, seed=1).frames)  # the admitted streams still serve
    assert streams[0].ask(QUESTION, max_tokens=1)
    for stream in streams:
        stream.close()
    assert _capacity(client)["available_streams"] == fits
    _wait_blocks_back(dp_server)


@pytest.mark.slow
def test_two_api_servers_on_one_engine_share_its_pool():
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, CORES))}
    with _start(["--api-server-count", "2", "--kv-cache-memory-bytes", str(12 << 20)], env) as server:
        client = StreamClient(server.base_url, timeout=300)
        capacity = _capacity(client)
        assert capacity["engines"] == 1
        streams = [client.open() for _ in range(capacity["max_streams"])]
        with pytest.raises(StreamAPIError) as refused:
            client.open()
        assert refused.value.status == 429
        _every_request_reaches_its_stream(client, streams)
        streams[-1].append(make_video(8, 112, 112, seed=1).frames)
        assert streams[-1].ask(QUESTION, max_tokens=1)
        assert len(client.request("GET", "/v1/streams")["data"]) == len(streams)
        for stream in streams:
            stream.close()
        _wait_blocks_back(server)
