"""Engine-core process: the scheduler side of the KV policy.

:mod:`~.hooks` (what the patched scheduler methods call, and each scheduler's hooks: compressor, publisher,
step observers), :mod:`~.scheduler` (plan before the step allocates, free blocks, admit by footprint),
:mod:`~.tracker` (one :class:`~.tracker.RequestTracker` per request), :mod:`~.ending` (ending a request the
engine cannot serve, alone and with a reason), :mod:`~.requests` (what the policy reads of a vLLM ``Request``)
and :mod:`~.observers` (the step observer that publishes held KV and peaks).
"""
