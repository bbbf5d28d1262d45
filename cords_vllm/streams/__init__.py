"""Live video streams over HTTP: ``/v1/streams`` on vLLM's OpenAI-compatible server.

A stream is one resumable vLLM request (:mod:`cords_vllm.streams.live`) that frames are appended to as they
arrive and questions are asked of at any time; under a KV policy it holds its bounded footprint however long
it runs. Modules: :mod:`~cords_vllm.streams.api` (routes and bodies), :mod:`~cords_vllm.streams.registry`
(open streams, cap, expiry), :mod:`~cords_vllm.streams.live` (one stream's engine request and turns),
:mod:`~cords_vllm.streams.transcript` (each turn's text), :mod:`~cords_vllm.streams.frames` (decoding) and
:mod:`~cords_vllm.streams.plugin` (the endpoint plugin and its switch). The client is :mod:`cords_vllm.client`.
"""
