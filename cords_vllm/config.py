"""The KV policy configuration: one typed, validated object built once at start-up.

Users set it with ``--kv-policy NAME --kv-policy-config JSON`` on ``vllm serve``, or with
``additional_config={"kv_policy": NAME, "kv_policy_config": {...}}`` (``--additional-config`` on the command
line, ``LLM(..., additional_config=...)`` offline; :func:`kv_policy_args` builds it). The command-line flags
are folded into that same ``additional_config`` entry, which vLLM pickles into ``VllmConfig`` for the engine
core and the workers, so every process parses the same JSON with :meth:`KVPolicyConfig.from_additional_config`.

``kv_policy_config`` is a flat JSON object. Engine keys (:data:`ENGINE_KEYS`) say how much of a video is
kept and on which layers selection runs; every other key is a hyper-parameter of the chosen selector
(e.g. ``alpha`` for ``cords``) and is validated by the selector itself. Unknown keys and out-of-range values
raise :class:`KVPolicyConfigError`, whose message names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cords_vllm.compress.layer_scope import scope_problem
from cords_vllm.compress.plan import BudgetSettings, stream_footprint_blocks
from cords_vllm.compress.unit_choice import AUTO, DEFAULT_MIN_UNITS
from cords_vllm.kernel_backend import CHOICES as KERNEL_CHOICES
from cords_vllm.kernel_backend import requested as requested_kernels
from cords_vllm.selection import available_selectors, get_selector, selector_class, selector_params
from cords_vllm.selection.base import GRANULARITIES

#: The policy that leaves the engine untouched.
NO_POLICY = "none"
ADDITIONAL_CONFIG_POLICY = "kv_policy"
ADDITIONAL_CONFIG_CONFIG = "kv_policy_config"
#: Multimodal inputs whose tokens can be candidates for eviction (vLLM's modality names).
MODALITIES = ("image", "video")
#: Protected (non-candidate) tokens a request may hold under a policy unless ``max_text_tokens`` says otherwise.
DEFAULT_MAX_TEXT_TOKENS = 8192

#: Engine keys of ``kv_policy_config``, with their meaning (also the configuration reference in --help).
ENGINE_KEYS: dict[str, str] = {
    "budget": "video tokens a request holds after compression: kept old tokens + recent window (int > 0; "
              "default 2048)",
    "recent": "most recent video tokens always kept (int, 0 <= recent < budget; default budget // 4)",
    "slack": "extra video tokens allowed above budget before compressing again, so compression does not "
             "run every chunk (int >= 0; default budget // 4)",
    "granularity": "selection unit: 'auto' (each compression selects runs of consecutive video tokens, as wide "
                   "as keeps at least min_units of them: whole frames when the budget allows, single tokens when "
                   "it is tight), 'frame' (centroid of a video frame's tokens, as in the paper; needs the model's "
                   "frames: M-RoPE positions or a known placeholder layout), 'token', or 'block' (centroid of a "
                   "paged KV block's tokens) (default 'auto')",
    "min_units": "under granularity 'auto', the fewest units (frames, runs of tokens or tokens) a compression "
                 f"keeps (int >= 1; default {DEFAULT_MIN_UNITS})",
    "per_head": "select tokens for each KV head on its own instead of all heads jointly (bool; default "
                "false)",
    "anchors": "layers that run the selector on their own keys/values: a list of layer indices (or one index), "
               "or 'all' (every layer is its own anchor, no followers) (default [0])",
    "compressed_layers": "layer-selective compression (the paper's setting): compress attention layers "
                         "0..compressed_layers-1 and keep every token in the layers above, which need a whole "
                         "max-model-len request in the pool and do not serve live streams (int >= 1; default: every "
                         "layer compressed). The anchors must lie in the compressed layers",
    "modalities": "which inputs' tokens are candidates for eviction: a list of 'image' and/or 'video' (default "
                  "both). Each image is one frame, and the images and videos of a request form one stream of "
                  "frames in prompt order, so frames a client sends as images (lmms-eval, VLMEvalKit) are "
                  "compressed like a video's; an input left out is protected like text and counts towards "
                  "max_text_tokens",
    "max_text_tokens": "the most protected tokens (text, questions, kept answers: all but the candidates) one "
                       "request may hold (int >= 0; "
                       "default min(max-model-len, 8192)). The start-up check asks the KV pool for one request's "
                       "bounded footprint, max_text_tokens + budget + slack + 2 blocks, instead of one "
                       "max-model-len request, so --max-model-len (a stream's logical length) may exceed the "
                       "pool; a request with more is ended with an error",
    "kernels": "what runs the compress step: 'auto' (Triton kernels on CUDA, the PyTorch reference elsewhere), "
               "'triton' or 'torch' (default: the CORDS_VLLM_KERNELS environment variable, else 'auto'); the "
               "workers' start-up line says which runs",
    "warmup": "where Triton kernels run the compress step, compile them at start-up for every width the server's "
              "compressions can take, so that no request waits for a compile (bool; default true; false starts "
              "faster and compiles each width at its first compression)",
}


#: ``SamplingParams.extra_args`` key under which one request narrows the server's policy (see
#: :meth:`KVPolicyConfig.narrowed`); the stream API sets it for streams opened with overrides.
REQUEST_OVERRIDES_KEY = "kv_policy"
#: Keys a request may narrow, each at most the server's value (so the start-up rule still holds).
REQUEST_KEYS = ("budget", "recent")


class KVPolicyConfigError(ValueError):
    """A ``--kv-policy`` / ``--kv-policy-config`` value that cannot be used; the message says why and ``key``
    names the offending key where there is one."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def available_policies() -> list[str]:
    """``none`` followed by every selector in the registry: the choices of ``--kv-policy``."""
    return [NO_POLICY, *available_selectors()]


