"""What the served model and its engine take in one push, checked on the push's headers before it is decoded.

A push becomes one clip, one video item of one engine request. Three rules decide whether that clip can run, and
each is known from the frame count and size alone (:class:`~.frames.PushMedia`), before a frame is decoded:

* **The model's processor.** It refuses some frame shapes outright, e.g. Qwen2-VL's ``smart_resize`` an aspect
  ratio of 200 or more. It is asked for the tokens of one temporal patch at the push's size
  (``video_tokens``); a refusal is a 400 naming the frame, where the engine would have refused the turn and a
  held-back odd frame would have broken the stream's next turns.
* **Decoded bytes.** ``frames x width x height x 3`` at most ``max_push_bytes`` (413).
* **The engine's clip bound.** vLLM refuses a video item with more embedding tokens than its encoder cache
  holds (``InputProcessor.mm_encoder_cache_size``: the larger of ``--max-num-batched-tokens`` and the model's
  largest item, and the encoder's per-step compute budget is the same number under vLLM's defaults), and a turn
  longer than ``--max-model-len``; refused there, the stream's request ends. The clip's video tokens, the
  frame held back from the previous push included, are at most ``max_clip_tokens`` (413).

A refusal says the largest frame count that fits at that size. Pure: the callables come from the API server
(:mod:`.turn_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cords_vllm.integration.api_server.streams.frames import FrameError, PushMedia

#: ``(width, height, frames) -> video tokens`` of one clip; raises ``ValueError`` for frames the processor refuses.
VideoTokens = Callable[[int, int, int], int]


@dataclass(frozen=True)
class PushBounds:
    """The per-push rules of one server (see the module docstring)."""

    #: Most decoded bytes of one push.
    max_push_bytes: int
    #: Most video tokens of one clip the engine takes (``None``: not known, not checked here).
    max_clip_tokens: int | None = None
    #: The served model's video token count (``None``: no processor rule or clip bound is checked here).
    video_tokens: VideoTokens | None = None
    #: Frames per temporal patch (the served model's :attr:`~cords_vllm.model_facts.ModelFacts.frames_per_patch`;
    #: 2, the Qwen-VL families', where none is given): a clip holds whole patches, and an odd frame waits for the
    #: next push.
    temporal_patch: int = 2

    def check(self, media: PushMedia, held: int = 0) -> None:
        """Raise :class:`~.frames.FrameError` if the push cannot run; ``held``: frames of the same size held back
        from the previous push, which lead this push's clip."""
        per_patch = self._patch_tokens(media)
        size = f"{media.width}x{media.height}"
        frame_bytes = media.width * media.height * 3
        by_bytes = self.max_push_bytes // frame_bytes
        if media.decoded_bytes > self.max_push_bytes:
            raise FrameError(media.field, f"{media.count} frames of {size} decode to {media.decoded_bytes} bytes; "
                                          f"at most {self.max_push_bytes} a push (--kv-stream-max-push-mb): at most "
                                          f"{by_bytes} frames of this size", 413)
        if per_patch is None or self.max_clip_tokens is None:
            return
        whole = (held + media.count) // self.temporal_patch * self.temporal_patch
        # one patch past the bound: even a lone frame, held back, would fail the turn that shows it
        tokens = self._tokens(media, max(whole, self.temporal_patch))
        if tokens > self.max_clip_tokens:
            fit = self._clip_fit(per_patch, held)
            raise FrameError(media.field, f"{media.count} frames of {size}"
                                          + (f" (after {held} held back from the last push)" if held else "")
                                          + f" make one clip of {tokens} video tokens; the engine takes at most "
                                          f"{self.max_clip_tokens} in one clip (its encoder cache and "
                                          f"--max-model-len): at most {min(fit, by_bytes)} frames of this size "
                                          "in one push", 413)

    def largest_push(self, width: int, height: int, held: int = 0) -> int | None:
        """The most frames of ``width x height`` one push may carry under the bytes and clip bounds (``None``: the
        processor refuses that size)."""
        media = PushMedia("frames", 1, width, height)
        try:
            per_patch = self._patch_tokens(media)
        except FrameError:
            return None
        fit = self.max_push_bytes // (width * height * 3)
        if per_patch is not None and self.max_clip_tokens is not None:
            fit = min(fit, self._clip_fit(per_patch, held))
        return fit

    def _clip_fit(self, per_patch: int, held: int) -> int:
        """The most frames a push may carry under the clip bound: whole patches up to the bound, the ``held``
        frames leading them, and one odd frame to hold back for the next push (none when not even one patch
        fits)."""
        patches = self.max_clip_tokens // per_patch if self.max_clip_tokens is not None else 0
        if patches == 0:
            return 0
        return (patches + 1) * self.temporal_patch - 1 - held

    def _patch_tokens(self, media: PushMedia) -> int | None:
        if self.video_tokens is None:
            return None
        tokens = self._tokens(media, self.temporal_patch)
        return max(tokens, 1)

    def _tokens(self, media: PushMedia, frames: int) -> int:
        assert self.video_tokens is not None
        try:
            return int(self.video_tokens(media.width, media.height, frames))
        except (ValueError, ZeroDivisionError, OverflowError) as exc:
            field = media.images[0][1] if media.field == "frames" and media.images else media.field
            raise FrameError(field, f"the model's processor refuses frames of {media.width}x{media.height}: "
                                    f"{str(exc)[:200]}") from None
