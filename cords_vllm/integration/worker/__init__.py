"""Worker processes: carry out the scheduler's plans on the paged KV cache, before the forward.

:mod:`~.hooks` (what the patched model-runner and attention-group methods call), :mod:`~.compressor` (carries
out a step's plans), :mod:`~.tracker` (one tracker per compressed request), :mod:`~.cpu_layout` (the CPU
backend's tile layout, learnt through its own op), :mod:`~.attention_view` (the compacted view of compressed
rows handed to attention metadata builders) and :mod:`~.positions` (the position offset of re-based requests on
1-D rotary models).
"""
