"""The open streams of one API server: the cap on how many, idle expiry, and lookups.

Streams live in the API-server process that opened them (with ``--api-server-count N`` each server has its
own streams; a client keeps talking to the server that opened its stream, e.g. through a sticky load
balancer). An ended stream (closed by the engine, e.g. at ``--max-model-len``) stays listed, with the reason,
until it is deleted or expires, so a client learns why it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cords_vllm.config import REQUEST_OVERRIDES_KEY, KVPolicyConfig, KVPolicyConfigError
from cords_vllm.streams.live import LiveStream

logger = logging.getLogger(__name__)

#: Removed streams whose fate is remembered for late clients.
GONE_REMEMBERED = 4096


@dataclass(frozen=True)
class StreamLimits:
    """Server-side limits of the stream API (``vllm serve`` flags ``--kv-stream-*``)."""

    #: Seconds a stream may stay idle (no request, no running turn) before it expires and frees its KV.
    idle_timeout_s: float = 300.0
    #: Most streams open at once on this API server.
    max_streams: int = 64
    #: Most frames one append may carry.
    max_frames_per_push: int = 256
    #: Most tokens an answer may generate.
    max_answer_tokens: int = 512
    #: Smallest frame side (pixels) and largest frame (pixels).
    min_frame_side: int = 28
    max_frame_pixels: int = 1920 * 1080


class StreamNotFound(KeyError):
    """No stream with that id on this server; ``reason`` says what became of it when this server knows."""

    def __init__(self, stream_id: str, reason: str | None = None) -> None:
        super().__init__(stream_id)
        self.stream_id, self.reason = stream_id, reason

    def __str__(self) -> str:
        if self.reason:
            return f"stream {self.stream_id!r} is gone: {self.reason}"
        return f"stream {self.stream_id!r} does not exist on this server"


class TooManyStreams(RuntimeError):
    """The server's cap on open streams is reached."""


class StreamRegistry:
    """Open streams by id, with the cap and a background expiry task.

    ``policy`` is the server's KV policy, ``model_name`` the name answers carry, ``block_size`` the KV block
    size (for listings).
    """

    overrides_key = REQUEST_OVERRIDES_KEY

    def __init__(self, engine: Any, limits: StreamLimits, *, policy: KVPolicyConfig | None = None,
                 model_name: str = "", block_size: int = 0) -> None:
        self.engine = engine
        self.limits = limits
        self.policy = policy or KVPolicyConfig()
        self.model_name = model_name
        self.block_size = block_size
        self.streams: dict[str, LiveStream] = {}
        self.expired = 0
        #: Why recently removed streams went (bounded), so a late client is told "expired", not "unknown".
        self.gone: OrderedDict[str, str] = OrderedDict()
        self._reaper: asyncio.Task | None = None

    def open(self, **kwargs: Any) -> LiveStream:
        """A new stream (raises :class:`TooManyStreams` at the cap)."""
        if len(self.streams) >= self.limits.max_streams:
            raise TooManyStreams(f"{len(self.streams)} streams are open, the most this server allows "
                                 f"(--kv-stream-max-open {self.limits.max_streams}); close one or wait for one to "
                                 f"expire")
        stream = LiveStream(self.engine, **kwargs)
        self.streams[stream.id] = stream
        self._ensure_reaper()
        return stream

    def check_overrides(self, overrides: dict[str, Any]) -> tuple[str, str] | None:
        """``(key, message)`` when a stream's ``kv_policy`` overrides are not allowed here, else ``None``."""
        if not self.policy.enabled:
            return next(iter(overrides)), "the server runs --kv-policy none: there is no budget to narrow"
        try:
            self.policy.narrowed(overrides)
        except KVPolicyConfigError as exc:
            return exc.key or next(iter(overrides)), str(exc)
        return None

    def policy_of(self, stream: LiveStream) -> dict[str, Any]:
        """The policy the stream runs under (the server's, narrowed by its overrides)."""
        if not self.policy.enabled:
            return {"policy": self.policy.policy}
        overrides = (stream.extra_args or {}).get(REQUEST_OVERRIDES_KEY)
        policy = self.policy.narrowed(overrides)
        return {"policy": policy.policy, "budget": policy.budget, "recent": policy.recent, "slack": policy.slack}

    def get(self, stream_id: str) -> LiveStream:
        stream = self.streams.get(stream_id)
        if stream is None:
            raise StreamNotFound(stream_id, self.gone.get(stream_id))
        return stream

    async def close(self, stream_id: str, reason: str = "closed") -> LiveStream:
        """Remove the stream and end its engine request (every KV block is freed)."""
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            raise StreamNotFound(stream_id, self.gone.get(stream_id))
        self.gone[stream_id] = stream.ended or reason
        while len(self.gone) > GONE_REMEMBERED:
            self.gone.popitem(last=False)
        await stream.close(reason)
        return stream

    async def expire_idle(self) -> list[str]:
        """Close every stream idle for longer than the timeout; returns their ids."""
        timeout = self.limits.idle_timeout_s
        idle = [sid for sid, s in self.streams.items() if s.idle_seconds() > timeout]
        for sid in idle:
            with contextlib.suppress(StreamNotFound):
                await self.close(sid, reason=f"expired after {timeout:g} s idle")
                self.expired += 1
                logger.info("cords-vllm: stream %s expired after %g s idle; its KV is freed", sid, timeout)
        return idle

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap(), name="cords-vllm stream expiry")

    async def _reap(self) -> None:
        period = min(5.0, max(0.05, self.limits.idle_timeout_s / 4))
        while self.streams:
            await asyncio.sleep(period)
            try:
                await self.expire_idle()
            except Exception:  # never let expiry die silently: log and keep reaping
                logger.exception("cords-vllm: stream expiry failed")

    async def shutdown(self) -> None:
        for sid in list(self.streams):
            with contextlib.suppress(StreamNotFound):
                await self.close(sid, reason="server shutting down")
        if self._reaper is not None:
            self._reaper.cancel()
