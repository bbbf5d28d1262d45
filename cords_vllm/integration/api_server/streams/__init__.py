"""Live video streams over HTTP: ``/v1/streams`` on vLLM's OpenAI-compatible server (API-server process).

A stream is one resumable vLLM request (:mod:`~.live`) that frames are appended to as they arrive and
questions are asked of at any time; under a KV policy it holds its bounded footprint however long it runs.
Modules: :mod:`~.api` (routes and bodies), :mod:`~.registry` (open streams, cap, expiry), :mod:`~.live` (one
stream's engine request and turns), :mod:`~.frames` (decoding) and :mod:`~.plugin` (the endpoint plugin and its
switch). Each turn's text is :mod:`cords_vllm.conversation`; the client is :mod:`cords_vllm.client`.
"""
