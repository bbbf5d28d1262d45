"""What a paged KV cache stores, read as the keys and values selection scores (pure torch).

The compress step copies kept entries *as stored* (:mod:`~cords_vllm.compress.kv_access` moves raw elements:
bytes of an fp8 cache, scales untouched), so a compression never re-quantises and the kept tokens attend exactly
as before. Only selection needs their values, and reads them through a codec:

* :class:`PlainCodec`: a floating cache (``--kv-cache-dtype auto``, ``float16``, ``bfloat16``): the stored
  elements are the values.
* :class:`Fp8Codec`: ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``. vLLM 0.32 allocates the cache as ``uint8`` and each
  backend re-types it (``kv_cache.view(float8_e4m3fn)``; ``float8_e5m2`` for ``fp8_e5m2``); a stored element
  ``q`` stands for ``q * scale``, with the layer's ``_k_scale`` / ``_v_scale`` (one per tensor, or one per KV
  head). The codec reads those scale tensors when it decodes, so scales vLLM computes after start-up
  (``--calculate-kv-scales``) are honoured, without a host read.

Every other ``--kv-cache-dtype`` of vLLM 0.32 quantises per token and head or packs 4-bit values, so a token's
entry is not ``2 * head_size`` elements of one dtype with a per-layer scale; :func:`check_kv_cache_dtype` refuses
them by name (at start-up, before the first request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

#: ``--kv-cache-dtype`` values whose entries are floats: the stored elements are the values.
PLAIN_KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float16", "bfloat16")
#: ``--kv-cache-dtype`` values stored as 8-bit floats with a per-layer (or per-head) scale, and their element type.
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: Every ``--kv-cache-dtype`` a KV policy supports.
SUPPORTED_KV_CACHE_DTYPES: tuple[str, ...] = PLAIN_KV_CACHE_DTYPES + tuple(FP8_KV_CACHE_DTYPES)


class UnsupportedKVCacheDtype(ValueError):
    """A ``--kv-cache-dtype`` whose entries the compress step cannot read or copy."""


def check_kv_cache_dtype(kv_cache_dtype: str, policy: str = "cords") -> None:
    """Refuse a ``--kv-cache-dtype`` a KV policy cannot compress (:class:`UnsupportedKVCacheDtype`)."""
    if kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES:
        return
    raise UnsupportedKVCacheDtype(
        f"--kv-policy {policy} does not support --kv-cache-dtype {kv_cache_dtype}: its entries are quantised per "
        f"token and head or packed below 8 bits, so a token is not 2 * head_size elements with a per-layer scale. "
        f"Supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}; or serve with --kv-policy none")


class KVCodec(Protocol):
    """Reads stored KV entries as values."""

    def features(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The values of stored ``keys`` / ``values`` (``[..., H, D]`` in the cache's storage dtype)."""
        ...


@dataclass(frozen=True)
class PlainCodec:
    """A floating cache: the stored elements are the values (returned as they are, no copy)."""

    def features(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return keys, values


@dataclass(frozen=True)
class Fp8Codec:
    """An 8-bit float cache stored as ``uint8``: ``value = stored.view(element) * scale``.

    ``k_scale`` / ``v_scale``: a float, or a tensor on the cache's device with one element (per tensor) or ``H``
    (per KV head); tensors are read when decoding, so in-place updates by vLLM are seen.
    """

    element: torch.dtype
    k_scale: torch.Tensor | float = 1.0
    v_scale: torch.Tensor | float = 1.0

    def features(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``float32 [..., H, D]`` values of stored ``uint8 [..., H, D]`` keys and values."""
        return self._decode(keys, self.k_scale), self._decode(values, self.v_scale)

    def _decode(self, stored: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
        x = stored.view(self.element).to(torch.float32)
        if isinstance(scale, torch.Tensor):
            scale = scale.to(torch.float32)
            # one per KV head: broadcast over [..., H, D]
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
        return x * scale


def codec_for(kv_cache_dtype: str, k_scale: torch.Tensor | float = 1.0, v_scale: torch.Tensor | float = 1.0,
              element: torch.dtype | None = None) -> KVCodec:
    """The codec of a ``--kv-cache-dtype`` (``element`` overrides the fp8 element type, e.g. the platform's)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype in PLAIN_KV_CACHE_DTYPES:
        return PlainCodec()
    return Fp8Codec(element or FP8_KV_CACHE_DTYPES[kv_cache_dtype], k_scale, v_scale)
