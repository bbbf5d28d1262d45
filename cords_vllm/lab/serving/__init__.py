"""Running ``vllm serve`` as a subprocess: :mod:`cords_vllm.lab.serving.process` (demo, benchmarks, tests)."""
