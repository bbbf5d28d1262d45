"""The one seam between the KV policy and vLLM: the only package that imports vLLM.

Everything else of the runtime (:mod:`cords_vllm.selection`, :mod:`cords_vllm.compress`,
:mod:`cords_vllm.config`, :mod:`cords_vllm.conversation`, :mod:`cords_vllm.model_facts`) is pure: no vLLM,
no I/O. This package is organised by the process each part runs in:

* :mod:`~cords_vllm.integration.patches`: the one table of every vLLM function the plugin wraps or calls,
  installed all or nothing by :mod:`~cords_vllm.integration.patching` (signature-checked first).
* :mod:`~cords_vllm.integration.startup`: the ``--kv-policy`` flags, the engine settings a policy needs and the
  checks against the model (the process that parses the command line and builds ``VllmConfig``).
* :mod:`~cords_vllm.integration.engine_core`: scheduler hooks, one tracker per request, the plans handed to the
  workers, step observers (the engine-core process).
* :mod:`~cords_vllm.integration.worker`: the worker hook that carries out plans, KV layouts, the attention
  view (every worker process).
* :mod:`~cords_vllm.integration.api_server`: the stream API and the ``/metrics`` collector (every API server).
* :mod:`~cords_vllm.integration.published`: the one channel from the engine to the API servers (counters,
  high-water marks, held KV per stream, keyed by the request's external id).
* :mod:`~cords_vllm.integration.inprocess`: ``make_llm``, engine sessions and introspection: the one supported
  reach into a running engine's internals (tests, benchmarks, the demo).
"""
