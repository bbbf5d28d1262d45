"""The open streams of one API server: the cap on how many, idle expiry, and lookups.

Streams live in the API-server process that opened them. With several API servers (``--api-server-count N``,
vLLM's default under data parallelism) a stream's id names its owner (:func:`stream_id`), and a request that
reaches another API server is forwarded to the owner (:mod:`.siblings`); admission counts every API server's
streams on every engine's pool (:mod:`.ledger`). An ended stream (closed by the engine, e.g. at its position
range) stays listed, with the reason, until it is deleted or expires, so a client learns why it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cords_vllm.config import REQUEST_OVERRIDES_KEY, KVPolicyConfig, KVPolicyConfigError
from cords_vllm.conversation.text_budget import TextBudget
from cords_vllm.conversation.transcript import Markup
from cords_vllm.integration.api_server.streams.decode_budget import DecodeBudget
from cords_vllm.integration.api_server.streams.ledger import PoolLedger, TooManyStreams
from cords_vllm.integration.api_server.streams.live import LiveStream
from cords_vllm.integration.api_server.streams.push_bounds import PushBounds
from cords_vllm.integration.api_server.streams.turn_tokens import TurnCounter
from cords_vllm.utils import cdiv

logger = logging.getLogger(__name__)

#: Removed streams whose fate is remembered for late clients.
GONE_REMEMBERED = 4096


_OWNED_ID = re.compile(r"^stream-(\d+)-[0-9a-f]{16}$")


def stream_id(owner: int) -> str:
    """A new stream id naming the API server (``owner``, its index) that holds the stream."""
    return f"stream-{owner}-{uuid.uuid4().hex[:16]}"


def owner_of(stream_id: str) -> int | None:
    """The index of the API server holding ``stream_id`` (``None``: not an id this server hands out)."""
    match = _OWNED_ID.match(stream_id)
    return int(match.group(1)) if match else None


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
    #: Largest request body (bytes), refused with 413 before it is read (``--kv-stream-max-body-mb``).
    max_body_bytes: int = 64 << 20
    #: Seconds a request body may take to arrive, else 408 (``--kv-stream-body-timeout``).
    body_timeout_s: float = 60.0
    #: Pushes decoded at once on this API server; later ones wait their turn (``--kv-stream-max-decoding``).
    max_decoding: int = 2
    #: Most decoded frame bytes one push may take, read from its headers (``--kv-stream-max-push-mb``).
    max_push_bytes: int = 256 << 20
    #: Most decoded frame bytes this API server holds at once over the pushes in flight (``--kv-stream-decode-mb``).
    max_decoded_bytes: int = 512 << 20
    #: Longest question, in characters (``--kv-stream-max-question-chars``).
    max_question_chars: int = 4096
    #: Most streams one API key may hold open; ``0``: no per-key limit (``--kv-stream-max-per-key``).
    max_streams_per_key: int = 0
    #: A stream's metadata: at most this many labels, of keys and values at most this many characters.
    max_metadata_items: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 256


class StreamNotFound(KeyError):
    """No stream with that id on this server; ``reason`` says what became of it when this server knows."""

    def __init__(self, stream_id: str, reason: str | None = None) -> None:
        super().__init__(stream_id)
        self.stream_id, self.reason = stream_id, reason

    def __str__(self) -> str:
        if self.reason:
            return f"stream {self.stream_id!r} is gone: {self.reason}"
        return f"stream {self.stream_id!r} does not exist on this server"



class StreamRegistry:
    """Open streams by id, with the cap and a background expiry task.

    ``policy`` is the server's KV policy, ``model_name`` the name answers carry, ``block_size`` the KV block
    size, ``pool_blocks`` the usable blocks of the KV pool and ``max_model_len`` the server's.

    **Admission.** Each stream is admitted with the most blocks it can ever hold (:meth:`footprint_blocks`):
    under a policy its bounded footprint (``max_text_tokens + budget + slack`` plus two blocks, the start-up
    rule's), under ``none`` a ``--max-model-len`` request. A stream that would take the open streams' total
    past the pool is refused (429), instead of being admitted and stalling every stream once the pool is full
    (vLLM does not preempt sessions that wait for their next input). So the pool is never over-committed and
    a router can place streams by :meth:`capacity`. With data parallelism each engine has its own pool: a stream
    goes to the engine with most room (its requests carry that ``data_parallel_rank``); with several API
    servers ``ledger`` is shared by all of them.

    **Text.** Under a policy that evicts video, ``count_text`` (``text -> protected tokens`` of a turn's
    prompt, see :func:`~cords_vllm.conversation.text_budget.protected_token_counter`) lets each stream refuse a
    turn that would take it past ``max_text_tokens`` before the engine would end it; ``None`` leaves that to
    the engine.
    """

    def __init__(self, engine: Any, limits: StreamLimits, *, policy: KVPolicyConfig | None = None,
                 model_name: str = "", block_size: int = 16, pool_blocks: int | None = None,
                 max_model_len: int = 1 << 30, count_text: Callable[[str], int] | None = None,
                 turn_tokens: TurnCounter | None = None,
                 ledger: PoolLedger | None = None) -> None:
        self.engine = engine
        self.limits = limits
        #: Why this server's model cannot stream (``POST /v1/streams`` answers 501 with it); ``None``: it can.
        self.unsupported: str | None = None
        #: The chat markup of the served model's family, every stream's turns are written in (``None``: ChatML).
        self.markup: Markup | None = None
        #: Whether the server authenticates clients (``--api-key`` / ``VLLM_API_KEY``): streams then belong to the
        #: key that opened them; without keys every stream has one owner.
        self.keyed = False
        self.policy = policy or KVPolicyConfig()
        self.model_name = model_name
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.count_text = count_text
        #: ``(prompt text, clip or None, clip metadata or None) -> (tokens, video tokens)`` of a turn as the engine
        #: counts them (``None``: unknown; :mod:`.turn_tokens`).
        self.turn_tokens = turn_tokens
        #: Commitments of every API server's streams on every engine's pool (``pool_blocks`` each); without one, a
        #: private ledger of one engine's pool for this server alone.
        self.ledger = ledger or PoolLedger(pool_blocks=pool_blocks, max_streams=limits.max_streams)
        self.streams: dict[str, LiveStream] = {}
        self.expired = 0
        #: Why recently removed streams went (bounded), so a late client is told "expired", not "unknown".
        self.gone: OrderedDict[str, str] = OrderedDict()
        #: The served tokenizer's control tokens as text (special and added tokens): a question holding one is
        #: refused, so a client's text never becomes a control or placeholder token of the transcript.
        self.control_texts: tuple[str, ...] = ()
        #: What one push may carry at its frame size: decoded bytes, the processor's rules, the engine's clip bound
        #: (the API server sets the last two from its model and engine).
        self.push_bounds = PushBounds(limits.max_push_bytes)
        #: Decoded frame bytes held at once over the pushes in flight on this API server.
        self.decode_budget = DecodeBudget(limits.max_decoded_bytes)
        self._reaper: asyncio.Task | None = None
        self._decoding: asyncio.Semaphore | None = None

    def footprint_blocks(self, overrides: dict[str, Any] | None = None) -> int:
        """The most KV blocks one stream (with these ``kv_policy`` overrides) can ever hold."""
        if not self.policy.enabled:
            return cdiv(self.max_model_len, self.block_size)
        return self.policy.narrowed(overrides).stream_footprint_blocks(self.max_model_len, self.block_size)

    def text_limit(self, overrides: dict[str, Any] | None = None) -> int | None:
        """The protected tokens a stream may hold, checked before each turn; ``None``: not checked here
        (``none`` evicts nothing, and a policy whose ``modalities`` leave out video protects the clips too)."""
        if not self.policy.enabled or self.count_text is None or "video" not in self.policy.modalities:
            return None
        return self.policy.narrowed(overrides).text_limit(self.max_model_len)

    @property
    def pool_blocks(self) -> int | None:
        """Usable blocks of one engine's KV pool (``None``: unknown), as the ledger admits against."""
        return self.ledger.pool_blocks

    def _ended_here(self) -> int:
        """This server's ended streams, still listed: they take a place under the cap but commit no blocks."""
        return sum(1 for s in self.streams.values() if s.ended)

    def _sync_ledger(self) -> None:
        """Ended and closed streams leave the ledger (their blocks are back, or soon will be)."""
        self.ledger.sync(sid for sid, s in self.streams.items() if not s.ended)

    def committed_blocks(self) -> int:
        """Blocks the open streams (of every API server) may hold at most, together."""
        self._sync_ledger()
        return sum(self.ledger.committed_per_engine())

    def capacity(self) -> dict[str, Any]:
        """What a router needs to place streams here: pool, committed blocks, a default stream's footprint, and
        ``available_streams``, how many more default streams this server admits now."""
        self._sync_ledger()
        footprint = self.footprint_blocks()
        commitments = self.ledger.commitments()
        committed = self.ledger.committed_per_engine(commitments)
        engines = self.ledger.engines
        open_streams = len(commitments) + self._ended_here()
        cap = self.limits.max_streams
        if self.pool_blocks:
            by_pool = engines * (self.pool_blocks // footprint)
            room = sum(max(0, self.pool_blocks - c) // footprint for c in committed)
        else:
            by_pool = room = cap
        return {"pool_blocks": None if self.pool_blocks is None else engines * self.pool_blocks,
                "committed_blocks": sum(committed), "stream_footprint_blocks": footprint,
                "max_streams": min(cap, by_pool), "open_streams": open_streams,
                "available_streams": max(0, min(cap - open_streams, room)), "engines": engines,
                "engine_pool_blocks": self.pool_blocks, "engine_committed_blocks": committed}

    def open(self, *, overrides: dict[str, Any] | None = None, owner: str | None = None, **kwargs: Any
             ) -> LiveStream:
        """A new stream of ``owner`` (the API key that opens it, hashed; ``None`` without one). Raises
        :class:`TooManyStreams` at the cap, at the per-key limit, or when no engine's pool has room, before
        anything changes."""
        per_key = self.limits.max_streams_per_key
        if per_key and owner is not None and len(self.owned_by(owner)) >= per_key:
            raise TooManyStreams(f"this API key holds {per_key} open streams, the most one key may hold "
                                 "(--kv-stream-max-per-key): close one first")
        self._sync_ledger()
        footprint = self.footprint_blocks(overrides)
        sid = stream_id(self.ledger.index)
        engine = self.ledger.admit(sid, footprint, local_open=self._ended_here())
        limit = self.text_limit(overrides)
        stream = LiveStream(self.engine, sid, extra_args={REQUEST_OVERRIDES_KEY: overrides} if overrides else None,
                            text=TextBudget(limit), count_text=self.count_text if limit is not None else None,
                            turn_tokens=self.turn_tokens, max_model_len=self.max_model_len,
                            max_clip_tokens=self.push_bounds.max_clip_tokens,
                            temporal_patch=self.push_bounds.temporal_patch,
                            engine_index=engine if self.ledger.engines > 1 else None, markup=self.markup, **kwargs)
        stream.footprint_blocks = footprint
        stream.owner = owner
        self.streams[stream.id] = stream
        self._ensure_reaper()
        return stream

    def owned_by(self, owner: str | None) -> list[LiveStream]:
        """The open streams ``owner`` may see (its own)."""
        return [s for s in list(self.streams.values()) if s.owner == owner]

    @property
    def decoding(self) -> asyncio.Semaphore:
        """Bounds the pushes decoded at once on this API server (``max_decoding``); made in the serving loop."""
        if self._decoding is None:
            self._decoding = asyncio.Semaphore(self.limits.max_decoding)
        return self._decoding

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
        self.ledger.release(stream_id)
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
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (bookkeeping only): nothing to expire from
            return
        if self._reaper is None or self._reaper.done():
            self._reaper = loop.create_task(self._reap(), name="cords-vllm stream expiry")

    async def _reap(self) -> None:
        period = min(5.0, max(0.05, self.limits.idle_timeout_s / 4))
        while self.streams:
            await asyncio.sleep(period)
            try:
                await self.expire_idle()
                self._sync_ledger()
            except Exception:  # never let expiry die silently: log and keep reaping
                logger.exception("cords-vllm: stream expiry failed")

    async def shutdown(self) -> None:
        for sid in list(self.streams):
            with contextlib.suppress(StreamNotFound):
                await self.close(sid, reason="server shutting down")
        if self._reaper is not None:
            self._reaper.cancel()
