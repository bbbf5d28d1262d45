"""The shape the compress-step benchmarks measure: one paged KV cache and one request's compressed region.

Pure (no vLLM): the benchmarks that use it run on GPU hosts with only torch and Triton.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RegionShape:
    """A KV cache of ``layers`` x ``[blocks, heads, block_size, 2 * head_size]`` and one request's region:
    ``text`` protected tokens, then ``frames`` frames of ``frame_tokens``, of which ``keep_frames`` worth are kept.

    The defaults are Qwen2-VL-7B's cache (28 layers, 4 KV heads of 128, blocks of 16) and a stream's region of
    thirty 448 x 448 frames (256 tokens each), 24 of them kept.
    """

    layers: int = 28
    heads: int = 4
    head_size: int = 128
    block_size: int = 16
    text: int = 64
    frame_tokens: int = 256
    frames: int = 30
    keep_frames: int = 24

    @property
    def held(self) -> int:
        """Tokens the region holds."""
        return self.text + self.frames * self.frame_tokens

    @property
    def kept(self) -> int:
        """Tokens it keeps."""
        return self.text + self.keep_frames * self.frame_tokens
