"""The stream pool ledger: shared admission of several API servers over several engines' pools (no engine)."""

from __future__ import annotations

import multiprocessing

import pytest

from cords_vllm.integration.api_server.streams.ledger import PoolLedger, TooManyStreams
from cords_vllm.integration.api_server.streams.registry import owner_of, stream_id


def _pair(tmp_path, engines: int = 2, pool: int = 100, cap: int = 64) -> tuple[PoolLedger, PoolLedger]:
    return tuple(PoolLedger(engines=engines, pool_blocks=pool, max_streams=cap, directory=tmp_path, index=i, count=2)
                 for i in range(2))


def test_new_streams_go_to_the_engine_with_most_room():
    ledger = PoolLedger(engines=3, pool_blocks=100)
    assert [ledger.admit(f"s{i}", 30) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert ledger.admit("big", 40) == 0  # 40 free on each: the lowest index
    assert ledger.committed_per_engine() == [100, 60, 60]
    with pytest.raises(TooManyStreams, match="every engine's KV pool"):
        ledger.admit("huge", 41)


def test_two_api_servers_never_commit_the_same_room(tmp_path):
    a, b = _pair(tmp_path)
    assert a.admit("a1", 60) == 0 and b.admit("b1", 60) == 1  # b sees a's stream on engine 0
    assert a.admit("a2", 40) == 0 and b.admit("b2", 40) == 1
    for ledger in (a, b):
        with pytest.raises(TooManyStreams):
            ledger.admit("more", 1)
    a.sync(["a2"])  # a1 ended: its room is back, for either server
    assert b.admit("b3", 60) == 0
    assert b.committed_per_engine() == a.committed_per_engine() == [100, 100]


def test_a_private_ledger_does_not_see_another_server(tmp_path):
    """The negative control: ledgers that share nothing both fill the same pool."""
    a = PoolLedger(engines=1, pool_blocks=100)
    b = PoolLedger(engines=1, pool_blocks=100)
    a.admit("a", 100)
    assert b.admit("b", 100) == 0


def test_the_cap_counts_every_api_server(tmp_path):
    a, b = _pair(tmp_path, cap=3)
    a.admit("a1", 1)
    b.admit("b1", 1)
    b.admit("b2", 1)
    with pytest.raises(TooManyStreams, match="--kv-stream-max-open 3"):
        a.admit("a2", 1)
    b.release("b2")
    assert a.admit("a2", 1) in (0, 1)


def _admit_many(directory, index: int, queue) -> None:
    ledger = PoolLedger(engines=1, pool_blocks=50, max_streams=1000, directory=directory, index=index, count=4)
    admitted = 0
    for n in range(40):
        try:
            ledger.admit(f"{index}-{n}", 1)
            admitted += 1
        except TooManyStreams:
            pass
    queue.put(admitted)


def test_concurrent_processes_admit_exactly_the_pool(tmp_path):
    """Four processes race for 50 blocks, one block a stream: exactly 50 admitted (the lock serialises them)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_admit_many, args=(tmp_path, i, queue)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sum(queue.get(timeout=5) for _ in procs) == 50


def test_stream_ids_name_their_api_server():
    sid = stream_id(3)
    assert owner_of(sid) == 3 and sid.startswith("stream-3-")
    assert owner_of("stream-abc") is None and owner_of("stream-1-xyz") is None
