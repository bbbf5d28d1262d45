"""The exact prompt of the video-QA task, as a server renders it through the model's chat template.

The shipped checkpoint's chat template is the standard Qwen2-VL one (it adds the default system prompt when
the conversation has none). A chat request with one user message whose content is a video part followed by
a text part,

.. code-block:: python

    [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": ...}},
                                  {"type": "text", "text": question}]}]

renders to :data:`PROMPT_TEMPLATE` with ``add_generation_prompt=True``; the model was trained on exactly that
text (with ``<|video_pad|>`` expanded to the video's tokens) and answers with one token. Offline
``LLM.generate`` must be sent :func:`build_prompt` (one ``<|video_pad|>``; vLLM expands it).
"""

from __future__ import annotations

from typing import Any

VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
#: How a request carries the video: one video input, or every frame as its own image (as lmms-eval's and
#: VLMEvalKit's API clients send it).
INPUT_SHAPES = ("video", "images")

#: The raw prompt; ``{question}`` is the family's question.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n" + VIDEO_PLACEHOLDER + "{question}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def build_prompt(question: str, images: int | None = None) -> str:
    """The raw prompt for ``question`` with a single ``<|video_pad|>`` (what ``LLM.generate`` takes), or with
    ``images`` image placeholders instead (the frames sent as images; the model answers those as well)."""
    prompt = PROMPT_TEMPLATE.format(question=question)
    return prompt if images is None else prompt.replace(VIDEO_PLACEHOLDER, IMAGE_PLACEHOLDER * images)


def chat_messages(question: str, video: Any | None = None, images: list[str] | None = None
                  ) -> list[dict[str, Any]]:
    """Chat messages that the chat template renders to :func:`build_prompt`.

    ``video`` is the content part's payload: ``None`` gives the HF-processor form ``{"type": "video"}``;
    a string is taken as a URL and gives the OpenAI form ``{"type": "video_url", "video_url": {"url": ...}}``
    (e.g. a ``data:video/jpeg;base64,...`` URL for ``/v1/chat/completions``). ``images``: URLs of the frames
    sent as ``image_url`` parts instead of the video (rendered to ``build_prompt(question, len(images))``).
    """
    if images is not None:
        parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]
    part = {"type": "video"} if video is None else {"type": "video_url", "video_url": {"url": str(video)}}
    return [{"role": "user", "content": [part, {"type": "text", "text": question}]}]
