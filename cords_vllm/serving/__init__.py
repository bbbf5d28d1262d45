"""Running ``vllm serve`` as a subprocess: :mod:`cords_vllm.serving.process` (demo, benchmarks, tests)."""
