"""Requests whose compression failed in a worker, handed to the scheduler that ends them (engine core).

A worker's compression of one request can fail (a bug, a device error) after the scheduler has already planned
it and freed the evicted blocks: that request's KV no longer matches its row, so it must end, alone, with the
reason, and the engine must go on. vLLM has no channel from a worker to the scheduler for that, but with one
worker in the engine core's own process (vLLM's ``uni`` executor: one GPU, or an in-process engine) the two share
this module: the worker reports the request here (:func:`report`), and the scheduler's hook ends it at its next
step (:func:`drain`). With workers in processes of their own (``mp``, Ray, tensor or pipeline parallel) nothing
here reaches the scheduler, so :func:`report` says so and the worker lets the failure end the engine as before,
rather than let the request run on a KV that no longer matches it.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_reported: dict[str, str] = {}
_schedulers = 0


def scheduler_here() -> None:
    """A scheduler of this process will drain reports (called once per scheduler)."""
    global _schedulers
    with _lock:
        _schedulers += 1


def report(req_id: str, reason: str) -> bool:
    """Hand ``req_id`` to this process's scheduler to be ended with ``reason``; ``False`` when no scheduler runs in
    this process (the caller must not carry on as if it were ended)."""
    with _lock:
        if not _schedulers:
            return False
        _reported[req_id] = reason
        return True


def drain() -> dict[str, str]:
    """The requests reported since the last call, with their reasons."""
    with _lock:
        out = dict(_reported)
        _reported.clear()
        return out
