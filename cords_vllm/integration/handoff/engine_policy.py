"""Which policy the engines started from this process run, told to the processes vLLM starts for them.

vLLM loads the plugin (:func:`cords_vllm.plugin.register`) in every process before that process has a config, so
the engine core and the workers cannot read ``--kv-policy`` when the patch table is installed. The process that
builds the engine's config (the API server, an ``LLM(...)`` or ``vllm serve --headless``) announces the policy
in the environment (:data:`ENV`), which the engine core and worker processes it starts inherit. There, the
policy's entries of the table are installed only when the announced policy is not ``none``: under ``--kv-policy
none`` a GPU process runs vLLM's own code alone.

A process with nothing announced (a Ray worker on another node: vLLM copies only its own variables to Ray
actors) installs every entry; their wrappers call straight through for an engine without a policy. An engine
with a policy built in a process that announced ``none`` before (tests, notebooks) installs the deferred entries
then (:func:`announce`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

#: The environment variable that carries the policy of the engines this process starts.
ENV = "CORDS_VLLM_ENGINE_POLICY"

_deferred: list[Callable[[], None]] = []


def announce(policy: str) -> None:
    """Record ``policy`` (``"none"`` or a policy's name) for this process and the processes it starts; an enabled
    policy installs what an earlier ``none`` deferred."""
    os.environ[ENV] = policy
    if policy != "none":
        while _deferred:
            _deferred.pop(0)()


def announced() -> str | None:
    """The announced policy, or ``None`` when this process was told nothing."""
    return os.environ.get(ENV) or None


def unless_none(install: Callable[[], None]) -> None:
    """Run ``install`` now, or, when this process's engines run ``none``, once one of its engines enables a
    policy."""
    if announced() == "none":
        _deferred.append(install)
    else:
        install()


def deferred() -> int:
    """How many installs wait for a policy."""
    return len(_deferred)
