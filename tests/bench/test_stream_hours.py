"""The hours-long stream benchmark's plan: questions, the video's marks, server sizing. Fast: no server."""

from __future__ import annotations

import numpy as np

from cords_vllm.lab.bench.stream_hours import HoursConfig, StreamVideo, plan_questions, serve_flags
from cords_vllm.lab.vqa import COLOURS, shipped_checkpoint


def _saturated(clip: np.ndarray) -> np.ndarray:
    f = clip.astype(np.int16)
    return (f.max(-1) - f.min(-1)) > 80  # [F, S, S]


def test_questions_follow_the_checkpoints_and_change_colour() -> None:
    cfg = HoursConfig(hours=1.0, size=112, ask_every_min=15, old_event_min=5)
    questions = plan_questions(cfg)
    assert len(questions) == 2 * 4  # 15, 30, 45 and 60 minutes
    for k in range(1, 5):
        recent, old = (q for q in questions if q.checkpoint == k)
        assert recent.kind == "recent" and old.kind == "old" and recent.ask_push == old.ask_push
        assert (recent.ask_push + 1) * cfg.clip_seconds == k * 15 * 60
        assert recent.event_push == recent.ask_push - 1
        assert (old.ask_push - old.event_push) * cfg.clip_seconds == 5 * 60
        assert recent.answer != old.answer
        if k > 1:
            before = [q for q in questions if q.checkpoint == k - 1]
            assert recent.answer != before[0].answer and old.answer != before[1].answer


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
