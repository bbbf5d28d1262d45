"""The GPU check's comparisons: two servers give the same greedy answers to the videos under the budget, up to
bf16 noise (plain vLLM = ``none``, ``none`` = ``cords``, per attention backend)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from cords_vllm.lab.gpu_check.rows import Fail, Row, Skip, timed
from cords_vllm.lab.gpu_check.serve import Answer, ServerRun

#: Greatest log-probability difference between two servers' greedy tokens taken as bf16 noise (batch order and
#: kernel choice reorder bf16 sums).
LOGPROB_TOL = 0.05


def agreement(x: Answer, y: Answer, tol: float = LOGPROB_TOL) -> tuple[float, int | None]:
    """How two servers' greedy answers to one prompt agree: ``(worst log-probability gap, position of a near-tie
    or None)``. They agree when every token is the same and each log-probability is within ``tol``, or up to the
    first position where they chose differently and, there, each one's token is the other's runner-up within
    ``tol`` of its choice (a near-tie that bf16 noise may break either way; past it the answers are not
    comparable). Raises :class:`Fail` otherwise."""
    worst = 0.0
    for k, (s, t) in enumerate(zip(x.tokens, y.tokens, strict=True)):
        if s != t:
            gaps = [abs(x.logprobs[k] - y.top[k].get(x.texts[k], -math.inf)),
                    abs(y.logprobs[k] - x.top[k].get(y.texts[k], -math.inf))]
            if max(gaps) > tol:
                raise Fail(f"tokens differ from position {k}: {x.tokens} against {y.tokens}, and not as a near-tie "
                           f"(each one's choice is {max(gaps):.3g} from the other's)")
            return worst, k
        worst = max(worst, abs(x.logprobs[k] - y.logprobs[k]))
        if worst > tol:
            raise Fail(f"position {k}: log-probabilities {x.logprobs[k]:.4f} against {y.logprobs[k]:.4f}")
    return worst, None


def compare_rows(a: ServerRun, b: ServerRun, why: str = "videos under the budget") -> Row:
    """The comparison row: the short videos (asked one at a time) get the same greedy answers from ``a`` and
    ``b`` (:func:`agreement`)."""
    step = f"answers: {a.spec.label} = {b.spec.label} ({why})"

    def compare() -> str:
        if a.short_answers is None or b.short_answers is None:
            raise Skip("a server's video chats failed")
        worst, ties = 0.0, []
        for i, (x, y) in enumerate(zip(a.short_answers, b.short_answers, strict=True)):
            try:
                gap, tie = agreement(x, y)
            except Fail as exc:
                raise Fail(f"video {i}: {exc}") from None
            worst = max(worst, gap)
            if tie is not None:
                ties.append(f"video {i} at token {tie}")
        same = f"the same {len(a.short_answers[0].tokens)} greedy tokens each"
        if ties:
            same = (f"the same tokens up to a near-tie ({', '.join(ties)}: each server's choice is the other's "
                    "runner-up)")
        return f"{len(a.short_answers)} videos, {same}, log-probabilities within {worst:.2g}"

    return timed(step, compare)


def comparison_rows(runs: Sequence[ServerRun]) -> list[Row]:
    """Per attention backend: ``none`` with the plugin = plain vLLM, and ``cords`` = ``none`` on videos under
    the budget."""
    rows = []
    for backend in dict.fromkeys(r.spec.backend for r in runs):
        group = {r.spec.policy: r for r in runs if r.spec.backend == backend and "+" not in r.spec.label}
        if "none" in group and None in group:
            rows.append(compare_rows(group["none"], group[None], "the plugin loaded, no policy"))
        if "cords" in group and "none" in group:
            rows.append(compare_rows(group["cords"], group["none"]))
    return rows
