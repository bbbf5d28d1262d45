"""The vLLM engine adapter: the only code that touches vLLM objects.

:mod:`~cords_vllm.engine.patches` (the table of engine patches, installed by
:mod:`~cords_vllm.engine.patching`), :mod:`~cords_vllm.engine.scheduler` (plans, frees blocks, admits by
footprint), :mod:`~cords_vllm.engine.worker` (rewrites rows and drives the pure compress step),
:mod:`~cords_vllm.engine.attention_view` (the compacted view of compressed rows),
:mod:`~cords_vllm.engine.cpu_layout` (the CPU backend's tile layout) and
:mod:`~cords_vllm.engine.engine_args` (engine settings a policy needs). The algorithms they drive live in
:mod:`cords_vllm.compress` and :mod:`cords_vllm.selection`, which never import vLLM.
"""
