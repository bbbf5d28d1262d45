"""The decoded frame bytes one API server holds at once, over every push in flight.

A push's decoded frames (``[T, H, W, 3]`` uint8) live from their decoding until the engine has taken the clip.
Each push reserves its bytes, read from its headers (:attr:`~.frames.PushMedia.decoded_bytes`), before the first
frame is decoded, and gives them back once its turn has been handed over (or refused); a push that does not fit
waits until enough is given back, so the API server's memory for frames stays under ``capacity`` however many
clients push at once. One push never asks for more than ``capacity`` (``--kv-stream-max-push-mb`` is checked
against ``--kv-stream-decode-mb`` at start-up, and each push against the first before it reserves).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class DecodeBudget:
    """An asyncio byte budget (made in the serving loop on first use)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a decode budget must be positive, got {capacity}")
        self.capacity = capacity
        self.used = 0
        #: The most bytes held at once so far.
        self.peak = 0
        self._changed: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` of the budget for the ``async with`` body, waiting until they fit."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes can never fit a decode budget of {self.capacity}")
        if self._changed is None:
            self._changed = asyncio.Condition()
        changed = self._changed
        async with changed:
            await changed.wait_for(lambda: self.used + nbytes <= self.capacity)
            self.used += nbytes
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            async with changed:
                self.used -= nbytes
                changed.notify_all()
