"""The exact-count rule: keep exactly ``need`` candidates at every granularity, for every policy.

:meth:`Selector.select` keeps whole units: tokens, fixed runs of ``group_size`` candidates, or labelled
groups (a video's real frames, which earlier compressions and region edges may have cut smaller). A caller
that must fill whole KV blocks needs an exact token count instead. :func:`select_exact` gets it in one
selector call for every granularity:

* ``token``: the selector's own count is exact.
* fixed groups (``block``, or ``frame`` without labels): ``cdiv(need, g)`` groups are chosen and the group
  chosen last is trimmed to its oldest tokens. When the candidates do not hold that many whole groups, the
  selection falls back to token granularity.
* labelled groups (``frame`` with ``group_index``): the newest group, usually cut by the caller's
  block-aligned region edge, is kept whole when it holds fewer than ``group_size`` tokens (and fewer than
  ``need``), so it competes as a whole frame at the next compression. The others are chosen with the fewest
  frames any choice of which holds enough tokens (frames cut by earlier compressions are smaller, so this
  is read from the frame sizes). The chosen tokens are then kept in the order the policy chose their frames
  (oldest token first inside a frame) up to ``need``: only the frames chosen last are trimmed, at most one
  partially.

Host synchronisations (budget, enforced by ``tests/compress/test_host_syncs.py``): with ``num_candidates``
given on the host (the compress step always gives it), the selector receives its counts as
:class:`~cords_vllm.selection.batch.HostCounts` and reads nothing back: **0** at token and block
granularity, **1** with labelled frames, where the most frames a problem's candidates form (the width of the
selector's units) and the frame budget are data-dependent and read together, in one read (the frame count
alone when the caller gives ``frame_budget``). Without ``num_candidates`` the count is read and the selector
checks its inputs (a few more reads).
"""

from __future__ import annotations

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import HostCounts
from cords_vllm.selection.granularity import candidate_ranks, labelled_group_ids
from cords_vllm.selection.observation import Observation
from cords_vllm.selection.together import SelectionSteps, driven_alone
from cords_vllm.utils import cdiv


def select_exact_steps(selector: Selector, keys: torch.Tensor, values: torch.Tensor, need: int, *,
                       candidates: torch.Tensor, granularity: str = "token", group_size: int | None = None,
                       group_index: torch.Tensor | None = None, num_candidates: int | None = None,
                       frame_budget: int | None = None, frame_tokens: int | None = None,
                       generator: torch.Generator | None = None,
                       observation: Observation | None = None) -> SelectionSteps[torch.Tensor]:
    """Sorted positions of the protected tokens and of exactly ``need`` chosen candidates, as a generator
    (:mod:`~cords_vllm.selection.together`): yields what its policy needs ordered, so that several compressions may
    order their units in one call; :func:`select_exact` runs it alone.

    Parameters
    ----------
    keys, values:
        ``[B, H, T, D]``: ``B`` problems whose ``H`` heads select jointly (reshape to ``[B*H, 1, T, D]``
        for per-head selection).
    need:
        Candidates to keep in every problem; ``0 <= need < `` its candidate count.
    candidates:
        ``bool [B, T]``; every problem has the same numbers of candidates and of protected tokens.
    granularity, group_size:
        Selection unit; ``group_size`` (tokens per frame / block, ``>= 1``) is required for ``frame`` and
        ``block``.
    group_index:
        ``long [B, T]``, ``frame`` only: the frame label of every token (non-decreasing along the
        candidates, at most ``group_size`` candidates per label). Without it frames are fixed runs.
    num_candidates:
        Candidates per problem, if the caller knows it on the host. Then the selection trusts its inputs (keys
        and values finite, ``group_index`` as described) and reads nothing back but the one read of labelled
        frames; otherwise the count is read from ``candidates`` and the selector checks its inputs.
    frame_budget:
        Labelled frames only: the number of frames to ask the selector for, at least ``cdiv(need, g)`` plus
        the number of held frames smaller than ``g``. By default the fewest frames any choice of which holds
        ``need`` tokens, read from the frame sizes (in the call's one host read).
    frame_tokens:
        Tokens per frame, passed to frame-aware policies at token granularity (``infinipot_v``).
    observation:
        The observation queries of attention-scored policies, passed on.

    Returns
    -------
    torch.Tensor
        ``long [B, protected + need]``, increasing, on ``keys.device``.
    """
    trusted = num_candidates is not None
    if num_candidates is None:
        num_candidates = int(candidates.sum(-1).min())
    if not 0 <= need < num_candidates:
        raise ValueError(f"need: must be in [0, {num_candidates}) (the candidate count), got {need}")
    counts = HostCounts(max_candidates=num_candidates) if trusted else None
    if granularity == "frame" and group_index is not None:
        if group_size is None:
            raise ValueError("group_size: required (the largest frame, in tokens) at frame granularity with "
                             "group_index")
        keep = yield from _labelled_frames(selector, keys, values, candidates, group_index, need, group_size,
                                frame_budget, generator, trusted, observation)
    elif granularity == "token" or group_size is None or cdiv(need, group_size) > num_candidates // group_size:
        # token granularity, or not enough whole groups to hold `need` tokens
        keep = (yield from selector.select_steps(keys, values, need, candidates=candidates, granularity="token",
                                                 group_size=frame_tokens, generator=generator, counts=counts,
                                                 observation=observation)).keep
    else:
        n_groups = cdiv(need, group_size)
        result = yield from selector.select_steps(keys, values, n_groups * group_size, candidates=candidates,
                                                  granularity=granularity, group_size=group_size,
                                                  generator=generator, counts=counts, observation=observation)
        rank, _ = candidate_ranks(candidates)
        gid = torch.where(candidates, rank // group_size, -1)
        keep = ~candidates | _first_chosen(result.keep & candidates, gid, result.order, need)
    n_keep = keys.shape[2] - num_candidates + need
    return torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :n_keep]


