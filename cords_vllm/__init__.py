"""cords-vllm: CoRDS coreset-based KV-cache compression for long-video serving, as a vLLM plugin.

Importing this package is cheap (no torch, no vLLM): vLLM loads it in every process through the
``vllm.general_plugins`` entry point, which calls :func:`cords_vllm.plugin.register`.

The house: pure runtime modules (:mod:`~cords_vllm.selection`, :mod:`~cords_vllm.compress`,
:mod:`~cords_vllm.config`, :mod:`~cords_vllm.conversation`, :mod:`~cords_vllm.model_facts`), the one seam to
vLLM (:mod:`~cords_vllm.integration`), the stream-API client (:mod:`~cords_vllm.client`) and, apart, the lab
(:mod:`~cords_vllm.lab`), which the runtime never imports.
"""

from cords_vllm import _moved

__version__ = "0.1.0"

#: The vLLM release line this plugin is written and tested against.
SUPPORTED_VLLM = "0.32"

_moved.install()
