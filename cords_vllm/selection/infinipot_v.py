"""InfiniPot-V's rule: temporal redundancy (TaR) from key similarity across frames + value-norm saliency."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cords_vllm.selection.base import Selector
from cords_vllm.selection.batch import UnitBatch
from cords_vllm.selection.granularity import units_to_mask
from cords_vllm.selection.params import hyperparameter
from cords_vllm.selection.ranking import mask_order, top_k_order
from cords_vllm.selection.registry import register_selector


@register_selector("infinipot_v")
@dataclass(frozen=True)
class InfiniPotVSelector(Selector):
    """Keep temporally novel tokens (TaR) and, for the rest of the budget, high value-norm tokens (VaN).

    Idea: a video token whose key is nearly the same as the key at the *same spatial position in the
    next frame* is temporally redundant. Redundancy ``r_i = cos(k_i, k_{i + T})`` with ``T`` the tokens
    per frame; the ``floor(tar_ratio * b)`` candidates with the lowest redundancy are kept first
    (TaR), then the remaining budget goes to the highest ``||v_i||`` among the others (VaN).

    Frame structure: at token granularity pass ``group_size = T`` (tokens per frame); a candidate's
    partner is the candidate ``T`` positions later in candidate order (the same spatial token of the
    next frame). Candidates of the last frame have no next frame and are compared with the previous
    frame instead; with a single frame every redundancy is 0. At frame/block granularity each group
    (centroid) is compared with the next group. Features are the keys of all heads (joint) or of one
    head (``per_head``).

    Paper: Kim et al., 2025, "InfiniPot-V: Memory-Constrained KV Cache Compression for Streaming Video
    Understanding" (as summarised by the CoRDS paper: key similarity for temporal redundancy, value
    norm for saliency; TaR ratio 0.5).

    Parameters
    ----------
    tar_ratio:
        Fraction of the budget chosen by temporal redundancy, in [0, 1]; the rest by value norm.
    """

    uses_token_order = True
    needs_frame_length = True

    tar_ratio: float = hyperparameter(0.5, low=0.0, high=1.0,
                                      help="fraction of the budget chosen by temporal redundancy (TaR)")

    def _order_units(self, units: UnitBatch) -> torch.Tensor:
        if units.period is None:  # select() refuses this (needs_frame_length): only a hand-built batch
            raise ValueError(f"{self.name}: units.period is None; the frame period is required (pass group_size "
                             "= tokens per frame at token granularity)")
        redundancy = temporal_redundancy(units.keys, units.rank, units.valid, units.count,
                                         units.unit_at_rank(), units.period)
        n_tar = torch.floor(units.k.to(torch.float64) * self.tar_ratio).to(torch.long)
        tar = top_k_order(redundancy, units.valid, n_tar, units.k_max, descending=False)

        taken = units_to_mask(tar, units.valid.shape[1])
        vnorm = torch.linalg.vector_norm(units.values, dim=-1)
        van = top_k_order(vnorm, units.valid & ~taken, units.k - n_tar, units.k_max)

        t = torch.arange(units.k_max, device=units.k.device)[None, :]
        from_van = torch.gather(van, 1, (t - n_tar[:, None]).clamp_min(0))
        return mask_order(torch.where(t < n_tar[:, None], tar, from_van), units.k)


def temporal_redundancy(
    keys: torch.Tensor,
    rank: torch.Tensor,
    valid: torch.Tensor,
    count: torch.Tensor,
    unit_at_rank: torch.Tensor,
    period: int,
) -> torch.Tensor:
    """Cosine similarity of every unit's key with its same-position unit in the next (else previous) frame.

    Parameters
    ----------
    keys:
        ``[P, M, Dk]``.
    rank, valid, count, unit_at_rank:
        As in :class:`~cords_vllm.selection.batch.UnitBatch`.
    period:
        Rank distance to the same spatial position in the next frame.

    Returns
    -------
    ``[P, M]`` redundancy in [-1, 1]; 0 for units without a partner and for invalid units.
    """
    nxt, prv = rank + period, rank - period
    partner_rank = torch.where(nxt < count[:, None], nxt, torch.where(prv >= 0, prv, -1))
    partner_rank = torch.where(valid, partner_rank, -1)
    partner = torch.gather(unit_at_rank, 1, partner_rank.clamp_min(0))
    has = (partner_rank >= 0) & (partner >= 0)
    idx = partner.clamp_min(0).unsqueeze(-1).expand_as(keys)
    kp = torch.gather(keys, 1, idx)
    num = (keys * kp).sum(-1)
    den = (torch.linalg.vector_norm(keys, dim=-1) * torch.linalg.vector_norm(kp, dim=-1)).clamp_min(1e-30)
    return torch.where(has, num / den, 0.0)
