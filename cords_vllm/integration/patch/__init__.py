"""How the plugin reaches into vLLM, in every process: the mechanism, the one table, and what they stand on.

:mod:`~.table` is the one table of every vLLM function the plugin wraps or calls, grouped by process and policy;
:mod:`~.mechanism` installs it (``Patch``, ``Call``, ``Field``, ``Drains``: resolved and signature-checked before
anything changes, all or nothing, idempotent), each vLLM module's entries when vLLM imports that module
(:mod:`~.import_hooks`, never importing it). :mod:`~.version_guard` refuses a vLLM outside the supported release
line before anything is installed, and :mod:`~.attach` holds the plugin's typed state on vLLM's objects.
"""
