"""The stream API as a vLLM endpoint plugin (entry-point group ``vllm.endpoint_plugins``).

vLLM 0.32 loads endpoint plugins only when ``VLLM_PLUGINS`` names them, and that variable also narrows the
*general* plugins every process loads to the same list, so it cannot be the switch of a plugin that must run
everywhere. The stream API is therefore on whenever ``--kv-policy`` is given (any policy, ``none``
included, so policies compare through the same API), and ``--kv-streams`` / ``--no-kv-streams`` force it on
or off. The patch table's wrapper of ``attach_endpoint_plugins`` (:func:`make_attach_endpoint_plugins`) adds the plugin
in ``build_app`` when vLLM's own loading did not;
``VLLM_PLUGINS=...,cords_vllm_streams`` loads it the upstream way (never twice).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from cords_vllm.config import KVPolicyConfig
from cords_vllm.conversation.text_budget import protected_token_counter
from cords_vllm.integration.api_server.header_timeout import set_header_timeout
from cords_vllm.integration.api_server.streams.api import STATE_KEY, APIError, router
from cords_vllm.integration.api_server.streams.body import BodyLimits
from cords_vllm.integration.api_server.streams.ledger import PoolLedger
from cords_vllm.integration.api_server.streams.push_bounds import PushBounds
from cords_vllm.integration.api_server.streams.registry import StreamLimits, StreamRegistry
from cords_vllm.integration.api_server.streams.siblings import LINK_KEY, SiblingLink, StreamForwarding
from cords_vllm.integration.api_server.streams.turn_tokens import engine_clip_tokens, turn_counter, video_processing
from cords_vllm.integration.engine_facts import model_facts_of
from cords_vllm.integration.handoff.published import metrics_dir
from cords_vllm.integration.startup.cli_args import api_keys
from cords_vllm.model_facts import ModelFacts

logger = logging.getLogger(__name__)

PLUGIN_NAME = "cords_vllm_streams"
#: Seconds a connection may take to send a request's headers (``--kv-stream-header-timeout``).
HEADER_TIMEOUT_S = 10.0


def streams_enabled(args: argparse.Namespace | None) -> bool:
    """``--kv-streams`` if given, else whether ``--kv-policy`` was given."""
    if args is None:
        return False
    forced = getattr(args, "kv_streams", None)
    if forced is not None:
        return bool(forced)
    return getattr(args, "kv_policy", None) is not None


def limits_from_args(args: argparse.Namespace) -> StreamLimits:
    defaults = StreamLimits()
    body_mb = getattr(args, "kv_stream_max_body_mb", None)
    per_key = getattr(args, "kv_stream_max_per_key", None)
    push_mb, decode_mb = getattr(args, "kv_stream_max_push_mb", None), getattr(args, "kv_stream_decode_mb", None)
    push_bytes = int(push_mb * (1 << 20)) if push_mb else defaults.max_push_bytes
    decoded_bytes = int(decode_mb * (1 << 20)) if decode_mb else defaults.max_decoded_bytes
    return StreamLimits(
        max_push_bytes=push_bytes, max_decoded_bytes=decoded_bytes,
        idle_timeout_s=getattr(args, "kv_stream_idle_timeout", None) or defaults.idle_timeout_s,
        max_streams=getattr(args, "kv_stream_max_open", None) or defaults.max_streams,
        max_frames_per_push=getattr(args, "kv_stream_max_frames", None) or defaults.max_frames_per_push,
        max_body_bytes=int(body_mb * (1 << 20)) if body_mb else defaults.max_body_bytes,
        body_timeout_s=getattr(args, "kv_stream_body_timeout", None) or defaults.body_timeout_s,
        max_decoding=getattr(args, "kv_stream_max_decoding", None) or defaults.max_decoding,
        max_question_chars=getattr(args, "kv_stream_max_question_chars", None) or defaults.max_question_chars,
        max_streams_per_key=per_key if per_key is not None else defaults.max_streams_per_key,
    )


class StreamsPlugin:
    """``EndpointPlugin``: the ``/v1/streams`` routes and their per-app state (the stream registry)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        app.include_router(router)
        app.add_exception_handler(APIError, lambda _request, exc: exc.response())
        app.add_middleware(StreamForwarding)  # a no-op until init_state links several API servers
        app.add_middleware(BodyLimits)  # outermost (a relayed body too); acts once init_state has the registry
        app.state.cords_vllm_app = app  # init_state gets only the state; the sibling socket serves the app

    async def init_state(self, engine_client: Any, state: Any, args: argparse.Namespace) -> None:
        if engine_client is None:  # the render-only server has no engine: the routes answer 503
            return
        vllm_config = engine_client.vllm_config
        names = getattr(args, "served_model_name", None)
        model = names[0] if names else vllm_config.model_config.model
        num_blocks = vllm_config.cache_config.num_gpu_blocks
        policy = policy_of(vllm_config, args)
        tokenizer = _tokenizer(engine_client)
        encode, facts = _encoder(tokenizer), model_facts_of(vllm_config)
        video = video_processing(vllm_config) if "video" in facts.placeholder_token_ids else None
        limits = limits_from_args(args)
        pool_blocks = num_blocks - 1 if num_blocks else None  # block 0 is the null block
        index, count, engines = api_server_place(engine_client)
        shared_dir = metrics_dir()  # private to this server's processes, inherited by each API server
        ledger = PoolLedger(engines=engines, pool_blocks=pool_blocks, max_streams=limits.max_streams,
                            directory=shared_dir, index=index, count=count)
        registry = StreamRegistry(engine_client, limits, policy=policy, model_name=model,
                                  block_size=vllm_config.cache_config.block_size,
                                  max_model_len=vllm_config.model_config.max_model_len,
                                  count_text=_text_counter(encode, facts),
                                  turn_tokens=turn_counter(encode, facts, video, tokenizer),
                                  ledger=ledger)
        registry.push_bounds = PushBounds(
            limits.max_push_bytes, max_clip_tokens=engine_clip_tokens(engine_client, registry.max_model_len),
            video_tokens=video.tokens if video is not None else None,
            temporal_patch=facts.frames_per_patch)
        registry.unsupported, registry.markup = facts.streams_unsupported, facts.chat_markup
        registry.keyed = bool(api_keys(args))
        set_header_timeout(getattr(args, "kv_stream_header_timeout", None) or HEADER_TIMEOUT_S)
        if policy.enabled and policy.compressed_layers is not None and registry.unsupported is None:
            layers = vllm_config.model_config.get_total_num_hidden_layers()
            if policy.layer_selective(layers):
                registry.unsupported = (
                    f"this server keeps attention layers {policy.compressed_layers}..{layers - 1} whole "
                    f"(kv_policy_config key 'compressed_layers'), where a live stream's KV would grow without bound; "
                    "serve streams with every layer compressed (leave compressed_layers out)")
        registry.control_texts = control_texts(tokenizer)
        setattr(state, STATE_KEY, registry)
        if count > 1:
            link = SiblingLink(index, count, shared_dir)
            await link.start(_app_of(state))
            setattr(state, LINK_KEY, link)
        if registry.unsupported is not None:
            logger.warning("cords-vllm: stream API on /v1/streams refuses new streams: %s", registry.unsupported)
            return
        capacity = registry.capacity()
        logger.info("cords-vllm: stream API on /v1/streams: idle timeout %g s; a stream holds at most %d KV "
                    "blocks, so %d streams fit the pool of %s blocks on %d engine(s) (--kv-stream-max-open %d)%s",
                    registry.limits.idle_timeout_s, capacity["stream_footprint_blocks"], capacity["max_streams"],
                    capacity["engine_pool_blocks"], engines, registry.limits.max_streams,
                    f"; admission shared by {count} API servers" if count > 1 else "")


