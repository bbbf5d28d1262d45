"""What an hours-long stream run records: one row per push, one per question, and one policy's whole run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PushRecord:
    """One push: the video and video tokens pushed so far, KV held after it, server memory, wall time.

    ``kv_blocks``: the stream listing's (published up to 0.5 s late; ``None`` before the first publication);
    ``pool_blocks``: blocks in use in the pool (``/metrics``), the stream being the only request;
    ``positions``: rotary positions used, estimated as the stream's protected (text) tokens ``text_tokens`` plus
    each clip's extent; ``cpu_s``: CPU seconds the server's processes spent during the push (unlike ``push_s``,
    hardly changed by other work on the machine); ``t_s``: seconds since the first push; ``load1``: the machine's
    one-minute load average.
    """

    push: int
    video_s: float
    video_tokens: int
    kv_blocks: int | None
    pool_blocks: int
    text_tokens: int
    positions: int
    rss_mb: float
    rss_by_process: dict[str, float]
    push_s: float
    cpu_s: float
    t_s: float
    load1: float


@dataclass
class QuestionRecord:
    """One question asked: when (push, video time), about which event (its video time), the answer given."""

    checkpoint: int
    kind: str
    push: int
    video_s: float
    event_video_s: float
    question: str
    answer: str
    predicted: str
    correct: bool
    stale: bool
    ask_s: float


@dataclass
class PolicyRun:
    """What one policy's stream did.

    ``stopped``: why the stream ended before its last push (the 410's message), ``stopped_push`` the push
    refused (or after which a question was refused: ``stopped_during``); ``errors``: other error answers (status
    and message); ``log_errors``: error lines of the server log.
    """

    policy: str
    flags: list[str]
    pool_blocks: int
    footprint_blocks: int | None = None
    records: list[PushRecord] = field(default_factory=list)
    questions: list[QuestionRecord] = field(default_factory=list)
    stopped: str | None = None
    stopped_push: int | None = None
    stopped_status: int | None = None
    stopped_during: str | None = None
    errors: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    startup_s: float = 0.0
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """Compact JSON: per-push values as columns."""
        out = {k: v for k, v in asdict(self).items() if k not in ("records", "questions")}
        recs = self.records
        names = sorted({n for r in recs for n in r.rss_by_process})
        out["pushes"] = {
            "push": [r.push for r in recs], "video_s": [r.video_s for r in recs],
            "video_tokens": [r.video_tokens for r in recs], "kv_blocks": [r.kv_blocks for r in recs],
            "pool_blocks": [r.pool_blocks for r in recs], "text_tokens": [r.text_tokens for r in recs],
            "positions": [r.positions for r in recs], "rss_mb": [round(r.rss_mb, 1) for r in recs],
            "push_s": [round(r.push_s, 3) for r in recs], "cpu_s": [round(r.cpu_s, 2) for r in recs],
            "t_s": [round(r.t_s, 1) for r in recs], "load1": [round(r.load1, 2) for r in recs],
            "rss_mb_by_process": {n: [round(r.rss_by_process.get(n, 0.0), 1) for r in recs] for n in names},
        }
        out["questions"] = [asdict(q) for q in self.questions]
        return out
