"""``benchmarks/fidelity.py`` and :mod:`cords_vllm.lab.bench.fidelity` on the real engine: the answer distributions
are whole and normalised, full KV against itself is KL 0, a policy whose budget holds the whole video is KL 0
against full KV (nothing evicted), evicting moves it, and the tables pair the same questions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.scripts import load_benchmark

pytestmark = pytest.mark.engine


def test_distributions_against_the_uncompressed_engine(tmp_path: Path) -> None:
    from cords_vllm.lab.bench.accuracy import EngineShape
    from cords_vllm.lab.bench.fidelity import layer_errors_of, run_distributions, vocab_size
    from cords_vllm.lab.fidelity.paired_kl import kl_from_full
    from cords_vllm.lab.reference.hf import HFReference
    from cords_vllm.lab.vqa import VideoGeometry, shipped_checkpoint
    from cords_vllm.lab.vqa.tasks import iter_examples

    checkpoint = shipped_checkpoint()
    geometry = VideoGeometry(num_frames=16)
    examples = list(iter_examples(["colour"], seed=10_000_123, geometry=geometry, stop=4))
    shape = EngineShape(chunk=32, batch=4)
    run = run_distributions(checkpoint, examples, "none", None, shape)
    full, answers = run.logprobs, run.answers
    assert full.shape == (4, vocab_size(checkpoint))
    torch.testing.assert_close(torch.logsumexp(full, -1), torch.zeros(4, dtype=torch.float64), atol=1e-4, rtol=0)
    # budget above the video: cords evicts nothing and must match full KV to the engine's float noise
    whole = run_distributions(checkpoint, examples, "cords", geometry.num_video_tokens + 64, shape, trace=True)
    assert whole.answers == answers and whole.held >= geometry.num_video_tokens  # nothing evicted
    assert kl_from_full(full, whole.logprobs).max().item() < 1e-6
    # a budget of an eighth evicts: the distributions move
    small = run_distributions(checkpoint, examples, "recency", geometry.num_video_tokens // 8, shape, trace=True)
    assert small.held < geometry.num_video_tokens / 2 and kl_from_full(full, small.logprobs).mean().item() > 1e-3
    # every layer's attention output at the answer, in the HF reference replaying the engine's evictions
    reference, outputs = HFReference(str(checkpoint)), {}
    assert whole.evictions == [{}] * 4 and all(len(e) >= 1 for e in small.evictions)
    untouched = layer_errors_of(reference, examples[:2], whole.evictions, whole.prompt_lens, outputs)
    assert np.array(untouched).shape == (2, len(reference.attention_layers)) and not np.any(untouched)
    moved = np.array(layer_errors_of(reference, examples[:2], small.evictions, small.prompt_lens, outputs))
    assert (moved > 0).all() and set(outputs) == {0, 1}  # full KV's outputs computed once per question


@pytest.mark.slow  # about a minute: four engines and the HF reference (the measure itself is checked above)
def test_the_benchmark_pairs_every_policy_with_the_reference(tmp_path: Path, capsys) -> None:
    script = load_benchmark("fidelity")
    assert script.main(["--seed", "10000077", "--per-family", "2", "--frames", "16", "--policies", "cords", "uniform",
                        "--fractions", "0.25", "--resamples", "200", "--chunk", "32", "--batch", "4",
                        "--attention-questions", "2",
                        "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "fidelity.json").read_text())
    cells = {(c["label"], c["fraction"]): c for c in payload["cells"]}
    assert set(cells) == {("none", None), ("cords", 0.25), ("uniform", 0.25)}
    assert cells[("none", None)]["kl"] == [0.0] * payload["questions"]
    assert cells[("none", None)]["layer_errors"] == [] and len(cells[("cords", 0.25)]["layer_errors"]) == 2
    assert cells[("none", None)]["compressions"] == 0 and cells[("cords", 0.25)]["compressions"] > 0
    assert cells[("cords", 0.25)]["compress_seconds"] > 0  # the engine's own timing of what selecting costs
    (row,) = payload["comparisons"]
    assert (row["reference"], row["other"], row["fraction"]) == ("cords", "uniform", 0.25)
    kl_diff = np.mean(cells[("cords", 0.25)]["kl"]) - np.mean(cells[("uniform", 0.25)]["kl"])
    assert row["kl"]["mean"] == pytest.approx(kl_diff) and row["kl"]["low"] <= kl_diff <= row["kl"]["high"]
    assert row["kl_verdict"] in ("first better", "second better", "undecided")
    assert (tmp_path / "fidelity_kl_0.25.png").stat().st_size > 0
    assert "| 0.25 | uniform |" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "words"), [
    (["--seed", "2000003"], "below 10,000,000"),
    (["--seed", "10000001", "--reference", "snapkv", "--policies", "cords"], "not one of --policies"),
    (["--seed", "10000001", "--fractions", "1.5"], "fractions in (0, 1)"),
])
def test_seeds_the_model_has_seen_and_bad_cells_are_refused(argv, words, capsys) -> None:
    script = load_benchmark("fidelity")
    with pytest.raises(SystemExit):
        script.main(argv)
    assert words in capsys.readouterr().err
