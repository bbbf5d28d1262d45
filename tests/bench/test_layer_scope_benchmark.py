"""``benchmarks/layer_scope.py`` turns the accuracy benchmark's stored results into the layer-scope table and plot."""

from __future__ import annotations

from pathlib import Path

from tests.scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_table_and_plot_from_the_stored_64_frame_results(tmp_path, capsys):
    bench = load_benchmark("layer_scope")
    assert bench.main([str(ROOT / "benchmarks/results/accuracy_layers_64f.json"), "--layers", "4",
                       "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # every layer compressed: 7% of full KV at 1/8; the lower half: its two whole layers hold every token
    assert "| all 4 | 98.4% [94-100] (44% KV) | 99.2% [96-100] (19% KV) | 98.4% [94-100] (7% KV)" in out
    assert "| 0..1 | 98.4% [94-100] (72% KV; +0/-0 vs all, p = 1)" in out
    assert (tmp_path / "accuracy_layers_64f_accuracy_vs_kv.png").stat().st_size > 10_000
    assert (tmp_path / "accuracy_layers_64f_layer_scope.md").read_text().startswith("64 frames, heldout split")
