"""The text of each turn of a live stream, in the chat markup of the Qwen-VL families (ChatML).

A stream is one conversation the engine keeps as a single resumable request: the system prompt, then a user
message made of clips, a question, the assistant's answer, more clips, and so on. Each turn appends the text
that continues the conversation; the engine discards the last token a turn samples (an answer's end-of-turn
token, or the one token a video push generates), so a turn after an answer first closes it.

Pure: no engine, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
USER = "<|im_start|>user\n"
END = "<|im_end|>\n"
ASSISTANT = "<|im_start|>assistant\n"
#: One clip: vLLM expands ``<|video_pad|>`` to the clip's video tokens.
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"

Phase = Literal["start", "user", "answer"]


@dataclass
class Transcript:
    """Where the conversation stands, and the text the next turn appends.

    ``phase``: ``"start"`` (nothing sent), ``"user"`` (inside a user message), ``"answer"`` (after an
    assistant answer, whose end token the engine discarded).
    """

    system: str = SYSTEM
    phase: Phase = "start"

    def _open_user(self) -> str:
        if self.phase == "start":
            return self.system + USER
        if self.phase == "answer":
            return END + USER
        return ""

    def clip(self) -> str:
        """Text of a turn that appends one clip."""
        text = self._open_user() + VIDEO
        self.phase = "user"
        return text

    def question(self, question: str) -> str:
        """Text of a turn that asks ``question`` and opens the assistant's answer."""
        text = self._open_user() + question + END + ASSISTANT
        self.phase = "answer"
        return text
