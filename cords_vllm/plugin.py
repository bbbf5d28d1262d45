"""vLLM general-plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` once in each of its processes (API server, engine core, every worker). It puts the
plugin's loggers under vLLM's logging configuration (:mod:`cords_vllm.log`), checks the vLLM version, installs
the one patch table (:mod:`cords_vllm.integration.patch.table`: all or nothing, every entry signature-checked first)
and registers the ``/metrics`` collector (:mod:`cords_vllm.integration.api_server.metrics`). Every step is
idempotent and safe in any process; with ``--kv-policy none`` the patched methods call straight through.
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
    # Imported here, not at module level: vLLM imports this module while it loads plugins, and the seam imports
    # vLLM; the version must be checked before the patch table resolves any vLLM function.
    from cords_vllm.integration.patch.version_guard import check_vllm_version
    from cords_vllm.log import follow_vllm_logging

    follow_vllm_logging()
    version = check_vllm_version()
    from cords_vllm.integration.api_server.metrics import register_collector
    from cords_vllm.integration.patch import table

    table.install()
    register_collector()
    _registered = True
    logger.debug("cords-vllm registered with vLLM %s", version)
