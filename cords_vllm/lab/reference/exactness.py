"""The compressed engine equals the HF reference that drops the same tokens (fp32): one check, runnable alone.

The engine (in-process, fp32, ``CORDS_VLLM_TRACE=1``) compresses one video prompt under ``cords``; the HF
reference (:class:`~cords_vllm.lab.reference.hf.HFQwen2VLReference`) prefills with the engine's chunk
boundaries, evicts exactly the logical tokens the engine's workers evicted at the same points, and is
teacher-forced with the engine's tokens. Greedy tokens must be equal and every top log-prob within
``tolerance``; as a negative control, the reference without the evictions must disagree clearly.

``tests/engine/test_exactness.py`` runs the same comparison over several policy settings; ``python -m
cords_vllm.lab.reference.exactness MODEL_DIR`` runs it once (what ``scripts/gpu-check.sh`` does, on whatever
device the installed vLLM uses) and prints the result as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: fp32 log-prob agreement of engine and reference; the uncompressed HF-vs-vLLM floor is ~1e-6 on CPU.
TOLERANCE = 2e-4
#: The same on a CUDA GPU, whose fp32 kernels (attention, GEMM) sum in other orders: an H100 measured 2.4e-4
#: with the negative control at 0.27.
CUDA_TOLERANCE = 1e-3


def default_tolerance() -> float:
    """:data:`CUDA_TOLERANCE` where the engine runs on a CUDA GPU, else :data:`TOLERANCE`."""
    import torch

    return CUDA_TOLERANCE if torch.cuda.is_available() else TOLERANCE
#: The negative control must differ by at least this many tolerances.
CONTROL_FACTOR = 50


def chunks_for(prompt_len: int, evictions: Iterable[int]) -> list[int]:
    """Prefill chunk sizes for the HF reference: a chunk starts at every position the engine compressed at.

    The engine ends its chunks at compression points (and wherever a step's budget runs out); only the
    points matter to the reference, since splitting a prefill elsewhere does not change causal attention.
    """
    bounds = [0, *sorted(evictions), prompt_len]
    return [b - a for a, b in itertools.pairwise(bounds) if b > a]


def evictions_of(events: Iterable[Any], req_prefix: str = "", num_layers: int | None = None
                 ) -> dict[int, Sequence[Any]]:
    """``{at_token: kept_logical}`` of the engine's compression events of the requests whose id starts with
    ``req_prefix`` (the form :meth:`HFQwen2VLReference.run` takes as ``evictions``). With ``num_layers`` (the
    model's attention layers), layers the events do not name (the upper layers under layer-selective compression)
    are kept whole (``None``)."""
    out = {}
    for e in events:
        if e.req_id.startswith(req_prefix):
            kept = list(e.kept_logical)
            out[e.at_token] = kept + [None] * ((num_layers or len(kept)) - len(kept))
    return out


@dataclass(frozen=True)
class ExactnessResult:
    """One comparison of the compressed engine with the reference.

    Attributes
    ----------
    compressions:
        Compressions the engine carried out on the prompt.
    engine_tokens, reference_tokens:
        Greedy tokens of each.
    worst_gap:
        Largest ``|engine - reference|`` over the engine's top log-probs of every step.
    control_gap:
        The same against the reference *without* the evictions (must be large).
    tolerance:
        The bound ``worst_gap`` must stay under.
    """

    compressions: int
    engine_tokens: list[int]
    reference_tokens: list[int]
    worst_gap: float
    control_gap: float
    tolerance: float

    @property
    def problems(self) -> list[str]:
        """What failed (empty when the engine equals the reference)."""
        out = []
        if self.compressions < 2:
            out.append(f"the prompt was compressed {self.compressions} times, expected at least 2")
        if self.engine_tokens != self.reference_tokens:
            out.append(f"greedy tokens differ: engine {self.engine_tokens}, reference {self.reference_tokens}")
        if not self.worst_gap < self.tolerance:
            out.append(f"log-probs differ by {self.worst_gap:.2e} (tolerance {self.tolerance:.0e})")
        if not self.control_gap > CONTROL_FACTOR * self.tolerance:
            out.append(f"negative control: the uncompressed reference differs by only {self.control_gap:.2e}")
        return out

    @property
    def passed(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: what was compared and how closely it agreed (or what failed)."""
        if self.problems:
            return "; ".join(self.problems)
        return (f"{self.compressions} compressions, {len(self.engine_tokens)} equal greedy tokens, log-probs within "
                f"{self.worst_gap:.1e} (tolerance {self.tolerance:.0e}); without the evictions {self.control_gap:.1e}")


def _gap(engine_logprobs: Sequence[dict[int, float]], reference_logits: Any) -> float:
    ref = reference_logits.log_softmax(-1)
    return max((abs(lp - float(ref[step, token])) for step, top in enumerate(engine_logprobs)
                for token, lp in top.items()), default=float("inf"))


def compressed_engine_vs_reference(model_dir: str, *, frames: int = 48, budget: int = 256, slack: int = 64,
                                   max_tokens: int = 6, tolerance: float | None = None,
                                   compressed_layers: int | None = None,
                                   engine_kwargs: dict[str, Any] | None = None) -> ExactnessResult:
    """Run the compressed engine on one synthetic video and compare it with the reference (both fp32).

    The engine is built by :func:`~cords_vllm.integration.inprocess.llm.make_llm` (fp32, eager, in-process)
    with 32-token blocks and 256-token prefill chunks, so the prompt is compressed several times;
    ``engine_kwargs`` override any of it. Needs ``CORDS_VLLM_TRACE=1`` (set here when absent) before the engine
    is built, so the workers record what they kept. ``compressed_layers``: layer-selective compression (the
    reference keeps the layers above whole).
    """
    os.environ.setdefault("CORDS_VLLM_TRACE", "1")

    from vllm import SamplingParams

    from cords_vllm.config import kv_policy_args
    from cords_vllm.integration.inprocess.heap import settle
    from cords_vllm.integration.inprocess.introspect import snapshot
    from cords_vllm.integration.inprocess.llm import make_llm
    from cords_vllm.lab.bench.workload import PROMPT, QUESTION
    from cords_vllm.lab.reference.hf import HFQwen2VLReference
    from cords_vllm.lab.synthetic import make_video

    prompt = PROMPT.format(question=QUESTION)
    video = make_video(frames, 224, 224, seed=3).frames
    kwargs = {"block_size": 32, "max_num_batched_tokens": 4096, "max_num_scheduled_tokens": 256,
              **kv_policy_args("cords", budget=budget, slack=slack,
                               **({} if compressed_layers is None else {"compressed_layers": compressed_layers})),
              **(engine_kwargs or {})}
    llm = make_llm(model_dir, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=20)
    (out,) = llm.generate([{"prompt": prompt, "multi_modal_data": {"video": video}}], params, use_tqdm=False)
    events = snapshot(llm).events
    tokens = list(out.outputs[0].token_ids)
    logprobs = [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]
    prompt_len = len(out.prompt_token_ids)
    del llm, out
    settle()

    reference = HFQwen2VLReference(model_dir)
    evictions = evictions_of(events, num_layers=len(reference.attention_layers))
    ref = reference.run(prompt, video, max_new_tokens=max_tokens, chunk_sizes=chunks_for(prompt_len, evictions),
                        evictions=evictions, forced_tokens=tokens)
    control = reference.run(prompt, video, max_new_tokens=max_tokens, forced_tokens=tokens)
    return ExactnessResult(compressions=len(events), engine_tokens=tokens, reference_tokens=ref.token_ids,
                           worst_gap=_gap(logprobs, ref.logits), control_gap=_gap(logprobs, control.logits),
                           tolerance=default_tolerance() if tolerance is None else tolerance)


def main(argv: list[str] | None = None) -> int:
    """``python -m cords_vllm.lab.reference.exactness MODEL_DIR [--json]``: exit 0 when the engine equals the
    reference."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model", help="a Qwen2-VL checkpoint directory (e.g. the tiny one the tests build)")
    parser.add_argument("--frames", type=int, default=48, help="frames of the synthetic video (default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help=f"log-prob bound (default: {TOLERANCE} on CPU, {CUDA_TOLERANCE} on a CUDA GPU)")
    parser.add_argument("--compressed-layers", type=int, default=None,
                        help="layer-selective compression: compress the lowest N layers, keep the others whole")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    result = compressed_engine_vs_reference(args.model, frames=args.frames, tolerance=args.tolerance,
                                            compressed_layers=args.compressed_layers)
    if args.json:
        print(json.dumps({**asdict(result), "passed": result.passed, "summary": result.summary()}))
    else:
        print(("PASS: " if result.passed else "FAIL: ") + result.summary())
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