select_exact = driven_alone(select_exact_steps, "select_exact", """Sorted positions of the protected tokens and of
    exactly ``need`` chosen candidates: :func:`select_exact_steps` driven to its result alone (same arguments and
    result, documented there).""")


def _labelled_frames(selector: Selector, keys: torch.Tensor, values: torch.Tensor, cand: torch.Tensor,
                     labels: torch.Tensor, need: int, group_size: int, frame_budget: int | None,
                     generator: torch.Generator | None, trusted: bool,
                     observation: Observation | None = None) -> SelectionSteps[torch.Tensor]:
    """``bool [B, T]``: protected tokens, the edge frame when kept whole, and the first chosen candidates.

    ``trusted``: the labels need no check, and the frame count (the width of the selector's units) is read
    with the frame budget in the one host read of the call.
    """
    low = torch.iinfo(torch.long).min
    newest = torch.where(cand, labels, low).max(dim=-1, keepdim=True).values  # [B, 1]
    edge = cand & (labels == newest)
    n_edge = edge.sum(-1, keepdim=True)
    edge &= (n_edge < group_size) & (n_edge < need)
    rest = cand & ~edge
    still = need - edge.sum(-1)  # [B] candidates to choose besides the edge frame
    gid, count = labelled_group_ids(labels, rest, group_size, check=not trusted)
    counts = None
    if trusted:  # the one host read: the most frames of a problem and, unless given, the frame budget
        wanted = [count.max()] if frame_budget is not None else [count.max(), _frames_holding(gid, count, still)]
        n_frames, *budget = torch.stack(wanted).tolist()
        frame_budget = budget[0] if budget else frame_budget
        counts = HostCounts(max_groups=n_frames)
    elif frame_budget is None:
        frame_budget = int(_frames_holding(gid, count, still))
    result = yield from selector.select_steps(keys, values, frame_budget * group_size, candidates=rest,
                                              granularity="frame", group_size=group_size, group_index=labels,
                                              generator=generator, counts=counts, observation=observation)
    return ~cand | edge | _first_chosen(result.keep & rest, gid, result.order, still)


def _frames_holding(gid: torch.Tensor, count: torch.Tensor, still: torch.Tensor) -> torch.Tensor:
    """``long []``: the fewest frames any choice of which holds ``still[b]`` tokens in every problem ``b``.

    Sorts each problem's frame sizes and counts the smallest frames needed: any that many frames hold enough
    (a data-dependent count: the caller reads it back). ``gid``: ``long [B, T]`` frame of each candidate
    (``-1``: none), ``count``: ``long [B]`` frames per problem.
    """
    b, t = gid.shape
    sizes = torch.zeros((b, t + 1), dtype=torch.long, device=gid.device)
    sizes.scatter_add_(1, torch.where(gid >= 0, gid, t), torch.ones_like(gid))
    sizes = torch.sort(torch.where(sizes[:, :t] > 0, sizes[:, :t], t + 1), dim=-1).values  # smallest first
    prefix = torch.cumsum(torch.where(sizes <= t, sizes, 0), dim=-1)
    needed = (prefix < still[:, None]).sum(-1) + 1  # frames whose smallest sizes reach `still`
    return torch.minimum(needed, count).max()


def _first_chosen(chosen: torch.Tensor, gid: torch.Tensor, order: torch.Tensor,
                  count: torch.Tensor | int) -> torch.Tensor:
    """``bool [B, T]``: the first ``count`` chosen tokens, by when their group was chosen, then oldest first.

    ``chosen``: ``bool [B, T]`` tokens of the chosen groups; ``gid``: ``long [B, T]`` group of each token
    (``-1``: none); ``order``: ``long [B, k]`` chosen groups in choice order (``-1`` padding); ``count``: an
    int or ``long [B]``.
    """
    b, t = chosen.shape
    n_groups = t + 1  # an upper bound on group ids; slot n_groups stands for "not chosen"
    when = torch.full((b, n_groups + 1), n_groups, dtype=torch.long, device=chosen.device)
    if order.shape[-1]:
        steps = torch.arange(order.shape[-1], device=chosen.device).expand_as(order)
        when.scatter_(1, torch.where(order >= 0, order, n_groups), steps)
    when[:, n_groups] = n_groups
    token = torch.arange(t, device=chosen.device)
    priority = torch.gather(when, 1, torch.where(gid >= 0, gid, n_groups)) * t + token
    priority = torch.where(chosen, priority, torch.iinfo(torch.long).max)
    rank = torch.empty_like(priority).scatter_(1, torch.argsort(priority, dim=-1, stable=True),
                                               token.expand(b, t).contiguous())
    limit = count[:, None] if isinstance(count, torch.Tensor) else count
    return chosen & (rank < limit)
