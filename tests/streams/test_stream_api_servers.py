"""Every API server of ``vllm serve --api-server-count 2`` serves streams under the policy the flags name.

vLLM spawns each API server from the parsed arguments, before that process has loaded the plugin; the policy
must still reach it (``startup.cli_args.carry_to_spawned_api_servers``). Before that fix every spawned server sized
streams as uncompressed (``kv_policy`` ``none``, a 2,048-block footprint at this max-model-len) and refused
them all with 429. Checked through both API servers (a stream's id names the server that opened it, and each
request is a new connection, which the kernel hands to either): the same capacity, each stream's ``kv_policy``
and ``footprint_blocks`` equal to what one server reports for this configuration, and the same limits (a
question longer than ``max_text_tokens`` is refused before the engine by both). The relay between the API servers
takes no orders from clients: a client's copy of its internal header neither stops a request being relayed to the
stream's owner nor hides the other server's streams from a listing.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from cords_vllm.client import StreamAPIError, StreamClient
from cords_vllm.config import KVPolicyConfig
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.vqa import shipped_checkpoint

pytestmark = pytest.mark.server

MAX_MODEL_LEN = 32768
BLOCK = 32  # the CPU attention backend takes multiples of 32
CONFIG = {"budget": 256, "max_text_tokens": 512}
ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--block-size", str(BLOCK),
        "--kv-cache-memory-bytes", str(64 << 20), "--kv-policy", "cords", "--kv-policy-config", json.dumps(CONFIG),
        "--api-server-count", "2"]


@pytest.fixture(scope="module")
def server():
    with VLLMServer(shipped_checkpoint(), ARGS, startup_timeout=600) as srv:
        yield srv


def _origin(stream_id: str) -> int:
    """The index of the API server that opened the stream (``stream-<index>-<hex>``)."""
    return int(stream_id.split("-")[1])


def test_both_api_servers_admit_and_size_streams_under_the_policy(server):
    client = StreamClient(server.base_url, timeout=60)
    policy = KVPolicyConfig.parse("cords", json.dumps(CONFIG))
    footprint = policy.stream_footprint_blocks(MAX_MODEL_LEN, BLOCK)
    assert footprint < MAX_MODEL_LEN // BLOCK  # the uncompressed size would not fit the pool at all
    capacities = [client.request("GET", "/v1/streams")["capacity"] for _ in range(6)]
    assert all(c["stream_footprint_blocks"] == footprint for c in capacities), capacities
    assert all(c["max_streams"] == capacities[0]["pool_blocks"] // footprint for c in capacities), capacities

    by_server: dict[int, list] = {}
    for _ in range(16):  # until both servers have opened one; each open is a new connection
        stream = client.open()
        if _origin(stream.id) in by_server:
            stream.close()
            continue
        by_server[_origin(stream.id)] = [stream]
        if len(by_server) == 2:
            break
    assert sorted(by_server) == [0, 1], "the kernel never handed an open to the second API server"

    too_long = "why " * (CONFIG["max_text_tokens"] + 8)
    for index, (stream,) in sorted(by_server.items()):
        for _ in range(4):  # read through either server (the other relays)
            got = client.request("GET", f"/v1/streams/{stream.id}")
            assert got["kv_policy"]["policy"] == "cords" and got["kv_policy"]["budget"] == CONFIG["budget"], got
            assert got["footprint_blocks"] == footprint, (index, got)
            assert got["max_text_tokens"] == CONFIG["max_text_tokens"], (index, got)
        with pytest.raises(StreamAPIError) as refused:
            stream.ask(too_long, max_tokens=1)
        assert refused.value.status in (409, 413), (index, refused.value)
        stream.close()


def test_a_clients_copy_of_the_relay_header_changes_nothing(server):
    client = StreamClient(server.base_url, timeout=60)
    streams: dict[int, object] = {}
    for _ in range(16):
        stream = client.open()
        if _origin(stream.id) in streams:
            stream.close()
        else:
            streams[_origin(stream.id)] = stream
        if len(streams) == 2:
            break
    assert len(streams) == 2
    try:
        for forged in ("0", "1", "true", "x" * 64):
            headers = {"x-cords-vllm-forwarded": forged}
            for _ in range(4):  # each a new connection, to either API server
                listed = {s["id"] for s in _get(server, "/v1/streams", headers)["data"]}
                assert {s.id for s in streams.values()} <= listed, (forged, listed)
                for stream in streams.values():
                    assert _get(server, f"/v1/streams/{stream.id}", headers)["id"] == stream.id
    finally:
        for stream in streams.values():
            stream.close()


def _get(server, path: str, headers: dict[str, str]) -> dict:
    request = urllib.request.Request(server.base_url + path, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())
