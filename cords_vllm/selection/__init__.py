"""Pure-PyTorch KV token selection: CoRDS and the baselines it is compared with.

No vLLM import: everything here works on plain ``[B, H, N, D]`` key/value tensors on any device.

>>> from cords_vllm.selection import get_selector
>>> sel = get_selector("cords", alpha=0.25)
>>> result = sel.select(keys, values, budget=512, candidates=video_mask, granularity="block",
...                     group_size=32)                                    # doctest: +SKIP
>>> result.keep.shape, result.kept_indices().shape                        # doctest: +SKIP

Adding a policy: write one module with one ``@register_selector("name")`` frozen dataclass subclassing
:class:`Selector` (fields declared with :func:`hyperparameter`, numpy docstring with the idea, the paper
and each parameter), implement ``_order_units`` (choose ``k[p]`` units per problem, lowest index on
ties), set the traits ``uses_token_order`` / ``stochastic`` / ``needs_frame_length`` / ``needs_observation`` /
``batches_problems`` (its orders of several selections may be computed in one call) if they apply, and
import the module below. The shared test matrix in ``tests/selection/test_selector_contract.py`` then
runs it through every contract test (exact counts, protected tokens, determinism, batch independence,
permutation equivariance unless it uses token order, low-precision inputs).

Numerics: every policy computes in float32 (float64 for float64 inputs), whatever the cache dtype.
"""

from cords_vllm.selection import (  # noqa: F401  (imported to register the built-in policies)
    cords,
    d2,
    infinipot,
    infinipot_v,
    layerwise,
    randomized,
    recency,
    snapkv,
    streammem,
    uniform,
    value_norm,
)
from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import GRANULARITIES, UnitBatch, compute_dtype
from cords_vllm.selection.cords import NOVELTY_VARIANTS, CoRDSSelector, cords_greedy
from cords_vllm.selection.d2 import KOnlySelector, VOnlySelector
from cords_vllm.selection.infinipot import InfiniPotSelector
from cords_vllm.selection.infinipot_v import InfiniPotVSelector
from cords_vllm.selection.observation import Observation, observed_attention
from cords_vllm.selection.params import ParamSpec, hyperparameter
from cords_vllm.selection.randomized import RandomSelector
from cords_vllm.selection.recency import RecencySelector
from cords_vllm.selection.registry import (
    available_selectors,
    get_selector,
    register_selector,
    selector_class,
    selector_params,
)
from cords_vllm.selection.result import SelectionResult, kept_candidate_count
from cords_vllm.selection.snapkv import SnapKVSelector
from cords_vllm.selection.streammem import StreamMemSelector
from cords_vllm.selection.uniform import UniformSelector
from cords_vllm.selection.value_norm import ValueNormSelector

__all__ = [
    "GRANULARITIES",
    "NOVELTY_VARIANTS",
    "CoRDSSelector",
    "InfiniPotSelector",
    "InfiniPotVSelector",
    "KOnlySelector",
    "Observation",
    "ParamSpec",
    "RandomSelector",
    "RecencySelector",
    "SelectionResult",
    "Selector",
    "SnapKVSelector",
    "StreamMemSelector",
    "UniformSelector",
    "UnitBatch",
    "VOnlySelector",
    "ValueNormSelector",
    "available_selectors",
    "compute_dtype",
    "cords_greedy",
    "get_selector",
    "hyperparameter",
    "kept_candidate_count",
    "observed_attention",
    "register_selector",
    "selector_class",
    "selector_params",
]