def policy_of(vllm_config: Any, args: argparse.Namespace | None) -> KVPolicyConfig:
    """The policy this API server's engine config carries, which must be the one its flags name.

    Raises ``RuntimeError`` when ``--kv-policy`` names a policy the config lacks (an API server process whose
    ``EngineArgs`` were built without the plugin's flag folding): sized as uncompressed, its streams would be
    refused or admitted on another server's terms, so it does not start."""
    policy = KVPolicyConfig.from_vllm_config(vllm_config)
    flag = getattr(args, "kv_policy", None)
    if flag not in (None, "none") and flag != policy.policy:
        raise RuntimeError(
            f"cords-vllm: this API server was started with --kv-policy {flag} but its engine config carries "
            f"kv_policy {policy.policy!r}: the policy did not reach this process, and its streams would be admitted "
            "and sized under another policy than the engine's")
    return policy


def api_server_place(engine_client: Any) -> tuple[int, int, int]:
    """``(index, count, engines)``: this API server's index among the server's API servers, their number, and
    the data-parallel engines its client places requests on (vLLM's ``AsyncLLM`` client attributes)."""
    core = getattr(engine_client, "engine_core", None)
    index = int(getattr(core, "client_index", 0) or 0)
    count = int(getattr(engine_client, "_client_count", None) or getattr(core, "client_count", 1) or 1)
    engines = len(getattr(core, "core_engines", None) or [None])
    return index, max(count, 1), max(engines, 1)


