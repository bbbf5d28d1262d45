"""The one seam between the KV policy and vLLM: the only package that imports vLLM.

Everything else of the runtime (:mod:`cords_vllm.selection`, :mod:`cords_vllm.compress`,
:mod:`cords_vllm.config`, :mod:`cords_vllm.conversation`, :mod:`cords_vllm.model_facts`) is pure: no vLLM,
no I/O. This package is organised by the process each part runs in:

* :mod:`~cords_vllm.integration.patch`: how the plugin reaches into vLLM in every process: the one table of every
  vLLM function it wraps or calls (:mod:`~.patch.table`), installed all or nothing by :mod:`~.patch.mechanism`
  (signature-checked first), and the version guard.
* :mod:`~cords_vllm.integration.startup`: the ``--kv-policy`` flags, the engine settings a policy needs and the
  checks against the model (the process that parses the command line and builds ``VllmConfig``).
* :mod:`~cords_vllm.integration.engine_core`: scheduler hooks, one tracker per request, the plans handed to the
  workers, step observers (the engine-core process).
* :mod:`~cords_vllm.integration.worker`: the worker hook that carries out plans, KV layouts, the attention
  view (every worker process).
* :mod:`~cords_vllm.integration.api_server`: the stream API and the ``/metrics`` collector (every API server).
* :mod:`~cords_vllm.integration.handoff`: what crosses between those processes: the plans (scheduler -> workers),
  what the engine publishes to the API servers (counters, high-water marks, held KV per stream, keyed by the
  request's external id), failed compressions (worker -> scheduler) and the announced policy.
* :mod:`~cords_vllm.integration.engine_facts`, :mod:`~cords_vllm.integration.kv_groups`,
  :mod:`~cords_vllm.integration.candidates`: facts of the engine vLLM built and of a request, read alike in every
  process.
* :mod:`~cords_vllm.integration.inprocess`: ``make_llm``, engine sessions and introspection: the one supported
  reach into a running engine's internals (tests, benchmarks, the demo).
"""
