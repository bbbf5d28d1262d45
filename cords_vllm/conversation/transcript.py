"""The text of each turn of a live stream, in the chat markup of the served model's family.

A stream is one conversation the engine keeps as a single resumable request: the system prompt, then a user
message made of clips, a question, the assistant's answer, more clips, and so on. Each turn appends the text
that continues the conversation; the engine discards the last token a turn samples (an answer's end-of-turn
token, or the one token a video push generates), so a turn after an answer first closes it.

Each family writes this conversation in its own chat markup (:class:`Markup`), as its HF chat template renders
it: the Qwen-VL families in ChatML (:data:`CHATML`), LLaVA-NeXT-Video as ``USER: <video>\\n... ASSISTANT:``
(:data:`LLAVA`). :func:`markup_for` picks it from the model's type.

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


@dataclass(frozen=True)
class Markup:
    """One family's chat markup, as the pieces a stream's turns are made of.

    Attributes
    ----------
    name:
        Short name (``"chatml"``, ``"llava"``).
    system:
        The system prompt, written once before the first user message (``""``: none).
    user:
        Opens a user message.
    reopen:
        Opens a user message right after an answer whose end-of-turn token the engine discarded.
    clip:
        One clip: the video placeholder the engine expands to the clip's video tokens, with what the template
        writes around it.
    ask:
        Follows a question: closes the user message and opens the assistant's answer.
    """

    name: str
    system: str
    user: str
    reopen: str
    clip: str
    ask: str


#: The Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ChatML, each clip ``<|vision_start|><|video_pad|>
#: <|vision_end|>``.
CHATML = Markup("chatml", system=SYSTEM, user=USER, reopen=END + USER, clip=VIDEO, ask=END + ASSISTANT)

#: LLaVA-NeXT-Video, as its chat template renders a conversation: ``USER: `` then each video as ``<video>\n``,
#: then the text followed by a space, then ``ASSISTANT:``; an answer is followed by a space and the next
#: ``USER: ``. No system prompt (the released template writes none of its own).
LLAVA = Markup("llava", system="", user="USER: ", reopen=" USER: ", clip="<video>\n", ask=" ASSISTANT:")

#: HF ``model_type`` -> its markup (the Qwen-VL families are found by their vision markers instead).
_BY_MODEL_TYPE = {"llava_next_video": LLAVA}


def markup_for(model_type: str, has_vision_markers: bool) -> Markup | None:
    """The chat markup of a model (``None``: the stream API knows none for it).

    ``has_vision_markers``: the model frames every input with ``<|vision_start|>`` / ``<|vision_end|>`` tokens
    (the Qwen-VL families' ChatML).
    """
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    return CHATML if has_vision_markers else None


@dataclass
class Transcript:
    """Where the conversation stands, and the text the next turn appends.

    ``markup``: the family's chat markup; ``phase``: ``"start"`` (nothing sent), ``"user"`` (inside a user
    message), ``"answer"`` (after an assistant answer, whose end token the engine discarded).
    """

    markup: Markup = CHATML
    phase: Phase = "start"

    def _open_user(self) -> str:
        if self.phase == "start":
            return self.markup.system + self.markup.user
        if self.phase == "answer":
            return self.markup.reopen
        return ""

    def clip(self) -> str:
        """Text of a turn that appends one clip."""
        text = self._open_user() + self.markup.clip
        self.phase = "user"
        return text

    def question(self, question: str) -> str:
        """Text of a turn that asks ``question`` and opens the assistant's answer."""
        text = self._open_user() + question + self.markup.ask
        self.phase = "answer"
        return text
