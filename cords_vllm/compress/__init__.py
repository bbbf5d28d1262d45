"""The pure compress step (torch only, no vLLM): plans, KV access for every backend layout, the step itself
and the attention view of compressed rows.

* :mod:`~cords_vllm.compress.plan`: what a compression does, in host integers (block ids, counts, spans).
* :mod:`~cords_vllm.compress.kv_access`: token-level read/write of every attention backend's paged layout.
* :mod:`~cords_vllm.compress.step`: :func:`~cords_vllm.compress.step.compress_region`, read -> select -> copy.
* :mod:`~cords_vllm.compress.attention_view`: the physical view of compressed rows, from host data only.
* :mod:`~cords_vllm.compress.transfer`: one non-blocking upload of a step's small index arrays.
"""
