"""``--kv-policy`` and ``--kv-policy-config`` for ``vllm serve`` and ``EngineArgs``.

vLLM 0.32 has no hook for a plugin to add command-line flags; an unknown flag exits with status 2. This
module wraps three ``EngineArgs`` methods, once per process (idempotent):

* ``add_cli_args``: adds a "KV policy (cords-vllm)" argument group. ``--kv-policy`` takes its choices
  from the policy registry, so ``--help`` lists them and argparse rejects an unknown name.
* ``from_cli_args``: validates ``--kv-policy-config`` against the chosen policy (exits non-zero naming the
  offending key) and folds both flags into ``additional_config``, the config entry vLLM already pickles to
  the engine core and the workers.
* ``create_engine_config``: validates ``additional_config`` once more, so the ``--additional-config`` form and
  ``LLM(..., additional_config=...)`` get the same start-up errors as the flags, and applies the engine
  settings an enabled policy needs (:mod:`cords_vllm.engine.engine_args`).

With ``--kv-policy none`` (the default) nothing is added to ``additional_config``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from cords_vllm.config import (
    ADDITIONAL_CONFIG_CONFIG,
    ADDITIONAL_CONFIG_POLICY,
    ENGINE_KEYS,
    NO_POLICY,
    KVPolicyConfig,
    KVPolicyConfigError,
    available_policies,
)

_MARK = "_cords_vllm_wrapped"


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
    group.add_argument("--kv-policy", type=str, default=NO_POLICY, choices=available_policies(),
                       help="KV cache eviction policy for video requests ('none' leaves the engine untouched).")
    group.add_argument("--kv-policy-config", type=str, default=None, help=_help_text())
    return parser


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


def install() -> None:
    """Wrap ``EngineArgs`` so it knows the KV policy flags. Idempotent."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.add_cli_args, _MARK, False):
        return

    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__
    original_create = EngineArgs.create_engine_config

    @functools.wraps(original_add)
    def add_cli_args(parser):
        return add_kv_policy_args(original_add(parser))

    @functools.wraps(original_from)
    def from_cli_args(cls, args: argparse.Namespace):
        engine_args = original_from(cls, args)
        try:
            engine_args.additional_config = merge_into_additional_config(
                engine_args.additional_config, getattr(args, "kv_policy", None),
                getattr(args, "kv_policy_config", None))
        except KVPolicyConfigError as exc:
            raise SystemExit(f"error: --kv-policy / --kv-policy-config: {exc}") from None
        return engine_args

    @functools.wraps(original_create)
    def create_engine_config(self, *args, **kwargs):
        from cords_vllm.engine.engine_args import adjust_engine_args

        policy = KVPolicyConfig.from_additional_config(self.additional_config)  # raises KVPolicyConfigError
        adjust_engine_args(self, policy)
        return original_create(self, *args, **kwargs)

    for fn in (add_cli_args, from_cli_args, create_engine_config):
        setattr(fn, _MARK, True)
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
