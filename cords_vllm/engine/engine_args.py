"""Engine settings the KV policy needs, applied to ``EngineArgs`` before vLLM builds its config.

Each adjustment is logged. None is applied with ``--kv-policy none``.

* Prefix caching off: compression rewrites a request's blocks in place, so a block must never be shared
  with, or served from the prefix cache to, another request.
* Speculative decoding refused: drafting builds attention metadata on a path the compacted view does not
  cover.
* CUDA: the V1 model runner (the plugin patches it; Model Runner V2 is not supported yet), and piecewise
  CUDA graphs instead of full graphs, which would capture the block table and ``seq_lens`` of one step and
  replay a stale attention view.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError

logger = logging.getLogger(__name__)


def adjust_engine_args(engine_args: Any, policy: KVPolicyConfig) -> None:
    """Mutate ``engine_args`` (a vLLM ``EngineArgs``) for an enabled policy."""
    if not policy.enabled:
        return
    if getattr(engine_args, "speculative_config", None):
        raise KVPolicyConfigError(f"--kv-policy {policy.policy} does not support speculative decoding")
    if engine_args.enable_prefix_caching is not False:
        logger.info("cords-vllm: --kv-policy %s turns prefix caching off (compressed blocks are rewritten "
                    "in place and must not be shared)", policy.policy)
        engine_args.enable_prefix_caching = False
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
            logger.info("cords-vllm: --kv-policy %s selects vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)",
                        policy.policy)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        if not engine_args.enforce_eager:
            _force_piecewise_cudagraphs(engine_args, policy)


def _force_piecewise_cudagraphs(engine_args: Any, policy: KVPolicyConfig) -> None:
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    cc = engine_args.compilation_config
    if isinstance(cc, dict):
        cc = CompilationConfig(**cc)
    if cc.cudagraph_mode is None or cc.cudagraph_mode.has_full_cudagraphs():
        logger.info("cords-vllm: --kv-policy %s uses piecewise CUDA graphs (full graphs would replay a stale "
                    "attention view of compressed rows)", policy.policy)
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    engine_args.compilation_config = cc
