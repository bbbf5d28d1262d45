"""Start-up: the ``--kv-policy`` flags (:mod:`~.cli_args`), the engine settings a policy needs
(:mod:`~.engine_args`) and the checks of the policy against the model (:mod:`~.checks`), all run while vLLM
parses its arguments and builds its ``VllmConfig``, before any engine process starts."""
