"""vLLM's in-tree video pruning (EVS, VidCom2) as a benchmark cell beside the KV policies.

vLLM 0.32 prunes a video's tokens before the language model (``--video-pruning-rate R`` keeps ``1 - R`` of them,
``--video-pruning-method evs|vidcom2``). A benchmark names it like a policy:

* ``evs`` or ``vidcom2``: pruning alone, at the rate that keeps the cell's budget (``1 - fraction``), no KV
  policy: the same video tokens reach the language model's KV as a policy holding that budget keeps;
* ``evs+cords`` (any registered policy after the ``+``, with its ``:key=value`` variants): pruning at
  ``pruning_rate`` (default 0.5) first, then the policy compresses what is left to the cell's budget.

Pure: the cell's :class:`~cords_vllm.lab.bench.workload.PolicySpec` carries ``pruning`` (and ``pruning_rate``) in
its config; :func:`split` turns them into the engine's keyword arguments.
"""

from __future__ import annotations

from typing import Any

from cords_vllm.lab.bench.workload import PolicySpec

#: ``--video-pruning-method`` values of vLLM 0.32.
PRUNING_METHODS = ("evs", "vidcom2")
#: The rate pruning runs at when a KV policy follows it.
DEFAULT_RATE_BEFORE_POLICY = 0.5


def parse(text: str, defaults: dict) -> PolicySpec:
    """A benchmark cell from its name: a policy (``cords:granularity=token``), a pruning method (``evs``), or a
    pruning method followed by a policy (``evs+cords:...``; ``pruning_rate=`` sets the pruning's rate)."""
    head, _, rest = text.partition(":")
    method, plus, policy = head.partition("+")
    if method not in PRUNING_METHODS:
        return PolicySpec.parse(text, defaults)
    if not plus:
        if rest:
            raise ValueError(f"{text!r}: pruning alone takes no settings (its rate follows the budget)")
        budget = {"budget": defaults["budget"]} if "budget" in defaults else {}
        return PolicySpec(label=text, policy="none", config={"pruning": method, **budget})
    spec = PolicySpec.parse(policy + (":" + rest if rest else ""), defaults)
    if spec.policy == "none":
        raise ValueError(f"{text!r}: name a KV policy after '+'")
    return PolicySpec(label=text, policy=spec.policy, config={**spec.config, "pruning": method})


def budgeted(spec: PolicySpec) -> bool:
    """Whether a cell runs at every budget (a policy, or pruning), not once as the full cache."""
    return spec.policy != "none" or "pruning" in spec.config


def split(spec: PolicySpec, budget: int | None, video_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(kv_policy_config, engine kwargs)`` of a cell at ``budget`` (default: the spec's own ``budget``) for
    requests of ``video_tokens`` video tokens.

    Pruning alone keeps the budget's share of the video (rate ``1 - budget / video_tokens``); before a policy it
    runs at its ``pruning_rate``. Raises ``ValueError`` for a rate outside ``[0, 1)``.
    """
    config = dict(spec.config)
    method = config.pop("pruning", None)
    rate = config.pop("pruning_rate", None)
    if budget is None:
        budget = config.get("budget")
    if spec.policy == "none":
        config.pop("budget", None)
    if method is None:
        if rate is not None:
            raise ValueError(f"{spec.label}: 'pruning_rate' without a pruning method")
        return config, {}
    if method not in PRUNING_METHODS:
        raise ValueError(f"{spec.label}: unknown pruning method {method!r}; one of {PRUNING_METHODS}")
    if rate is None:
        rate = DEFAULT_RATE_BEFORE_POLICY if spec.policy != "none" else 1.0 - (budget or video_tokens) / video_tokens
    if not 0.0 <= float(rate) < 1.0:
        raise ValueError(f"{spec.label}: pruning rate {rate} is outside [0, 1)")
    return config, {"video_pruning_rate": float(rate), "video_pruning_method": method}
