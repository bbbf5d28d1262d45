"""``--kv-policy`` and ``--kv-policy-config`` for ``vllm serve`` and ``EngineArgs``.

vLLM 0.32 has no hook for a plugin to add command-line flags; an unknown flag exits with status 2. The
patch table (:mod:`cords_vllm.integration.patch.table`) wraps three ``EngineArgs`` methods with these wrappers:

* ``add_cli_args``: adds a "KV policy (cords-vllm)" argument group. ``--kv-policy`` takes its choices
  from the policy registry, so ``--help`` lists them and argparse rejects an unknown name.
* ``from_cli_args``: validates ``--kv-policy-config`` against the chosen policy (exits non-zero naming the
  offending key) and folds both flags into ``additional_config``, the config entry vLLM already pickles to
  the engine core and the workers.
* ``create_engine_config``: validates ``additional_config`` once more, so the ``--additional-config`` form and
  ``LLM(..., additional_config=...)`` get the same start-up errors as the flags, applies the engine
  settings an enabled policy needs (:mod:`cords_vllm.integration.startup.engine_args`), checks the policy against the
  model in the ``VllmConfig`` vLLM built (:mod:`cords_vllm.integration.startup.checks`), and logs one INFO line naming
  the policy, every setting in force and every engine setting it changed. It also announces the policy to the
  engine processes vLLM is about to start (:mod:`cords_vllm.integration.handoff.engine_policy`).

With ``--kv-policy none`` (the default) nothing is added to ``additional_config``. The ``--kv-stream*`` flags
configure the stream API (:mod:`cords_vllm.integration.api_server.streams`), which runs in the API server and reads them
from the server's arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from collections.abc import Callable
from typing import Any

from cords_vllm.compress.layer_scope import describe as describe_layer_scope
from cords_vllm.config import (
    ADDITIONAL_CONFIG_CONFIG,
    ADDITIONAL_CONFIG_POLICY,
    ENGINE_KEYS,
    KVPolicyConfig,
    KVPolicyConfigError,
    available_policies,
)
from cords_vllm.integration.handoff import engine_policy
from cords_vllm.integration.startup.checks import (
    EngineFacts,
    check_engine,
    check_engine_settings,
    pipeline_change,
    ubatching_flag,
)
from cords_vllm.integration.startup.engine_args import adjust_engine_args

logger = logging.getLogger(__name__)


def _help_text() -> str:
    keys = "; ".join(f"{k}: {v}" for k, v in ENGINE_KEYS.items())
    return (
        "JSON object configuring --kv-policy. Engine keys: " + keys + ". Any other key is a "
        "hyper-parameter of the chosen policy (e.g. alpha, eta, lam for cords) and is validated by it."
    )


def add_kv_policy_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the KV policy argument group to ``parser`` (no-op if it is already there)."""
    if any(getattr(a, "dest", None) == "kv_policy" for a in parser._actions):
        return parser
    group = parser.add_argument_group(
        title="KV policy (cords-vllm)",
        description="Compress each video request's paged KV cache while it is prefilled.",
    )
    group.add_argument("--kv-policy", type=str, default=None, choices=available_policies(),
                       help="KV cache eviction policy for video requests ('none', the default, leaves the engine "
                            "untouched). Giving it (any policy, 'none' included) also turns on the stream API.")
    group.add_argument("--kv-policy-config", type=str, default=None, help=_help_text())
    group.add_argument("--kv-streams", action=argparse.BooleanOptionalAction, default=None,
                       help="Serve the live video stream API (/v1/streams). Default: on when --kv-policy is given.")
    group.add_argument("--kv-stream-idle-timeout", type=_positive(float), default=300.0, metavar="SECONDS",
                       help="Seconds a stream may stay idle before it expires and its KV is freed (default 300).")
    group.add_argument("--kv-stream-max-open", type=_positive(int), default=64, metavar="N",
                       help="Most streams open at once on one API server (default 64).")
    group.add_argument("--kv-stream-max-frames", type=_positive(int), default=256, metavar="N",
                       help="Most frames one append may carry (default 256); counted before any is decoded (413).")
    group.add_argument("--kv-stream-max-body-mb", type=_positive(float), default=64.0, metavar="MB",
                       help="Largest request body of the stream API, in MiB (default 64): refused with 413 before "
                            "it is read.")
    group.add_argument("--kv-stream-body-timeout", type=_positive(float), default=60.0, metavar="SECONDS",
                       help="Seconds a stream request's body may take to arrive (default 60), else 408.")
    group.add_argument("--kv-stream-header-timeout", type=_positive(float), default=10.0, metavar="SECONDS",
                       help="Seconds a connection may take to send a request's headers (default 10), else 408 and "
                            "the connection is closed (the whole API server, while the stream API is on).")
    group.add_argument("--kv-stream-max-decoding", type=_positive(int), default=2, metavar="N",
                       help="Pushes decoded at once on one API server (default 2); later ones wait their turn.")
    group.add_argument("--kv-stream-max-push-mb", type=_positive(float), default=256.0, metavar="MB",
                       help="Most decoded frame bytes one push may take (width x height x 3 x frames, read from the "
                            "headers before decoding; default 256), else 413.")
    group.add_argument("--kv-stream-decode-mb", type=_positive(float), default=512.0, metavar="MB",
                       help="Most decoded frame bytes one API server holds at once, over every push being decoded "
                            "or handed to the engine (default 512; at least --kv-stream-max-push-mb); later pushes "
                            "wait their turn.")
    group.add_argument("--kv-stream-max-question-chars", type=_positive(int), default=4096, metavar="N",
                       help="Longest question one ask may carry, in characters (default 4096), else 413.")
    group.add_argument("--kv-stream-max-per-key", type=_non_negative(int), default=0, metavar="N",
                       help="Most streams one API key may hold open (default 0: no per-key limit), else 429.")
    return parser


