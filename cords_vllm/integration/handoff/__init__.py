"""What crosses between vLLM's processes, each hand-off with one writer and one reader.

* :mod:`~.plans`: scheduler -> workers, each step's compression plans on its ``SchedulerOutput``.
* :mod:`~.published`: engine core and workers -> API servers, counters, high-water marks and the KV each stream
  holds (files in a directory the processes share).
* :mod:`~.failures`: a worker -> the scheduler of its own process, requests whose compression failed.
* :mod:`~.engine_policy`: the process that builds the config -> the engine processes it starts, the policy they
  run (an environment variable).
"""
