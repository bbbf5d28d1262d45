"""One tracker per request on the scheduler side: everything the policy knows about a request, in one object.

A :class:`RequestTracker` is created when the policy first sees a request and dropped when the request
leaves the scheduler (finished or aborted); a preemption resets its compression state (the request
recomputes from scratch). What it caches is keyed by what it depends on, so a streaming session whose prompt
grows with every turn is re-read exactly when it changed: its candidate spans by the number of multimodal
inputs, its admission footprint by its token count, its settings by its overrides (each also by the number
of times the session was re-based: a re-based request's coordinates changed).

A streaming session is re-based at each of its turns (:meth:`RequestTracker.rebase`): the evicted part of its
region leaves the request, so its candidates are those of its held region (a count, see
:meth:`~cords_vllm.compress.plan.CandidateSpans.held_before`) and of its inputs after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cords_vllm.compress.plan import (
    BudgetSettings,
    CandidateSpans,
    RequestCompressionState,
    compressed_footprint_blocks,
    held_candidate_tokens,
    rebase_state,
)
from cords_vllm.config import REQUEST_OVERRIDES_KEY, KVPolicyConfig, KVPolicyConfigError
from cords_vllm.integration.candidates import candidate_spans
from cords_vllm.model_facts import ModelFacts

_NO_SPANS = CandidateSpans(())


@dataclass(frozen=True)
class RequestCompression:
    """What one request holds and what the policy did to it (see :mod:`cords_vllm.integration.inprocess`).

    ``region_blocks``: logical blocks compacted so far; ``held_blocks``: blocks of its row that are not
    null (its real KV footprint now); ``held_candidate_tokens``: candidate tokens physically held;
    ``candidate_tokens``: candidate tokens of its prompt (a re-based stream's: held and not yet compressed,
    evicted ones have left it); ``compressions``, ``evicted_tokens``: so far.
    """

    region_blocks: int
    held_blocks: int
    held_candidate_tokens: int
    candidate_tokens: int
    compressions: int
    evicted_tokens: int

    @property
    def sent_candidate_tokens(self) -> int:
        """Candidate tokens the request was ever sent: those of its prompt and those evicted."""
        return self.candidate_tokens + self.evicted_tokens


def non_null_blocks(row: list, state: RequestCompressionState | None) -> int:
    """Blocks of a request's ``row`` that are not null, without scanning it: ``j - k`` entries of its region
    are null, none elsewhere."""
    return len(row) - (state.region_blocks - state.held_blocks if state else 0)


@dataclass
class RequestTracker:
    """The scheduler side's state of one request.

    Attributes
    ----------
    req_id:
        Engine-internal request id.
    state:
        Its compressed prefix (:class:`~cords_vllm.compress.plan.RequestCompressionState`).
    rebases, removed_tokens:
        Times the request was re-based, and tokens removed from it so far (a streaming session's).
    held_prefix:
        ``(held tokens, held candidates)`` of its region when it was last re-based.
    next_position:
        The first rotary position after its prompt (a streaming session's, counted as its turns arrive);
        ``None`` until needed.
    """

    req_id: str
    state: RequestCompressionState = field(default_factory=RequestCompressionState)
    rebases: int = 0
    removed_tokens: int = 0
    held_prefix: tuple[int, int] = (0, 0)
    next_position: int | None = None
    #: ``(held, removed, first token of the turn)`` between vLLM appending a session's turn and its positions
    #: being counted.
    turn_start: tuple[int, int, int] | None = None
    _spans: tuple[tuple[int, int], CandidateSpans] = ((-1, -1), _NO_SPANS)
    _settings: tuple[Any, BudgetSettings | KVPolicyConfigError] | None = None
    _footprint: tuple[tuple[int, int], int] | None = None
    #: Whether the policy may compress the request (``None``: not decided yet; ``SchedulerCompressor.may_compress``).
    may_compress: bool | None = None

    def reset(self) -> None:
        """Forget the compression state (a preempted request recomputes from scratch)."""
        self.state = RequestCompressionState()

    @property
    def rebased(self) -> bool:
        """Whether tokens have left the request: it can no longer be recomputed from its own tokens."""
        return self.removed_tokens > 0

    def rebase(self, block_size: int) -> tuple[int, int]:
        """Re-base the compression state (see :func:`~cords_vllm.compress.plan.rebase_state`); returns
        ``(held_tokens, removed_tokens)``, the range the caller removes from the request."""
        self.state, held, removed = rebase_state(self.state, block_size)
        self.rebases += 1
        self.removed_tokens += removed
        self.held_prefix = (held, self.state.held_candidates)
        return held, removed

    def candidates(self, request: Any, facts: ModelFacts, config: KVPolicyConfig) -> CandidateSpans:
        """The request's candidate spans (re-read when a streaming session's turn added inputs or it was
        re-based)."""
        key = (self.rebases, len(getattr(request, "mm_features", None) or ()))
        if self._spans[0] != key:
            spans = candidate_spans(request, facts, config.modalities, floor=self.held_prefix[0])
            if self.rebases:
                spans = spans.held_before(*self.held_prefix)
            self._spans = (key, spans)
        return self._spans[1]

    def narrowed(self, request: Any, config: KVPolicyConfig) -> BudgetSettings | KVPolicyConfigError:
        """The request's budget settings with its own overrides applied (``SamplingParams.extra_args``, see
        :meth:`~cords_vllm.config.KVPolicyConfig.narrowed`), or why they are invalid."""
        params = getattr(request, "sampling_params", None)
        overrides = (params.extra_args or {}).get(REQUEST_OVERRIDES_KEY) if params is not None else None
        if not overrides:
            return config.budget_settings
        if self._settings is None or self._settings[0] != overrides:
            try:
                result: BudgetSettings | KVPolicyConfigError = config.narrowed(overrides).budget_settings
            except KVPolicyConfigError as exc:
                result = exc
            self._settings = (overrides, result)
        return self._settings[1]

    def settings(self, request: Any, config: KVPolicyConfig) -> BudgetSettings:
        """The settings the request is planned with: the server's until invalid overrides end it."""
        settings = self.narrowed(request, config)
        return config.budget_settings if isinstance(settings, KVPolicyConfigError) else settings

    def footprint(self, request: Any, candidates: CandidateSpans, settings: BudgetSettings,
                  block_size: int) -> int:
        """Blocks the request holds at most (re-computed when its token count changed)."""
        key = (request.num_tokens, self.rebases)
        if self._footprint is None or self._footprint[0] != key:
            self._footprint = (key, compressed_footprint_blocks(
                request.num_tokens, candidates.total, settings, block_size))
        return self._footprint[1]

    @property
    def known_footprint(self) -> int | None:
        """The footprint computed last (``None`` before admission)."""
        return None if self._footprint is None else self._footprint[1]

    def describe(self, request: Any, row: list, facts: ModelFacts, config: KVPolicyConfig,
                 block_size: int) -> RequestCompression:
        """What ``request`` holds now (``row``: its row of blocks)."""
        state, candidates = self.state, self.candidates(request, facts, config)
        return RequestCompression(
            region_blocks=state.region_blocks, held_blocks=non_null_blocks(row, state),
            held_candidate_tokens=held_candidate_tokens(state, candidates, request.num_computed_tokens,
                                                        block_size),
            candidate_tokens=candidates.total, compressions=state.compressions,
            evicted_tokens=state.evicted_tokens)
