"""cords-vllm: CoRDS coreset-based KV-cache compression for long-video serving, as a vLLM plugin.

Importing this package is cheap (no torch, no vLLM): vLLM loads it in every process through the
``vllm.general_plugins`` entry point, which calls :func:`cords_vllm.plugin.register`.
"""

__version__ = "0.1.0"

#: The vLLM release line this plugin is written and tested against.
SUPPORTED_VLLM = "0.32"
