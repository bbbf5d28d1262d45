"""The protected (text) tokens of one live stream, against the policy's ``max_text_tokens``.

Under a KV policy a stream's video is bounded by the budget, but every other token it holds (the system
prompt, each question, each kept answer, the chat markup between turns) is protected: never evicted. The
engine enforces ``kv_policy_config`` key ``max_text_tokens`` when a turn arrives (a request past it is ended
with an error: the start-up rule and stream admission only promised the pool that many). Ending the stream
loses everything it streamed, so the API server counts the same tokens and refuses a turn that would pass the
limit *before* sending it, leaving the stream as it was.

The count follows what vLLM keeps of a resumable request: a turn's prompt tokens, then all but the last of the
tokens it generated (``Scheduler._update_request_as_session`` keeps the computed output tokens and discards
the last sampled one). Candidate tokens (a clip's video tokens and the vision markers around them, which the
engine evicts with the clip) do not count.

Pure: no engine, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


class TextRoomExceeded(ValueError):
    """A turn would take the stream past ``max_text_tokens``; the stream is left as it was.

    ``need``: protected tokens the turn needs at most, ``room``: what the stream has left.
    """

    def __init__(self, message: str, need: int, room: int) -> None:
        super().__init__(message)
        self.need, self.room = need, room


@dataclass
class TextBudget:
    """Protected tokens a stream holds (``held``) and the most it may hold (``limit``; ``None``: no limit).

    A turn is admitted when ``held + prompt + reserve <= limit``, ``reserve`` being the most generated tokens
    the engine keeps (``max_tokens - 1``); once it ends, :meth:`finish` adds what it really kept.
    """

    limit: int | None
    held: int = 0

    @property
    def room(self) -> int | None:
        """Protected tokens the stream may still take (``None``: unlimited)."""
        return None if self.limit is None else self.limit - self.held

    def admit(self, prompt_tokens: int, max_tokens: int, what: str) -> None:
        """Count a turn of ``prompt_tokens`` protected prompt tokens generating up to ``max_tokens`` tokens.

        Raises :class:`TextRoomExceeded` (nothing counted) when it could take the stream past the limit.
        """
        if prompt_tokens < 0 or max_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 0 and max_tokens >= 1, got {prompt_tokens}, {max_tokens}")
        need = prompt_tokens + max_tokens - 1
        room = self.room
        if room is not None and need > room:
            raise TextRoomExceeded(
                f"{what} needs up to {need} protected (text) tokens ({prompt_tokens} of prompt"
                + (f" + up to {max_tokens - 1} kept answer tokens" if max_tokens > 1 else "")
                + f"), but the stream holds {self.held} of kv_policy_config 'max_text_tokens' ({self.limit}) "
                f"and has {room} left; text is never evicted", need, room)
        self.held += prompt_tokens

    def finish(self, generated_tokens: int) -> None:
        """Count the tokens a turn kept of the ``generated_tokens`` it produced (all but the last)."""
        self.held += max(generated_tokens - 1, 0)


def protected_token_counter(encode: Callable[[str], Sequence[int]],
                            candidate_token_ids: Iterable[int]) -> Callable[[str], int]:
    """``text -> protected tokens``: tokens of ``text`` (as ``encode`` gives them, without special-token
    additions) that are not candidates (``candidate_token_ids``: e.g. a clip's ``<|video_pad|>`` and its
    vision markers)."""
    candidates = frozenset(candidate_token_ids)

    def count(text: str) -> int:
        return sum(1 for token in encode(text) if token not in candidates)

    return count
