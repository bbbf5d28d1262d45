"""The vLLM engine integration: a pure planner, KV layout access, the attention view, thin adapters.

Only :mod:`cords_vllm.engine.patches`, :mod:`~cords_vllm.engine.scheduler`, :mod:`~cords_vllm.engine.worker`
and :mod:`~cords_vllm.engine.engine_args` touch vLLM objects; :mod:`~cords_vllm.engine.planner`,
:mod:`~cords_vllm.engine.region_selection` and :mod:`~cords_vllm.engine.attention_view` are pure and are
tested without an engine.
"""
