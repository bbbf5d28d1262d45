"""The API server's record of a resumable request: bounded by one turn, not by the whole stream (API server).

vLLM 0.32's output processor keeps, per request, the prompt text and token ids it reports back with every
output; for a resumable request (a live stream) it appends each turn's to them, so the API server's memory grows
with everything a stream ever pushed. Nothing reads the earlier turns' prompt back (a turn's outputs are its
generated tokens; the engine core holds what the model attends to), so the wrapper keeps the current turn's
only: a stream's ``RequestOutput.prompt`` and ``prompt_token_ids`` are its latest turn's, under every policy.
"""

from __future__ import annotations

from collections.abc import Callable


def make_apply_streaming_update(original: Callable) -> Callable:
    def apply_streaming_update(self, update):
        original(self, update)
        self.prompt = update.prompt
        self.prompt_token_ids = list(update.prompt_token_ids or ())
        self.prompt_len = len(self.prompt_token_ids)
    return apply_streaming_update