def _positive(kind: type) -> Callable[[str], Any]:
    return _bounded(kind, strict=True)


def _non_negative(kind: type) -> Callable[[str], Any]:
    return _bounded(kind, strict=False)


def _bounded(kind: type, *, strict: bool) -> Callable[[str], Any]:
    """An argparse type: a finite ``kind`` above 0 (``strict``) or at least 0."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (strict and value == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if strict else '>='} 0, got {text}")
        return value
    return parse


def merge_into_additional_config(additional_config: dict[str, Any] | None, policy: str | None,
                                 config: str | None) -> dict[str, Any]:
    """Validate the flags and return ``additional_config`` with the policy entries set.

    Raises :class:`KVPolicyConfigError` on an invalid policy or configuration, and when the flags and an
    ``--additional-config`` entry disagree.
    """
    out = dict(additional_config or {})
    parsed = KVPolicyConfig.parse(policy, config)
    if not parsed.enabled:
        return out
    if out.get(ADDITIONAL_CONFIG_POLICY, policy) != policy:
        raise KVPolicyConfigError(
            f"--kv-policy {policy} conflicts with --additional-config kv_policy="
            f"{out[ADDITIONAL_CONFIG_POLICY]!r}; give the policy once"
        )
    out[ADDITIONAL_CONFIG_POLICY] = policy
    out[ADDITIONAL_CONFIG_CONFIG] = parsed.to_json()
    return out


def startup_line(policy: KVPolicyConfig, changes: list[str]) -> str:
    """The one start-up log line: the policy, every setting in force and the engine settings it changed."""
    settings = json.dumps(policy.settings(), default=str)
    return (f"cords-vllm: --kv-policy {policy.policy} --kv-policy-config '{settings}'; engine settings changed: "
            f"{'; '.join(changes) or 'none'}")


def checked_engine_config(engine_args: Any, create: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``create(engine_args, ...)`` (vLLM's ``create_engine_config``) with the KV policy applied and checked.

    Raises :class:`KVPolicyConfigError` for an invalid policy or one the model cannot serve.
    """
    policy = KVPolicyConfig.from_additional_config(engine_args.additional_config)
    # before vLLM starts this engine's processes, which inherit it (and install the policy's hooks or none)
    engine_policy.announce(policy.policy if policy.enabled else "none")
    changes = adjust_engine_args(engine_args, policy)
    if policy.enabled:
        # As asked for, before vLLM or the platform adjusts it (vLLM's CPU build turns DBO off by itself): a setting
        # the policy does not support is refused on every platform alike, naming the flag.
        check_engine_settings(policy.policy, ubatching_flag(engine_args), None)
    vllm_config = create(engine_args, *args, **kwargs)
    if policy.enabled:
        facts = EngineFacts.from_vllm_config(vllm_config)
        check_engine(policy, facts)
        if (change := pipeline_change(policy, facts.stages)) is not None:
            changes.append(change)
        if policy.layer_selective(facts.num_layers):
            changes.append(describe_layer_scope(policy.compressed_layers, facts.num_layers))
        if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
            changes.append("prefix caching only for the requests the policy never compresses (text, videos within "
                           "budget + slack; the others neither read nor fill it: their blocks are rewritten in "
                           "place)")
        # once per server: the process that starts the engine logs it, not each of several API servers it spawns
        level = logging.INFO if _starts_the_engine(engine_args) else logging.DEBUG
        logger.log(level, "%s", startup_line(policy, changes))
    return vllm_config


