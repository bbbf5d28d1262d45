"""The stream API's request and response bodies (pydantic models, which also make its OpenAPI schema), and the
numbers they hold to what the engine takes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: The slowest and fastest camera a stream may declare: every frame's time (``index / fps``) and what the processor
#: derives from it (Qwen2.5-VL's seconds per temporal patch, Qwen3-VL's timestamps) stay finite and in range.
MIN_FPS, MAX_FPS = 0.01, 1000.0
#: The sampling seeds the engine takes (a 64-bit generator seed, kept signed-safe).
MAX_SEED = (1 << 63) - 1
#: The largest per-stream override of a token count (the server's own settings bound it further).
MAX_OVERRIDE = 1 << 31


class KVPolicyOverrides(BaseModel):
    """Per-stream narrowing of the server's policy: each value at most the server's."""

    model_config = ConfigDict(extra="forbid")
    budget: int | None = Field(None, ge=1, le=MAX_OVERRIDE, description="video tokens kept after compression")
    recent: int | None = Field(None, ge=0, le=MAX_OVERRIDE, description="newest video tokens always kept")


class OpenStreamRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kv_policy: KVPolicyOverrides | None = None
    metadata: dict[str, str] | None = Field(None, description="free-form labels shown in listings (limits: "
                                                              "docs/streams-api.md#limits)")
    fps: float | None = Field(None, ge=MIN_FPS, le=MAX_FPS, allow_inf_nan=False,
                              description="the camera's frames per second (default 2; 0.01 to 1000): every frame's "
                                          "time, which Qwen2.5-VL's positions and Qwen3-VL's timestamps follow")


class AppendFramesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    frames: list[str | dict[str, Any]] | None = Field(
        None, description="frames as data URLs (image/jpeg or image/png), or OpenAI image parts "
                          "{'type': 'image_url', 'image_url': {'url': <data URL>}}")
    video: str | None = Field(None, description="a short clip as a data URL (video/mp4, video/jpeg, ...)")


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: str = Field(..., min_length=1)
    max_tokens: int = Field(16, ge=1, le=MAX_OVERRIDE)
    temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False


class KVHeld(BaseModel):
    blocks: int = Field(description="paged KV blocks the stream holds")
    tokens: int = Field(description="tokens whose KV the stream holds")
    stream_tokens: int = Field(description="tokens streamed so far, evicted ones included (what the stream was "
                                           "sent; under a policy its length is what it holds)")
    block_size: int


class StreamObject(BaseModel):
    id: str
    object: str = "stream"
    created: int
    model: str
    status: str = Field(description="'idle', 'busy' (a turn is running) or 'ended'")
    ended_reason: str | None = None
    frames: int
    clips: int
    questions: int
    pending_frames: int = Field(description="an odd trailing frame held back until the next push")
    fps: float = Field(description="the camera's frames per second the stream was opened with")
    idle_seconds: float
    expires_in_seconds: float | None
    kv_policy: dict[str, Any]
    footprint_blocks: int = Field(description="the most KV blocks this stream can ever hold (admission)")
    text_tokens: int = Field(description="protected (never evicted) tokens the stream holds: its text, "
                                         "questions and kept answers")
    max_text_tokens: int | None = Field(description="the most protected tokens it may hold (kv_policy_config "
                                                    "'max_text_tokens'); a push or question that could pass it "
                                                    "is refused with a 409; null: not checked")
    kv: KVHeld | None = Field(description="KV held now (published by the engine at most ~0.5 s ago); null "
                                          "before the engine has seen the stream")
    metadata: dict[str, str]


class Capacity(BaseModel):
    pool_blocks: int | None = Field(description="usable blocks of the KV pools (every data-parallel engine's)")
    committed_blocks: int = Field(description="the most blocks the open streams may hold together")
    stream_footprint_blocks: int = Field(description="the most blocks a stream with the server's policy may hold")
    max_streams: int = Field(description="streams of that footprint this server admits at once")
    open_streams: int
    available_streams: int = Field(description="streams of that footprint this server admits now (a router "
                                               "places new streams where this is positive)")
    engines: int = Field(1, description="data-parallel engines, each with its own pool; a stream lives in one")
    engine_pool_blocks: int | None = Field(None, description="usable blocks of one engine's pool")
    engine_committed_blocks: list[int] = Field(default_factory=list, description="committed blocks per engine")


class StreamList(BaseModel):
    object: str = "list"
    data: list[StreamObject]
    capacity: Capacity


class AppendFramesResponse(BaseModel):
    stream: StreamObject
    frames_received: int
    frames_sent: int = Field(description="frames the engine prefilled in this push (an odd last frame waits)")
    seconds: float = Field(description="wall time from receipt to the engine having the frames")


class StreamDeleted(BaseModel):
    id: str
    object: str = "stream.deleted"
    deleted: bool = True
    stream: StreamObject


# ------------------------------------------------------------------------------------------------------