@dataclass(frozen=True)
class KVPolicyConfig:
    """Validated KV policy settings shared by the scheduler and the workers.

    Attributes
    ----------
    policy:
        Registered selector name, or ``"none"`` (engine untouched).
    budget, recent, slack:
        Video tokens held after compression, of which ``recent`` are the newest (always kept), and the
        head-room above ``budget`` before the next compression. See :data:`ENGINE_KEYS`.
    granularity:
        ``"auto"``, ``"token"``, ``"frame"`` or ``"block"``; ``"auto"`` chooses per compression
        (:func:`~cords_vllm.compress.unit_choice.compression_unit`).
    min_units:
        Under ``"auto"``, the fewest units a compression keeps.
    per_head:
        Per-KV-head selection instead of joint selection over all heads.
    anchors:
        Anchor layer indices, or ``None`` for "every layer is an anchor".
    compressed_layers:
        Layer-selective compression: only attention layers ``0 .. compressed_layers - 1`` are compressed, the
        others keep every token (:mod:`cords_vllm.compress.layer_scope`); ``None``: every layer is compressed.
    modalities:
        vLLM modality names (``"image"``, ``"video"``) whose tokens are candidates; the rest is protected.
    max_text_tokens:
        The most protected (non-candidate) tokens a request may hold; ``None``: :data:`DEFAULT_MAX_TEXT_TOKENS`, at most
        max-model-len (:meth:`text_limit`). The start-up rule asks the pool for a request's bounded footprint
        instead of a max-model-len request (see :data:`ENGINE_KEYS`).
    kernels:
        ``"auto"``, ``"triton"`` or ``"torch"``: what runs the compress step (:mod:`cords_vllm.kernel_backend`);
        ``None``: the environment's choice.
    warmup:
        Where Triton runs the compress step, compile its kernels at start-up for every width the server's
        compressions can take (:mod:`cords_vllm.compress.kernel_warmup`).
    params:
        Selector hyper-parameters (validated by the selector).
    """

    policy: str = NO_POLICY
    budget: int = 2048
    recent: int = 512
    slack: int = 512
    granularity: str = AUTO
    min_units: int = DEFAULT_MIN_UNITS
    per_head: bool = False
    anchors: tuple[int, ...] | None = (0,)
    compressed_layers: int | None = None
    modalities: tuple[str, ...] = MODALITIES
    max_text_tokens: int | None = None
    kernels: str | None = None
    warmup: bool = True
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.policy != NO_POLICY

    @classmethod
    def parse(cls, policy: str | None, config: str | Mapping[str, Any] | None) -> KVPolicyConfig:
        """Validate a policy name and its JSON (string or mapping) configuration."""
        policy = NO_POLICY if policy is None else policy
        choices = available_policies()
        if policy not in choices:
            raise KVPolicyConfigError(f"unknown kv policy {policy!r}; choose from: {', '.join(choices)}")
        raw = _load_json_object(config)
        if policy == NO_POLICY:
            if raw:
                raise KVPolicyConfigError(
                    f"kv_policy_config {sorted(raw)} was given but kv_policy is 'none'; choose a policy "
                    f"({', '.join(choices[1:])}) or drop the configuration"
                )
            return cls()
        # the policy's own engine defaults (a per-layer, per-head variant's), under what the user gave
        engine = {**selector_class(policy).engine_defaults, **{k: v for k, v in raw.items() if k in ENGINE_KEYS}}
        params = {k: v for k, v in raw.items() if k not in ENGINE_KEYS}
        if "lambda" in params:  # the paper's name; a Python keyword, so the selector field is `lam`
            if "lam" in params:
                raise KVPolicyConfigError("kv_policy_config: give 'lam' or its alias 'lambda', not both")
            params["lam"] = params.pop("lambda")
        _check_selector_params(policy, params)

        budget = _int(engine, "budget", 2048, minimum=1)
        recent = _int(engine, "recent", budget // 4, minimum=0)
        if recent >= budget:
            raise KVPolicyConfigError(f"kv_policy_config key 'recent' must be < budget ({budget}), got {recent}")
        slack = _int(engine, "slack", budget // 4, minimum=0)
        granularity = engine.get("granularity", AUTO)
        if granularity not in (AUTO, *GRANULARITIES):
            raise KVPolicyConfigError(
                f"kv_policy_config key 'granularity' must be one of {[AUTO, *GRANULARITIES]}, got {granularity!r}"
            )
        min_units = _int(engine, "min_units", DEFAULT_MIN_UNITS, minimum=1)
        per_head = _bool(engine, "per_head", False)
        compressed_layers = engine.get("compressed_layers")
        if compressed_layers is not None:
            compressed_layers = _int(engine, "compressed_layers", 1, minimum=1)
        max_text = engine.get("max_text_tokens")
        if max_text is not None:
            max_text = _int(engine, "max_text_tokens", 0, minimum=0)
        kernels = engine.get("kernels")
        if kernels is not None and kernels not in KERNEL_CHOICES:
            raise KVPolicyConfigError(
                f"kv_policy_config key 'kernels' must be one of {list(KERNEL_CHOICES)}, got {kernels!r}")
        warmup = _bool(engine, "warmup", True)
        if kernels is None:
            try:
                requested_kernels()  # the environment's choice, checked at start-up rather than per compression
            except ValueError as exc:
                raise KVPolicyConfigError(f"environment variable {exc}") from None
        return cls(policy=policy, budget=budget, recent=recent, slack=slack, granularity=granularity,
                   min_units=min_units, per_head=per_head, anchors=_anchors(engine.get("anchors", [0])),
                   compressed_layers=compressed_layers,
                   modalities=_modalities(engine.get("modalities", list(MODALITIES))), max_text_tokens=max_text,
                   kernels=kernels, warmup=warmup, params=params)

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> KVPolicyConfig:
        """Parse the ``kv_policy`` / ``kv_policy_config`` entries of vLLM's ``additional_config``."""
        ac = additional_config or {}
        return cls.parse(ac.get(ADDITIONAL_CONFIG_POLICY), ac.get(ADDITIONAL_CONFIG_CONFIG))

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> KVPolicyConfig:
        return cls.from_additional_config(getattr(vllm_config, "additional_config", None))

    def to_json(self) -> dict[str, Any]:
        """The ``kv_policy_config`` JSON object that parses back to this configuration."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("policy", "params")}
        out["anchors"] = "all" if self.anchors is None else list(self.anchors)
        out["modalities"] = list(self.modalities)
        if self.max_text_tokens is None:
            del out["max_text_tokens"]
        if self.kernels is None:
            del out["kernels"]
        if self.compressed_layers is None:
            del out["compressed_layers"]
        return {**out, **dict(self.params)}

    def settings(self) -> dict[str, Any]:
        """Every setting in force: :meth:`to_json` plus the selector's hyper-parameters left at their defaults.

        Empty for ``none``. The start-up log line shows this, so it says what runs, not only what was given.
        """
        if not self.enabled:
            return {}
        selector = get_selector(self.policy, **dict(self.params))
        return {**self.to_json(), **{name: getattr(selector, name) for name in selector_params(self.policy)}}

    @property
    def budget_settings(self) -> BudgetSettings:
        """The planner's view of the budget (:class:`~cords_vllm.compress.plan.BudgetSettings`)."""
        return BudgetSettings(self.budget, self.recent, self.slack)

    def stream_footprint_blocks(self, max_model_len: int, block_size: int) -> int:
        """The most KV blocks one request holds under this policy, however long its video: its protected tokens
        (at most :meth:`text_limit`) plus its bounded candidates (see
        :func:`~cords_vllm.compress.plan.stream_footprint_blocks`)."""
        return stream_footprint_blocks(self.text_limit(max_model_len), self.budget_settings, block_size)

    def text_limit(self, max_model_len: int) -> int:
        """The most protected tokens a request may hold under this policy, for an engine's max-model-len."""
        limit = DEFAULT_MAX_TEXT_TOKENS if self.max_text_tokens is None else self.max_text_tokens
        return min(limit, max_model_len)

    def narrowed(self, overrides: Mapping[str, Any] | None) -> KVPolicyConfig:
        """This configuration with one request's ``overrides`` of :data:`REQUEST_KEYS` applied.

        A request may only lower ``budget`` and ``recent`` (the pool was sized for the server's values); the
        error names the offending key and the allowed range.
        """
        if not overrides:
            return self
        if not isinstance(overrides, Mapping):
            raise KVPolicyConfigError(f"kv_policy overrides must be an object, got {type(overrides).__name__}")
        unknown = sorted(set(overrides) - set(REQUEST_KEYS))
        if unknown:
            raise KVPolicyConfigError(f"kv_policy override {unknown[0]!r} is not allowed; a request may set "
                                      f"{', '.join(REQUEST_KEYS)}", unknown[0])
        budget = _int(overrides, "budget", self.budget, minimum=1)
        if budget > self.budget:
            raise KVPolicyConfigError(f"kv_policy override 'budget' must be at most the server's budget "
                                      f"({self.budget}), got {budget}", "budget")
        recent = _int(overrides, "recent", min(self.recent, budget - 1), minimum=0)
        if recent > self.recent or recent >= budget:
            raise KVPolicyConfigError(f"kv_policy override 'recent' must be at most the server's recent window "
                                      f"({self.recent}) and below budget ({budget}), got {recent}", "recent")
        return dataclasses.replace(self, budget=budget, recent=recent)

    def anchor_of(self, layer: int, num_layers: int) -> int:
        """The anchor layer whose selection ``layer`` reuses.

        Rule: the nearest anchor at or below ``layer``; layers below the lowest anchor follow the lowest
        anchor (so a single late anchor serves every layer, as in the paper's fastest setting).
        """
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} out of range for a model with {num_layers} layers")
        if self.anchors is None:
            return layer
        below = [a for a in self.anchors if a <= layer]
        return max(below) if below else min(self.anchors)

    def layer_selective(self, num_layers: int) -> bool:
        """Whether some of a model's ``num_layers`` attention layers are kept whole (``compressed_layers`` below
        ``num_layers``)."""
        return self.compressed_layers is not None and self.compressed_layers < num_layers

    def check_model(self, num_layers: int) -> None:
        """Reject anchors and a layer scope that a model with ``num_layers`` attention layers cannot have."""
        compressed = num_layers if self.compressed_layers is None else self.compressed_layers
        if self.compressed_layers is not None and (problem := scope_problem(compressed, num_layers)) is not None:
            raise KVPolicyConfigError(
                f"kv_policy_config key 'compressed_layers' = {compressed} cannot run: {problem}", "compressed_layers")
        if self.anchors is not None and max(self.anchors) >= compressed:
            where = ("the compressed layers are" if compressed < num_layers else "the model has layers")
            raise KVPolicyConfigError(
                f"kv_policy_config key 'anchors' = {list(self.anchors)} names layer {max(self.anchors)}, but "
                f"{where} 0..{compressed - 1}", "anchors"
            )


def kv_policy_args(policy: str, **config: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``EngineArgs`` that select a KV policy, validated now.

    Example: ``LLM(model, **kv_policy_args("cords", budget=2048, anchors=[0, 2]))``.
    """
    parsed = KVPolicyConfig.parse(policy, config)
    del parsed
    return {"additional_config": {ADDITIONAL_CONFIG_POLICY: policy, ADDITIONAL_CONFIG_CONFIG: dict(config)}}


def _load_json_object(config: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None or config == "":
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise KVPolicyConfigError(f"kv_policy_config is not valid JSON: {exc}") from None
    if not isinstance(config, Mapping):
        raise KVPolicyConfigError(f"kv_policy_config must be a JSON object, got {type(config).__name__}")
    return dict(config)


def _int(values: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise KVPolicyConfigError(f"kv_policy_config key {key!r} must be an integer >= {minimum}, got {value!r}",
                                  key)
    return value


def _bool(values: Mapping[str, Any], key: str, default: bool) -> bool:
    value = values.get(key, default)
    if not isinstance(value, bool):
        raise KVPolicyConfigError(f"kv_policy_config key {key!r} must be true or false, got {value!r}", key)
    return value


def _anchors(value: Any) -> tuple[int, ...] | None:
    if value == "all":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]  # one anchor layer
    if (not isinstance(value, list | tuple) or not value
            or any(isinstance(a, bool) or not isinstance(a, int) or a < 0 for a in value)
            or len(set(value)) != len(value)):
        raise KVPolicyConfigError(
            f"kv_policy_config key 'anchors' must be 'all' or a non-empty list of distinct layer indices "
            f">= 0, got {value!r}"
        )
    return tuple(sorted(value))


def _modalities(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]  # one modality
    if (not isinstance(value, list | tuple) or not value or len(set(value)) != len(value)
            or any(m not in MODALITIES for m in value)):
        raise KVPolicyConfigError(
            f"kv_policy_config key 'modalities' must be a non-empty list of distinct names from "
            f"{list(MODALITIES)}, got {value!r}", "modalities")
    return tuple(m for m in MODALITIES if m in value)


def _check_selector_params(policy: str, params: Mapping[str, Any]) -> None:
    try:
        get_selector(policy, **params)
    except (ValueError, TypeError) as exc:
        allowed = ", ".join(ENGINE_KEYS)
        raise KVPolicyConfigError(f"kv_policy_config for policy {policy!r}: {exc} (engine keys: {allowed})") \
            from None