def _app_of(state: Any) -> Any:
    """The FastAPI app whose ``state`` this is (Starlette's ``State`` keeps no back-reference)."""
    app = getattr(state, "cords_vllm_app", None)
    if app is None:
        raise RuntimeError("the stream API's app was not recorded at attach time")
    return app


def _tokenizer(engine_client: Any) -> Any:
    """The served model's tokenizer, or ``None`` without one (e.g. ``--skip-tokenizer-init``)."""
    try:
        return engine_client.get_tokenizer()
    except Exception:  # e.g. --skip-tokenizer-init
        return None


def control_texts(tokenizer: Any) -> tuple[str, ...]:
    """The text of the tokenizer's special and added tokens (``<|im_end|>``, ``<|video_pad|>``, ``<video>``...),
    longest first: the texts a question may not hold. Plain-word added tokens are left out."""
    if tokenizer is None:
        return ()
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    texts |= {getattr(t, "content", str(t)) for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    return tuple(sorted((t for t in texts if t and not t.replace("_", "").isalnum() and not t.isspace()),
                        key=lambda t: (-len(t), t)))


def _encoder(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """``text -> token ids`` with the served model's tokenizer (no special tokens added), or ``None`` without one."""
    if tokenizer is None:
        return None
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _text_counter(encode: Callable[[str], list[int]] | None, facts: ModelFacts) -> Callable[[str], int] | None:
    """``text -> protected tokens`` of a stream turn's prompt: every token but the candidates' placeholders and
    vision markers, which the engine evicts with the clip (the same :class:`~cords_vllm.model_facts.ModelFacts` the
    scheduler reads); ``None`` without a tokenizer or a video placeholder: the engine alone enforces the text
    limit."""
    if encode is None or "video" not in facts.placeholder_token_ids:
        logger.warning("cords-vllm: no tokenizer or video token id: streams past max_text_tokens are ended by "
                       "the engine instead of refused")
        return None
    return protected_token_counter(encode, facts.candidate_token_ids(("video",)))


def make_attach_endpoint_plugins(original: Callable) -> Callable:
    def attach_endpoint_plugins(app, supported_tasks, *args, **kwargs):
        original(app, supported_tasks, *args, **kwargs)
        plugins = list(getattr(app.state, "endpoint_plugins", None) or [])
        if not streams_enabled(getattr(app.state, "args", None)) or "generate" not in (supported_tasks or ()):
            return
        if any(getattr(p, "name", None) == PLUGIN_NAME for p in plugins):
            return
        plugin = StreamsPlugin()
        plugin.attach_router(app)
        app.state.endpoint_plugins = [*plugins, plugin]
        app.openapi_schema = None
    return attach_endpoint_plugins
