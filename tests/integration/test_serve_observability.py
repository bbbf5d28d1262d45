"""A real `vllm serve --kv-policy cords` with two API servers and DEBUG logs: what an operator sees.

One server for every assertion (starting one costs most of the test's time): the single INFO start-up line,
per-compression DEBUG lines from the engine-core and worker processes, and the same non-zero counters on
``/metrics`` whichever API server answers.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from cords_vllm.integration.handoff.published import COUNTERS as PUBLISHED_COUNTERS
from cords_vllm.integration.handoff.published import PUBLISH_INTERVAL_S, await_published
from cords_vllm.lab.bench.http import scrape
from cords_vllm.lab.serving.process import VLLMServer
from cords_vllm.lab.synthetic import make_video, mp4_data_url

pytestmark = pytest.mark.server

ARGS = ["--kv-policy", "cords", "--kv-policy-config", '{"budget": 256, "slack": 64}', "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "4096", "--block-size", "32", "--max-num-scheduled-tokens", "512",
        "--kv-cache-memory-bytes", str(128 << 20), "--limit-mm-per-prompt", '{"image": 0, "video": 1}',
        "--api-server-count", "2"]
COUNTERS = [f"cords_vllm_{name}_total" for name in PUBLISHED_COUNTERS]
#: Counters a healthy compressed request raises (NaN/inf keys are counted only when they occur).
RAISED = [name for name in COUNTERS if name != "cords_vllm_nonfinite_compressions_total"]


#: Runs with ``-m slow`` (about 35 s; the data-parallel stream test checks the counters of two API servers in the
#: default suite).
@pytest.mark.slow
def test_two_api_servers_log_at_debug_and_report_the_same_counters(tiny_model):
    with VLLMServer(tiny_model, ARGS, env={"VLLM_LOGGING_LEVEL": "DEBUG"}) as server:
        status, body = server.post_json("/v1/chat/completions", {
            "model": server.model_id(), "max_tokens": 2, "temperature": 0.0,
            "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": mp4_data_url(make_video(32, 224, 224).frames, fps=2)}},
                {"type": "text", "text": "What happened?"}]}]})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > 1024  # 1024 video tokens: compressed above 256 + 64
        await_published(lambda: scrape(server.base_url),
                        lambda m: all(m.get(name, 0) > 0 for name in RAISED))
        time.sleep(2 * PUBLISH_INTERVAL_S)  # a later publication of the same request, if any, is out too
        # each scrape opens a new connection; the kernel spreads them over both API server processes
        scrapes = [{name: m[name] for name in COUNTERS} for m in (scrape(server.base_url) for _ in range(8))]
        log = Path(server.log_path).read_text(errors="replace")
    assert all(scrapes[0][name] > 0 for name in RAISED) and scrapes[0]["cords_vllm_nonfinite_compressions_total"] == 0

    assert scrapes == scrapes[:1] * len(scrapes)

    lines = [line for line in log.splitlines() if "cords-vllm: --kv-policy cords" in line]
    startup = [line for line in lines if " INFO " in line]
    assert len(startup) == 1, lines  # once, by the process that starts the engine
    # each API server built its config under the same policy, and says so at debug level
    assert sorted(re.match(r"\((\w+) ", line).group(1) for line in lines if " DEBUG " in line) == [
        "ApiServer_0", "ApiServer_1"], lines
    for setting in ('"budget": 256', '"recent": 64', '"slack": 64', '"granularity": "auto"', '"min_units": 32',
                    '"anchors": [0]', '"alpha": 0.25', "prefix caching only for the requests the policy never"):
        assert setting in startup[0], (setting, startup[0])
    assert re.search(r"\(EngineCore.* DEBUG .*cords-vllm: plan chatcmpl-", log)
    assert re.search(r"Worker.* DEBUG .*cords-vllm: compressed chatcmpl-", log)