def _starts_the_engine(engine_args: Any) -> bool:
    """Whether this ``create_engine_config`` is the one of the process that starts the engine: not one of several
    API servers (vLLM gives them a rank ``0..N-1`` of ``N``; the process that spawned them has rank ``-1``)."""
    count = getattr(engine_args, "_api_process_count", 1) or 1
    return count <= 1 or getattr(engine_args, "_api_process_rank", 0) < 0


def make_add_cli_args(original: Callable) -> Callable:
    def add_cli_args(parser):
        return add_kv_policy_args(original(parser))
    return add_cli_args


def make_from_cli_args(original: Callable) -> Callable:
    def from_cli_args(cls, args: argparse.Namespace):
        engine_args = original(cls, args)
        try:
            engine_args.additional_config = merge_into_additional_config(
                engine_args.additional_config, getattr(args, "kv_policy", None),
                getattr(args, "kv_policy_config", None))
        except KVPolicyConfigError as exc:
            raise SystemExit(f"error: --kv-policy / --kv-policy-config: {exc}") from None
        carry_to_spawned_api_servers(args, engine_args.additional_config)
        if (problem := stream_flags_problem(args)) is not None:
            raise SystemExit(f"error: {problem}")
        return engine_args
    return from_cli_args


def stream_flags_problem(args: argparse.Namespace) -> str | None:
    """Why the ``--kv-stream-*`` flags cannot hold together on this server, or ``None``."""
    push_mb, decode_mb = getattr(args, "kv_stream_max_push_mb", None), getattr(args, "kv_stream_decode_mb", None)
    if push_mb is not None and decode_mb is not None and decode_mb < push_mb:
        return (f"--kv-stream-decode-mb ({decode_mb:g}) is less than --kv-stream-max-push-mb ({push_mb:g}): "
                "a push of the largest size allowed could never be decoded")
    if getattr(args, "kv_stream_max_per_key", 0) and not api_keys(args):
        return ("--kv-stream-max-per-key caps the streams of each API key, and this server has none (--api-key or "
                "VLLM_API_KEY): without keys every stream has one owner; cap the streams with --kv-stream-max-open")
    return None


def api_keys(args: argparse.Namespace | None) -> list[str]:
    """The API keys the server authenticates clients with: ``--api-key``, else ``VLLM_API_KEY`` (vLLM's rule)."""
    keys = list(getattr(args, "api_key", None) or []) or [os.environ.get("VLLM_API_KEY", "")]
    return [key for key in keys if key]


def carry_to_spawned_api_servers(args: argparse.Namespace, additional_config: dict[str, Any] | None) -> None:
    """Write the folded ``additional_config`` back into the parsed arguments.

    With several API servers (``--api-server-count N``, and ``--data-parallel-size N``, which defaults to N of
    them) vLLM 0.32 spawns each from the parsed ``Namespace``, and each builds its own ``EngineArgs`` with
    ``from_cli_args`` *before* anything in that process has loaded the plugin: vLLM's original method runs there,
    and only the ``additional_config`` it copies from the namespace can carry the policy. Without this, every
    spawned API server saw ``--kv-policy none`` and sized streams uncompressed. Folding again is idempotent.
    """
    if additional_config:
        args.additional_config = dict(additional_config)


def make_create_engine_config(original: Callable) -> Callable:
    def create_engine_config(self, *args, **kwargs):
        return checked_engine_config(self, original, *args, **kwargs)
    return create_engine_config
