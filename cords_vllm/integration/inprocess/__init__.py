"""In-process engines: the one supported reach into a running engine's internals.

:func:`~.llm.make_llm` builds an in-process ``vllm.LLM`` (the engine core runs in the caller's process),
:class:`~.session.EngineSession` drives a resumable request turn by turn, and :mod:`~.introspect` reads what
the policy holds and did. Tests, benchmarks and the demo use these instead of walking vLLM's objects.
"""
