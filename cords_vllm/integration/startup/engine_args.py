"""Engine settings the KV policy needs, applied to ``EngineArgs`` before vLLM builds its config.

None is applied with ``--kv-policy none``. :func:`adjust_engine_args` returns what it changed, so that the
start-up line (:mod:`cords_vllm.integration.startup.cli_args`) names every change next to the policy's settings.

* Prefix caching is left as configured: compression rewrites a request's blocks in place, so the requests the
  policy may compress bypass the cache (they neither read nor fill it), and the others (text, videos within
  ``budget + slack``) use it as under ``none``
  (:meth:`~cords_vllm.integration.engine_core.scheduler.SchedulerCompressor.may_compress`).
* Speculative decoding refused: drafting builds attention metadata on a path the compacted view does not
  cover.
* CUDA: the V1 model runner (the plugin patches it; Model Runner V2 is not supported yet), and piecewise
  CUDA graphs instead of full graphs, which would capture the block table and ``seq_lens`` of one step and
  replay a stale attention view.
"""

from __future__ import annotations

import os
from typing import Any

from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError


def adjust_engine_args(engine_args: Any, policy: KVPolicyConfig) -> list[str]:
    """Mutate ``engine_args`` (a vLLM ``EngineArgs``) for an enabled policy; returns the changes made.

    Each change is a short phrase with its reason, e.g. ``"V1 model runner (...)"``; the list is empty
    when nothing had to change (or the policy is ``none``).
    """
    if not policy.enabled:
        return []
    if getattr(engine_args, "speculative_config", None):
        raise KVPolicyConfigError(f"--kv-policy {policy.policy} does not support speculative decoding")
    changes = []
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            changes.append("V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0; Model Runner V2 is not supported yet)")
        if not engine_args.enforce_eager and _force_piecewise_cudagraphs(engine_args):
            changes.append("piecewise CUDA graphs (full graphs would replay a stale attention view of "
                           "compressed rows)")
    return changes


def _force_piecewise_cudagraphs(engine_args: Any) -> bool:
    """Turn full CUDA graphs into piecewise ones; ``True`` if the mode changed."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    cc = engine_args.compilation_config
    if isinstance(cc, dict):
        cc = CompilationConfig(**cc)
    engine_args.compilation_config = cc
    if cc.cudagraph_mode is None or cc.cudagraph_mode.has_full_cudagraphs():
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
        return True
    return False
