"""The hours-long stream benchmark's plan: questions, the video's marks, server sizing. Fast: no server."""

from __future__ import annotations

import numpy as np
import pytest

from cords_vllm.lab.bench.stream_hours import (
    HoursConfig,
    PolicyRun,
    PushRecord,
    QuestionRecord,
    StreamVideo,
    agreement_with_none,
    named_colour,
    plan_questions,
    rss_growth,
    serve_flags,
)
from cords_vllm.lab.vqa import COLOURS, shipped_checkpoint


def _saturated(clip: np.ndarray) -> np.ndarray:
    f = clip.astype(np.int16)
    return (f.max(-1) - f.min(-1)) > 80  # [F, S, S]


@pytest.mark.parametrize("old_after_recent", [False, True])
def test_questions_follow_the_checkpoints_and_change_colour(old_after_recent: bool) -> None:
    cfg = HoursConfig(hours=1.0, size=112, ask_every_min=15, old_event_min=5, old_after_recent=old_after_recent)
    questions = plan_questions(cfg)
    assert len(questions) == 2 * 4  # 15, 30, 45 and 60 minutes
    assert [q.ask_push for q in questions] == sorted(q.ask_push for q in questions)  # in the order they are asked
    for k in range(1, 5):
        recent = next(q for q in questions if q.checkpoint == k and q.kind == "recent")
        old = next(q for q in questions if q.checkpoint == k and q.kind == "old")
        assert (recent.ask_push + 1) * cfg.clip_seconds == k * 15 * 60
        assert recent.event_push == recent.ask_push - 1
        assert (old.ask_push - old.event_push) * cfg.clip_seconds == 5 * 60
        # by default the old question comes before the dot is shown; otherwise with the recent one, after it
        assert (old.ask_push >= recent.event_push) == old_after_recent
        assert old.ask_push == recent.ask_push - (0 if old_after_recent else 2)
        assert recent.answer != old.answer
        if k > 1:
            before = {q.kind: q for q in questions if q.checkpoint == k - 1}
            assert recent.answer != before["recent"].answer and old.answer != before["old"].answer


def test_an_old_event_before_the_stream_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="before the stream starts"):
        plan_questions(HoursConfig(hours=0.5, size=112, ask_every_min=2, old_event_min=1.95))


def test_only_event_clips_show_a_mark_of_the_asked_colour() -> None:
    cfg = HoursConfig(hours=0.2, size=112, ask_every_min=2, old_event_min=1)
    questions = plan_questions(cfg)
    video = StreamVideo(cfg, questions)
    events = {q.event_push: q for q in questions}
    for push in range(cfg.pushes):
        clip = video.frames(push)
        assert clip.shape == (cfg.clip_frames, 112, 112, 3)
        marked = _saturated(clip[:, :100])  # above the timestamp row
        if push not in events:
            assert not marked.any(), push
            continue
        q = events[push]
        frames = marked.reshape(len(marked), -1).any(1)
        assert frames.all() if q.kind == "recent" else frames.sum() == 2  # a dot stays, a square one patch
        rgb = clip[:, :100][marked].astype(np.float32).mean(0)
        nearest = min(COLOURS, key=lambda n: np.linalg.norm(rgb - np.asarray(COLOURS[n])))
        assert nearest == q.answer
    assert not np.array_equal(video.frames(0)[:, -6:], video.frames(1)[:, -6:])  # every push has its own stamp


def test_policy_servers_hold_a_stream_plus_one_push_and_none_the_rotary_range() -> None:
    cfg = HoursConfig(size=448)
    flags = serve_flags(shipped_checkpoint(), "cords", cfg)
    max_model_len = int(flags[flags.index("--max-model-len") + 1])
    held = cfg.max_text_tokens + cfg.budget + cfg.slack
    assert held + cfg.clip_tokens < max_model_len <= held + cfg.clip_tokens + 1024 + 2 * cfg.block_size
    none = serve_flags(shipped_checkpoint(), "none", cfg)
    assert none[none.index("--max-model-len") + 1] == str(cfg.max_positions)
    assert cfg.clip_tokens == 1024 and cfg.clip_positions == 18

    # a served chat model: its own dtype, a KV pool of half the bytes per block at 16 bits
    half = serve_flags(shipped_checkpoint(), "cords", HoursConfig(size=448, dtype="auto"))
    assert half[half.index("--dtype") + 1] == "auto"
    pool = int(flags[flags.index("--kv-cache-memory-bytes") + 1])
    assert int(half[half.index("--kv-cache-memory-bytes") + 1]) * 2 == pool


def test_answers_are_scored_by_the_first_colour_they_name() -> None:
    assert named_colour("red") == "red" and named_colour(" blue\n") == "blue"
    assert named_colour("The dot is Green; the square was red.") == "green"
    assert named_colour("I cannot tell.") == "I cannot tell."
    assert named_colour("reddish") == "reddish"  # whole words only


def test_agreement_with_none_counts_only_the_questions_both_policies_answered() -> None:
    def run(policy: str, answers: dict[tuple[int, str], str]) -> PolicyRun:
        out = PolicyRun(policy, [], 10)
        truth = {"old": "red", "recent": "blue"}
        for (checkpoint, kind), predicted in answers.items():
            out.questions.append(QuestionRecord(checkpoint, kind, 0, 0.0, 0.0, "", truth[kind], predicted,
                                                predicted == truth[kind], False, 0.0))
        return out

    none = run("none", {(1, "old"): "red", (1, "recent"): "red"})  # none stopped after checkpoint 1
    cords = run("cords", {(1, "old"): "red", (1, "recent"): "blue", (2, "old"): "red", (2, "recent"): "blue"})
    uniform = run("uniform", {(1, "old"): "green", (1, "recent"): "red"})
    got = agreement_with_none([none, cords, uniform])
    assert got["cords"] == {"questions": 2, "same_answer": 1, "right": 2, "none_right": 1}
    assert got["uniform"] == {"questions": 2, "same_answer": 1, "right": 0, "none_right": 1}
    assert agreement_with_none([cords]) == {}


def test_rss_growth_tells_growth_that_levels_off_from_growth_that_goes_on() -> None:
    def records(mb: list[float]) -> list[PushRecord]:
        return [PushRecord(i, (i + 1) * 4.0, 0, None, 0, 0, 0, m, {}, 0.0, 0.0, 0.0, 0.0) for i, m in enumerate(mb)]

    n = 900  # one hour of 4-second pushes
    step = [1000.0 + min(i, n // 3) * 0.1 for i in range(n)]  # +30 MB in the first 20 minutes, then flat
    leak = [1000.0 + i * 0.1 for i in range(n)]  # +90 MB an hour, all the way
    levels_off, goes_on = rss_growth(records(step)), rss_growth(records(leak))
    assert levels_off["pct_per_hour"] > 0 and abs(levels_off["late_pct_per_hour"]) < 1e-6
    assert goes_on["late_pct_per_hour"] == pytest.approx(goes_on["pct_per_hour"]) == pytest.approx(
        100 * 90 / goes_on["start_mb"], rel=1e-3)
