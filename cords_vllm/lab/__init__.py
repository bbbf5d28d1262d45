"""The lab: everything that measures the plugin, apart from the runtime that serves it.

Benchmarks' library (:mod:`~.bench`), the synthetic long-video QA task and its trained tiny model
(:mod:`~.vqa`), inputs that need no download (:mod:`~.synthetic`), fidelity metrics of a compressed cache
(:mod:`~.fidelity`), the HF transformers reference (:mod:`~.reference`), a real ``vllm serve`` process
(:mod:`~.serving`), the demos and the one check a GPU user runs (:mod:`~.gpu_check`). The runtime never
imports it (a guard test checks).
"""
