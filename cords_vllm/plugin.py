"""vLLM general-plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` once in each of its processes (API server, engine core, every worker). It
puts the plugin's loggers under vLLM's logging configuration (:mod:`cords_vllm.log`), checks the vLLM
version, adds the ``--kv-policy`` flags, installs the engine patches (:mod:`cords_vllm.engine.patches`), the
switch of the stream API (:mod:`cords_vllm.streams.plugin`) and the ``/metrics`` collector
(:mod:`cords_vllm.observability`). Every step is idempotent and safe in any process; with
``--kv-policy none`` the patched methods call straight through.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """Register cords-vllm with the running vLLM. Raises if the vLLM release is unsupported."""
    global _registered
    if _registered:
        return
    from cords_vllm import cli_args, observability
    from cords_vllm.engine import patches
    from cords_vllm.engine.patching import install as install_patches
    from cords_vllm.log import follow_vllm_logging
    from cords_vllm.streams.plugin import ATTACH_PATCH
    from cords_vllm.version_guard import check_vllm_version

    follow_vllm_logging()
    version = check_vllm_version()
    cli_args.install()
    patches.install()
    install_patches((ATTACH_PATCH,))
    observability.register_collector()
    _registered = True
    logger.debug("cords-vllm registered with vLLM %s", version)
