"""The selection unit of one compression when the configuration says ``granularity: "auto"`` (the default).

Frame granularity (the paper's) selects whole frames by their centroids: cheap, since the greedy run takes one
step per kept *frame* over one unit per frame. With only a few frames to keep it fails: farthest-first coverage
over two or three units picks the most atypical frames, not those a question needs, and a frame's centroid
dilutes what makes a few of its tokens stand out. On the shipped video-QA model (the tuning split, 128 questions,
frames of 16 tokens) a compression keeping about one frame answered 57% (64-frame videos) and 53% (128 frames) at
frame granularity, against 98% and 95% at token granularity; about four frames, 92% against 96%
(docs/results.md, "Choosing the unit"). Token granularity, though, takes one greedy step per kept *token* over
every candidate token: on two idle CPU cores (the selector alone, 2 KV heads of 128; ``benchmarks/unit_cost.py``)
74 ms where frames take 2.0 ms (2,048 candidates, 384 kept), and 1.6 s where they take 16.5 ms (16,384 candidates,
1,536 kept); ``auto`` takes 5.1 and 8.3 ms there.

``auto`` takes the unit between the two that keeps at least ``min_units`` units: runs of ``g`` consecutive
candidate tokens, ``g`` the largest divisor of the request's largest frame (so runs never straddle two whole
frames) with ``g * min_units`` at most the tokens the compression keeps. ``g`` equal to the frame is frame
granularity (the real, labelled frames), ``g = 1`` is token granularity, anything between is fixed runs of ``g``
candidates (the ``block`` path with ``g``-token groups). The greedy run then takes ``min_units`` to ``2 min_units``
steps over ``candidates / g`` units, whatever the budget. Where the model's frames are unknown, ``g`` is the largest
run that keeps ``min_units`` units. The rule reads host integers the planner and the worker already hold: no device
work, no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The configuration value that lets each compression choose its unit (:func:`compression_unit`).
AUTO = "auto"
#: ``min_units`` default: the fewest units an ``auto`` compression keeps.
DEFAULT_MIN_UNITS = 32


@dataclass(frozen=True)
class Unit:
    """One compression's selection unit: ``granularity`` (``"token"``, ``"frame"`` or ``"block"``) and, for
    ``"block"``, the tokens per group (``None``: the KV block size, the configured ``block`` unit)."""

    granularity: str
    group_size: int | None = None


def compression_unit(granularity: str, kept_video_tokens: int, frame_tokens: int | None,
                     min_units: int = DEFAULT_MIN_UNITS) -> Unit:
    """The unit one compression selects: ``granularity`` itself unless it is :data:`AUTO`.

    Parameters
    ----------
    granularity:
        The configured unit: ``"token"``, ``"frame"``, ``"block"`` or ``"auto"``.
    kept_video_tokens:
        Video tokens the compression keeps of its candidates (``num_keep_candidates``).
    frame_tokens:
        Tokens of the request's largest frame so far, or ``None`` where the model's frames are unknown.
    min_units:
        Under ``auto``, the fewest units the compression keeps (``>= 1``).
    """
    if granularity != AUTO:
        return Unit(granularity)
    widest = max(kept_video_tokens // min_units, 1)  # the largest run that still keeps min_units of them
    if not frame_tokens or frame_tokens <= 0:
        run = widest
    else:
        run = max(d for d in range(1, min(widest, frame_tokens) + 1) if frame_tokens % d == 0)
        if run == frame_tokens:
            return Unit("frame")
    return Unit("token") if run == 1 else Unit("block", run)
