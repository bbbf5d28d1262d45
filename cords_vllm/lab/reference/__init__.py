"""Independent references the engine is checked against: :mod:`cords_vllm.lab.reference.hf`, HF eager Qwen2-VL;
:mod:`cords_vllm.lab.reference.exactness`, the compressed engine compared with it (fp32)."""
