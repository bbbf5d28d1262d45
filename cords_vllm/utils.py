"""Small helpers shared across the package (no vLLM, no torch)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b`` (vLLM's ``cdiv``, without importing vLLM)."""
    return -(-a // b)
