"""Two real ``vllm serve --kv-policy cords`` servers behind vLLM's router (``vllm-router --policy
sticky_least_loaded``), on loopback: streams opened through the router stay on the server that holds them, an
open a full server refuses is retried on the other, answers are right, one-shot requests spread over both
servers, each server's KV stays within its pool, and every block is back at the end.

The router's forwarding contract itself (both session policies) is checked against stand-ins in
``tests/streams/test_router_contract.py``, in the default suite.
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import pytest

from cords_vllm.client import StreamAPIError, StreamClient
from cords_vllm.integration.handoff.published import await_published
from cords_vllm.lab.bench.http import scrape
from cords_vllm.lab.bench.offline import kv_bytes_per_block
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.serving.router import VLLMRouter, router_executable
from cords_vllm.lab.synthetic import jpeg_frames_data_url
from cords_vllm.lab.vqa import make_split, shipped_checkpoint
from cords_vllm.lab.vqa.prompt import chat_messages

pytestmark = [pytest.mark.server, pytest.mark.slow,  # about a minute on 2 cores, most of it the two servers starting
              pytest.mark.skipif(router_executable() is None,
                                 reason="vllm-router is not installed (from the checkout: pip install '.[router]')")]

BLOCK, PUSH = 32, 8
CONFIG = {"budget": 128, "recent": 32, "slack": 32, "max_text_tokens": 128}
#: A stream's bounded footprint: max_text_tokens + budget + slack + 2 blocks.
FOOTPRINT = -(-(128 + 128 + 32 + 2 * BLOCK) // BLOCK)
STREAMS_PER_SERVER = 2


def serve_args() -> list[str]:
    kv_bytes = (STREAMS_PER_SERVER * FOOTPRINT + 1) * kv_bytes_per_block(shipped_checkpoint(), BLOCK, 4)
    return ["--kv-policy", "cords", "--kv-policy-config", json.dumps(CONFIG), "--dtype", "float32",
            "--enforce-eager", "--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-model-len", "131072", "--max-num-batched-tokens", "2048",
            "--limit-mm-per-prompt", '{"image": 0, "video": 1}', "--served-model-name", "tiny-vqa"]


def core_binds() -> list[str | None]:
    """One core each when there are two or more (the servers' threads do not fight), else the default."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return [None, None]
    half = len(cores) // 2
    return [",".join(map(str, cores[:half])), ",".join(map(str, cores[half:]))]


@pytest.fixture(scope="module")
def servers():
    pair = [VLLMServer(shipped_checkpoint(), serve_args(),
                       env={"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else None, startup_timeout=600)
            for bind in core_binds()]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(VLLMServer.start, pair))
        yield pair
    finally:
        for server in pair:
            server.stop()


def capacity(server: VLLMServer) -> dict:
    return StreamClient(server.base_url).request("GET", "/v1/streams")["capacity"]


def listing(server: VLLMServer) -> dict[str, dict]:
    return {s["id"]: s for s in StreamClient(server.base_url).list()}


def pool_empty(server: VLLMServer) -> bool:
    return scrape(server.base_url).get("vllm:kv_cache_usage_perc", 1.0) == 0.0


def test_streams_through_the_router_stay_put_and_answer_right(servers):
    a, b = servers
    assert [capacity(s)["max_streams"] for s in servers] == [STREAMS_PER_SERVER] * 2
    examples = make_split(["colour", "order", "count", "static"], 1, "heldout")
    with VLLMRouter([s.base_url for s in servers], "sticky_least_loaded") as router:
        client = StreamClient(router.base_url, router=True, timeout=600)
        # server a is full behind the router's back: the router's first pick is refused at least once
        # (the first open goes to either server; if it goes to b, the second goes to the emptier-looking a)
        direct = StreamClient(a.base_url)
        blockers = [direct.open() for _ in range(STREAMS_PER_SERVER)]
        first = [client.open(fps=8, metadata={"camera": str(i)}) for i in range(2)]
        assert set(listing(b)) == {s.id for s in first}
        assert sum(s.refusals for s in first) >= 1
        with pytest.raises(StreamAPIError) as error:  # both full: refused after the bounded tries
            client.open()
        assert error.value.status == 429
        for stream in blockers:
            stream.close()
        second = [client.open(fps=8, metadata={"camera": str(i)}) for i in (2, 3)]
        assert set(listing(a)) == {s.id for s in second}  # the router sends new streams to the emptier server
        streams = first + second

        # play each example as a camera, round robin; ask a couple of pushes after its answer went by
        pushes = len(examples[0].frames) // PUSH
        asks = [min(pushes, max(e.needle_frames, default=len(e.frames) // 2) // PUSH + 3) for e in examples]
        answers: dict[str, str] = {}
        for push in range(1, pushes + 1):
            for stream, example, ask in zip(streams, examples, asks, strict=True):
                stream.append(example.frames[(push - 1) * PUSH:push * PUSH])
                if push == ask:
                    answers[stream.id] = stream.ask(example.question, max_tokens=1)
        assert [answers[s.id] for s in streams] == [e.answer for e in examples]

        # every push and question reached the server that holds the stream, and only that one
        held = {s.id: (b if s in first else a) for s in streams}
        for stream in streams:
            other = a if held[stream.id] is b else b
            info = listing(held[stream.id])[stream.id]
            assert info["frames"] == pushes * PUSH and info["clips"] == pushes and info["questions"] == 1
            assert stream.id not in listing(other)
        # negative control: without its session key a request goes wherever the router likes (one server for
        # every keyless GET): the streams held by the other server are not found there
        missed = []
        for stream in streams:
            try:
                client.request("GET", f"/v1/streams/{stream.id}")
            except StreamAPIError as err:
                assert err.status == 404
                missed.append(stream.id)
        assert len(missed) == 2 and len({held[i].port for i in missed}) == 1

        # each server's KV within its pool: streams compressed to their footprint, the pool never over-committed
        for server in servers:
            cap = capacity(server)
            assert cap["committed_blocks"] == STREAMS_PER_SERVER * FOOTPRINT <= cap["pool_blocks"]
            kv = await_published(lambda s=server: listing(s), lambda ls: all(v["kv"] for v in ls.values()), timeout=60)
            assert all(v["kv"]["blocks"] <= FOOTPRINT for v in kv.values())
            assert all(v["kv"]["tokens"] < v["kv"]["stream_tokens"] for v in kv.values())  # compressed
            assert sum(v["kv"]["blocks"] for v in kv.values()) <= cap["pool_blocks"]

        for stream in streams:
            stream.close()
        log = router.log_text()
        assert all(f"finished session '{s.session}'" in log for s in streams)  # the router's sessions released
        assert all(capacity(s)["committed_blocks"] == 0 for s in servers)
        assert all(await_published(lambda s=s: pool_empty(s), bool, timeout=60) for s in servers)


def test_one_shot_requests_through_the_router_spread_and_answer_as_directly(servers):
    examples = make_split(["colour", "order", "count", "static"], 1, "heldout")

    def ask(client: StreamClient, example) -> str:
        body = {"model": "tiny-vqa", "max_tokens": 1, "temperature": 0.0,
                "messages": chat_messages(example.question, jpeg_frames_data_url(example.frames))}
        return client.one_shot("/v1/chat/completions", body)["choices"][0]["message"]["content"]

    direct = [ask(StreamClient(servers[i % 2].base_url), e) for i, e in enumerate(examples)]
    before = [scrape(s.base_url).get("vllm:request_success_total", 0.0) for s in servers]
    with VLLMRouter([s.base_url for s in servers], "sticky_least_loaded") as router:
        client = StreamClient(router.base_url, router=True, timeout=600)
        # in flight together, each one-shot request is a session of its own: the next goes to the other server
        with concurrent.futures.ThreadPoolExecutor(len(examples)) as pool:
            replies = list(pool.map(lambda e: ask(client, e), examples))
        log = router.log_text()
    # the router passes the request unchanged: the same answers as sent to a server directly (the tiny model
    # answers 3 of these 4 one-shot questions right at this budget, the colour one wrong)
    assert replies == direct
    assert sum(r == e.answer for r, e in zip(replies, examples, strict=True)) >= len(examples) - 1
    served = [scrape(s.base_url).get("vllm:request_success_total", 0.0) - n
              for s, n in zip(servers, before, strict=True)]
    assert sum(served) == len(examples) and min(served) >= 1, served
    assert log.count("SLL: new session") == log.count("SLL: finished session") == len(examples)
    assert all(await_published(lambda s=s: pool_empty(s), bool, timeout=60) for s in servers)
