"""Fidelity metrics of a compressed KV cache: attention-output error, Proposition 1, coverage CDFs.

Pure PyTorch (no vLLM); the plot helper imports matplotlib only when called.
"""

from cords_vllm.lab.fidelity.attention_error import AttentionError, attention_error
from cords_vllm.lab.fidelity.coverage import (
    SPACES,
    CoverageCDF,
    coverage_cdf,
    coverage_curves,
    dominates,
    max_cdf_gap,
    nearest_kept_cosine_distance,
)
from cords_vllm.lab.fidelity.neighbours import kept_index_table, nearest_kept
from cords_vllm.lab.fidelity.plot import plot_coverage_cdfs

__all__ = [
    "SPACES",
    "AttentionError",
    "CoverageCDF",
    "attention_error",
    "coverage_cdf",
    "coverage_curves",
    "dominates",
    "kept_index_table",
    "max_cdf_gap",
    "nearest_kept",
    "nearest_kept_cosine_distance",
    "plot_coverage_cdfs",
]
