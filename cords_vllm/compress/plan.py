"""Pure compression planning over logical token ranges and block ids (no vLLM import, no tensors).

This module is the one home of what crosses from the scheduler to the workers: :data:`NULL_BLOCK_ID`,
:class:`CandidateSpans`, :class:`CompressionPlan` (all host integers) and :class:`RequestCompressionState`.

Model of a request's KV row (one full-attention KV cache group):

* The row is LOGICAL: entry ``i`` covers logical tokens ``[i*bs, (i+1)*bs)``, ``num_computed_tokens`` stays
  logical, and positions / M-RoPE / slot mapping are computed from logical indices as vLLM always does.
* Compression rewrites a prefix ``row[:j]`` (the *old region*, block-aligned, ending before the recent
  window) as ``k`` held blocks followed by ``j - k`` null blocks (id 0). The ``k`` kept blocks are the first
  ``k`` of the blocks the region held: the kept tokens are compacted into them in logical order, and the
  other blocks return to the pool. No fresh block is allocated, so compression never needs free blocks and
  cannot fail under pool pressure (the prototype's "allocate fresh, then free" needed free blocks exactly
  when the pool was full). This is safe because no block of a request the policy may compress is shared or
  hashed: such a request neither reads nor fills vLLM's prefix cache.
* Attention sees a *physical view* of the row, null entries moved to the end and ``seq_len`` reduced by
  ``bs`` per null entry (:mod:`cords_vllm.compress.attention_view`). That is why kept tokens must fill whole
  blocks: the number of candidate tokens kept is rounded DOWN, so that protected + kept tokens in the region
  is a multiple of ``bs`` and the request then holds at most ``budget`` video tokens in all (when its protected
  tokens leave room): neither the block rounding nor the recent window sets a floor above the budget.

Only candidate tokens are evicted: those of the request's videos and images (the scheduler chooses the
modalities; "candidate" below means either, a frame sent as an image included). Every
other token of the region (system text, the question, text between inputs) is protected: kept in every
layer and not counted in the budget. The recent window is the ``recent`` newest computed video tokens, always
kept: the region ends at the last full block computed, and the recent video tokens inside it are protected for
that compression (the workers protect the region's newest ``num_recent`` video tokens), so no block boundary leaves
older video past the region where nothing could evict it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cords_vllm.utils import cdiv

#: vLLM's null block: the block id of evicted row entries (``BlockPool.null_block`` is always block 0).
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class CandidateSpans:
    """Logical ``[start, end)`` ranges of a request's candidate tokens (those of its videos and images that may
    be evicted), sorted and disjoint."""

    spans: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        previous = 0
        for start, end in self.spans:
            if not previous <= start < end:
                raise ValueError(f"candidate spans must be sorted, disjoint and non-empty: {self.spans}")
            previous = end

    @property
    def total(self) -> int:
        return sum(end - start for start, end in self.spans)

    def count_before(self, position: int) -> int:
        """Video tokens with logical index ``< position``."""
        return sum(max(0, min(end, position) - start) for start, end in self.spans)

    def count_in(self, start: int, end: int) -> int:
        return self.count_before(end) - self.count_before(start)

    def position_of(self, n: int) -> int:
        """Logical index of the ``n``-th candidate token (0-based); ``n`` must be ``< total``."""
        if not 0 <= n < self.total:
            raise IndexError(f"candidate token {n} out of range (0..{self.total - 1})")
        for start, end in self.spans:
            if n < end - start:
                return start + n
            n -= end - start
        raise AssertionError("unreachable")

    def held_before(self, floor: int, held: int) -> CandidateSpans:
        """These spans as a re-based request sees them: the ``held`` candidates its held region ``[0, floor)``
        keeps (different layers keep different tokens there, so their places are not one list) stand as one
        span right before ``floor``, and the spans from ``floor`` on are the request's own, clipped at it.

        Every count the planner takes from ``floor`` on is exact, so a re-based request is planned exactly as it
        would have been before re-basing (:func:`rebase_state`).
        """
        tail = tuple((max(start, floor), end) for start, end in self.spans if end > floor)
        return CandidateSpans((((floor - held, floor),) if held else ()) + tail)



def region_entries(row: Any, held_blocks: int, prev_region_blocks: int, region_blocks: int) -> list:
    """The entries of ``row`` a compression reads: the region's kept blocks ``row[:held_blocks]``, then the
    blocks that entered it, ``row[prev_region_blocks:region_blocks]`` (never the evicted, null part)."""
    return [*row[:held_blocks], *row[prev_region_blocks:region_blocks]]


@dataclass
class RequestCompressionState:
    """What the scheduler remembers about one request's compressed prefix.

    ``region_blocks`` logical blocks ``[0, region_blocks)`` have been compacted; they hold
    ``held_blocks`` physical blocks, of which ``held_candidates`` tokens are video.
    """

    region_blocks: int = 0
    held_blocks: int = 0
    held_candidates: int = 0
    compressions: int = 0
    evicted_tokens: int = 0


@dataclass(frozen=True)
class CompressionPlan:
    """One compression of one request, decided by the scheduler and carried out by every worker.

    Plain data: it crosses to the workers on the ``SchedulerOutput`` (pickled in multiprocess mode).

    Attributes
    ----------
    req_id:
        Engine-internal request id.
    block_size:
        Tokens per KV block.
    prev_region_blocks, region_blocks:
        The old region before (``j_prev``) and after (``j``) this compression, in logical blocks.
    prev_held_blocks:
        Blocks the region held before (``k_prev``): entries ``row[:k_prev]``; ``row[k_prev:j_prev]`` are null.
    src_blocks:
        Block ids the region held before, in row order: ``k_prev`` compacted blocks holding the
        previously kept tokens, then the ``j - j_prev`` blocks of logical tokens ``[j_prev*bs, j*bs)``.
    num_keep:
        Tokens kept in the region (``k * bs``), protected ones included.
    num_keep_candidates:
        Video tokens kept in the region (the selection budget).
    num_held_candidates:
        Video tokens of the region the selection may evict (its candidates): the region's video tokens but the
        ``num_recent`` newest.
    candidates:
        The request's candidate spans (the workers decide which held tokens are candidates).
    num_recent:
        The region's newest video tokens that belong to the recent window: protected in this compression (kept, not
        counted in ``num_keep``'s candidates), video again for the next one.
    """

    req_id: str
    block_size: int
    prev_region_blocks: int
    region_blocks: int
    prev_held_blocks: int
    src_blocks: tuple[int, ...]
    num_keep: int
    num_keep_candidates: int
    num_held_candidates: int
    candidates: CandidateSpans = field(repr=False)
    num_recent: int = 0

    @property
    def kept_blocks(self) -> tuple[int, ...]:
        return self.src_blocks[: self.num_keep // self.block_size]

    @property
    def freed_blocks(self) -> tuple[int, ...]:
        """The source blocks this compression frees: the workers still read kept tokens from them in this step."""
        return self.src_blocks[self.num_keep // self.block_size:]

    @property
    def num_held(self) -> int:
        return len(self.src_blocks) * self.block_size

    def held_entries(self, row: Any) -> list:
        """The entries of ``row`` (blocks or ids) the region held before this compression, in row order: the
        :attr:`src_blocks` as the row stores them (see :func:`region_entries`)."""
        return region_entries(row, self.prev_held_blocks, self.prev_region_blocks, self.region_blocks)

    def compact_row(self, row: Any, null: Any) -> None:
        """Rewrite ``row`` (a list of blocks or ids, or a numpy row) to ``kept blocks + nulls`` up to the new
        region end, touching only entries that change: the kept blocks and the blocks that entered the region.

        Before: ``row[:k_prev]`` held, ``row[k_prev:j_prev]`` null, ``row[j_prev:j]`` new. After: ``row[:k]``
        the kept blocks (the first ``k`` of :attr:`src_blocks`, in the row's own type), ``row[k:j]`` null.
        The cost is proportional to ``k_prev + (j - j_prev)``, never to the stream's evicted length.
        """
        k, k_prev = self.num_keep // self.block_size, self.prev_held_blocks
        j_prev, j = self.prev_region_blocks, self.region_blocks
        row[:k] = self.held_entries(row)[:k]
        if k < k_prev:
            row[k:k_prev] = [null] * (k_prev - k)
        row[max(k, j_prev):j] = [null] * (j - max(k, j_prev))


@dataclass(frozen=True)
class BudgetSettings:
    """The planner's view of :class:`~cords_vllm.config.KVPolicyConfig`."""

    budget: int
    recent: int
    slack: int


def held_candidate_tokens(state: RequestCompressionState, candidates: CandidateSpans, num_computed: int,
                      block_size: int) -> int:
    """Video tokens physically held for a request with ``num_computed`` logical tokens."""
    return state.held_candidates + candidates.count_in(state.region_blocks * block_size, num_computed)


@dataclass(frozen=True)
class _Decision:
    region_blocks: int
    kept_blocks: int
    num_keep_candidates: int
    selectable: int
    region_held: int
    num_recent: int


def _decide(state: RequestCompressionState, candidates: CandidateSpans, num_computed: int, num_prompt: int,
            settings: BudgetSettings, bs: int) -> _Decision | None:
    """The compression a request with ``num_computed`` logical tokens gets now, or ``None``.

    The region ends at the last full block computed. Its candidates are its video tokens but the newest ones of the
    recent window; it keeps, of them, what the budget leaves once the recent window and the video past the region
    are counted, rounded down to whole blocks (never below the blocks its protected tokens fill).
    """
    if num_computed >= num_prompt or candidates.total == 0:
        return None
    held = held_candidate_tokens(state, candidates, num_computed, bs)
    if held <= settings.budget + settings.slack or candidates.count_before(num_computed) <= settings.recent:
        return None
    j, j_prev = num_computed // bs, state.region_blocks
    if j < j_prev:
        return None
    region_held_candidates = state.held_candidates + candidates.count_in(j_prev * bs, j * bs)
    region_held = state.held_blocks * bs + (j - j_prev) * bs
    past = held - region_held_candidates  # video past the region (the partial block): all recent, as recent >= it
    num_recent = min(max(settings.recent - past, 0), region_held_candidates)
    selectable = region_held_candidates - num_recent
    protected = region_held - selectable  # text and the recent window's tokens in the region
    k = max(cdiv(protected, bs), (protected - num_recent + settings.budget - past) // bs)
    num_keep_candidates = k * bs - protected
    if num_keep_candidates >= selectable:
        return None  # rounding to whole blocks leaves nothing to evict
    return _Decision(j, k, num_keep_candidates, selectable, region_held, num_recent)


def plan_compression(req_id: str, row: Sequence[int], num_computed: int, num_prompt: int, candidates: CandidateSpans,
                     state: RequestCompressionState, settings: BudgetSettings,
                     block_size: int) -> CompressionPlan | None:
    """Decide whether to compress a request now and how; ``None`` if not.

    Compresses when the request is still in its prompt (decode never compresses), holds more than ``budget + slack``
    video tokens and more than ``recent``; the region (up to the last full block) keeps its recent video tokens and,
    of the older ones, what the budget leaves, rounded down to whole blocks: the request then holds at most
    ``budget`` video tokens when its protected tokens leave room. :func:`next_compression_point` says where the next
    such position lies.

    Parameters
    ----------
    row:
        The request's block ids (``0`` = null), logical order; may extend past ``num_computed``.
    num_computed:
        Logical tokens whose KV is in the cache or being written by an in-flight step.
    """
    bs = block_size
    decision = _decide(state, candidates, num_computed, num_prompt, settings, bs)
    if decision is None:
        return None
    j, k = decision.region_blocks, decision.kept_blocks
    if len(row) < j:
        raise ValueError(f"request {req_id}: row has {len(row)} blocks, region needs {j}")
    src = region_entries(row, state.held_blocks, state.region_blocks, j)
    if NULL_BLOCK_ID in src or len(src) * bs != decision.region_held:
        raise AssertionError(f"request {req_id}: region holds {len(src)} blocks, state expects "
                             f"{decision.region_held // bs}")
    return CompressionPlan(
        req_id=req_id, block_size=bs, prev_region_blocks=state.region_blocks, region_blocks=j,
        prev_held_blocks=state.held_blocks, src_blocks=tuple(src), num_keep=k * bs,
        num_keep_candidates=decision.num_keep_candidates, num_held_candidates=decision.selectable,
        candidates=candidates, num_recent=decision.num_recent,
    )


def next_compression_point(state: RequestCompressionState, candidates: CandidateSpans, num_computed: int,
                           num_prompt: int, settings: BudgetSettings, block_size: int) -> int | None:
    """The next logical position ``P > num_computed`` at which the request is compressed, or ``None``.

    ``P`` is the smallest ``num_computed`` for which :func:`plan_compression` plans a compression, given the
    request's state. It depends only on the request's token layout, its compression state and the policy's
    settings, never on batching or chunk sizes; the scheduler ends a prefill chunk at ``P`` so that the
    request is compressed there, whatever the step sizes. Since the state after a compression is itself a
    function of the same inputs, the whole sequence of points (and what each keeps) is too.
    """
    bs = block_size
    if candidates.total == 0 or num_computed + 1 >= num_prompt:
        return None
    # first position holding more than budget + slack video tokens (the held count only grows with P)
    need = (candidates.count_before(state.region_blocks * bs) + settings.budget + settings.slack
            - state.held_candidates + 1)
    need = max(need, settings.recent + 1)
    if need > candidates.total:
        return None
    point = max(num_computed + 1, candidates.position_of(need - 1) + 1)

    def decides(p: int) -> bool:
        return _decide(state, candidates, p, num_prompt, settings, bs) is not None

    while point < num_prompt:
        # Within one block the region's end is fixed and whether a compression is planned only turns on as P grows
        # (the video past the region and the held count grow, the recent window's share of the region shrinks):
        # the first point of the block that plans one is found by bisection.
        end = min((point // bs + 1) * bs, num_prompt)
        if decides(end - 1):
            low, high = point, end - 1
            while low < high:
                mid = (low + high) // 2
                low, high = (low, mid) if decides(mid) else (mid + 1, high)
            return low
        point = end
    return None


def apply_plan(state: RequestCompressionState, plan: CompressionPlan) -> RequestCompressionState:
    """The request's state after ``plan`` (pure)."""
    return RequestCompressionState(
        region_blocks=plan.region_blocks,
        held_blocks=plan.num_keep // plan.block_size,
        held_candidates=plan.num_keep_candidates + plan.num_recent,
        compressions=state.compressions + 1,
        evicted_tokens=state.evicted_tokens + plan.num_held_candidates - plan.num_keep_candidates,
    )


@dataclass(frozen=True)
class RebasePlan:
    """A streaming session's next turn, as every process applies it (host integers).

    When a session's next turn arrives, the evicted part of its compressed region leaves the request: the
    ``removed_tokens`` entries right after its ``held_tokens`` held ones (the null blocks of its row, the tokens,
    the positions and the multimodal inputs they stood for), so the request's length, host state and per-turn
    cost follow what it holds plus the new turn, never what it has pushed. Held tokens keep their original
    rotary positions (their keys were cached after rotary); the turn's new tokens continue from the session's
    largest position, ``next_position`` being the first position after the turn's prompt.

    Attributes
    ----------
    req_id:
        Engine-internal request id.
    held_tokens:
        Tokens of the held region, kept in place (a multiple of the block size; ``0`` before any compression).
    removed_tokens:
        Tokens removed right after them (a multiple of the block size, possibly ``0``).
    next_position:
        The first rotary position after the turn's prompt, as the scheduler counts it
        (:func:`~cords_vllm.compress.positions.next_position`); the workers check that theirs agree.
    """

    req_id: str
    held_tokens: int
    removed_tokens: int
    next_position: int


def rebase_state(state: RequestCompressionState, block_size: int) -> tuple[RequestCompressionState, int, int]:
    """A compressed request's state once its evicted entries are removed, with ``(held_tokens, removed_tokens)``.

    The region ``[0, j)`` of ``k`` held blocks and ``j - k`` null ones becomes ``[0, k)``: nothing else about
    the request's compression changes.
    """
    held, removed = state.held_blocks * block_size, (state.region_blocks - state.held_blocks) * block_size
    rebased = RequestCompressionState(region_blocks=state.held_blocks, held_blocks=state.held_blocks,
                                      held_candidates=state.held_candidates, compressions=state.compressions,
                                      evicted_tokens=state.evicted_tokens)
    return rebased, held, removed


def compressed_footprint_blocks(num_tokens: int, candidate_tokens: int, settings: BudgetSettings,
                                block_size: int) -> int:
    """Upper bound on the blocks a request of ``num_tokens`` (``candidate_tokens`` of them candidates: video and
    image tokens) holds at once.

    Other tokens are all held. Prefill chunks end at compression points
    (:func:`next_compression_point`), where a request holds at most ``budget + slack`` video tokens plus what the
    kept region's protected tokens round up (two blocks bound it), whatever the chunk sizes.
    """
    held_candidates = min(candidate_tokens, settings.budget + settings.slack + 2 * block_size)
    return cdiv(num_tokens - candidate_tokens + held_candidates, block_size)


def stream_footprint_blocks(max_text_tokens: int, settings: BudgetSettings, block_size: int) -> int:
    """Blocks one request holds at most, however long its video, with at most ``max_text_tokens`` non-video
    tokens: what replaces vLLM's "one max-model-len request fits the pool" start-up rule under a policy."""
    candidates = settings.budget + settings.slack + 2 * block_size
    return compressed_footprint_blocks(max_text_tokens + candidates, candidates, settings, block_size)
