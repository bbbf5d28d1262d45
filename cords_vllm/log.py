"""The plugin's loggers follow vLLM's logging configuration.

Every module of the plugin logs through ``logging.getLogger(__name__)``, i.e. below the ``cords_vllm``
logger, a sibling of vLLM's ``vllm`` logger under the root. vLLM configures only its own tree (level from
``VLLM_LOGGING_LEVEL`` / ``--log-level``, its stream handler and format, ``propagate=False``), so without
this module the plugin's records reach the root logger (WARNING, no vLLM handler) and a
``VLLM_LOGGING_LEVEL=DEBUG`` server prints no plugin line at all.

Copying the ``vllm`` logger's level and handlers onto ``cords_vllm`` would go stale: vLLM applies its
``dictConfig`` again after plugins are loaded (the CLI after parsing ``--log-level``, ``EngineArgs``, every
engine-core and worker process), and each time it replaces the handler objects. Instead
:func:`follow_vllm_logging` makes ``vllm`` the *parent* of ``cords_vllm``: with its level left unset, the
plugin's effective level is vLLM's and its records go to vLLM's handlers (formatter included), whatever
vLLM configures and however often. With ``VLLM_CONFIGURE_LOGGING=0`` the ``vllm`` logger has no handler of
its own and propagates to the root, so the plugin's records do too, exactly like vLLM's. A logging
configuration that sets ``cords_vllm`` itself (level, handlers, ``propagate``) still applies on top.
"""

from __future__ import annotations

import logging

#: The parent of every plugin logger (the package name).
PLUGIN_LOGGER = "cords_vllm"
#: vLLM's root logger, the one its logging configuration sets up.
VLLM_LOGGER = "vllm"


def follow_vllm_logging() -> logging.Logger:
    """Attach the ``cords_vllm`` logger below vLLM's ``vllm`` logger (idempotent); returns it."""
    plugin = logging.getLogger(PLUGIN_LOGGER)
    vllm = logging.getLogger(VLLM_LOGGER)
    if plugin.parent is not vllm:
        plugin.parent = vllm
        # Loggers cache isEnabledFor() answers; setLevel clears every cache (the level itself is unchanged).
        plugin.setLevel(plugin.level)
    return plugin
