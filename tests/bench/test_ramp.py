"""The live-stream ramp's pure parts (:mod:`cords_vllm.lab.bench.ramp`): stamped frames never repeat, a level's
verdict and what ran out first, in the documented order."""

from __future__ import annotations

import numpy as np
import pytest

from cords_vllm.lab.bench.ramp import Level, RampResult, StampedFrames, limiting_resource


def level(**changes) -> Level:
    base = {"streams": 8, "window_s": 10.0, "settle_s": 1.0, "pushes": 20, "late_pushes": 0, "worst_lag_s": 0.1,
            "refused": 0, "ended": 0, "compressions": 40.0, "compress_s": 0.2, "pool_use": 0.5, "waiting": 0.0,
            "cpu_cores": {"api_server": 0.3, "engine": 1.0, "client": 0.2}, "chat_gaps": 100, "itl_p50_ms": 10.0,
            "itl_p99_ms": 20.0}
    return Level(**{**base, **changes})


def test_stamped_frames_differ_between_cameras_and_pushes_and_leave_the_clip_alone() -> None:
    base = np.random.default_rng(0).integers(0, 255, (5, 32, 32, 3), dtype=np.uint8)
    pristine = base.copy()
    clips = {(cam, push): StampedFrames(base, cam).clip(push, 4).tobytes() for cam in range(3) for push in range(4)}
    assert len(set(clips.values())) == len(clips)  # no two pushes carry the same bytes
    clip = StampedFrames(base, 1).clip(2, 4)
    assert clip.shape == (4, 32, 32, 3) and clip.dtype == np.uint8
    np.testing.assert_array_equal(clip[:, 1:], base[[3, 4, 0, 1]][:, 1:])  # frames 8..11 of an endless loop
    np.testing.assert_array_equal(base, pristine)
    with pytest.raises(ValueError, match="uint8"):
        StampedFrames(base.astype(np.float32), 0)


def test_a_level_keeps_pace_only_with_pushes_none_late_none_refused_or_ended() -> None:
    assert level().kept_pace
    for changes in ({"late_pushes": 1}, {"refused": 1}, {"ended": 1}, {"pushes": 0}):
        assert not level(**changes).kept_pace, changes
    lv = level()
    assert lv.compress_share == pytest.approx(0.02) and lv.ms_per_compression == pytest.approx(5.0)
    assert level(compressions=0.0).ms_per_compression is None
    assert level(window_s=0.0).compress_share == 0.0


@pytest.mark.parametrize(("changes", "words"), [
    ({"refused": 2, "late_pushes": 3, "waiting": 4.0}, "KV pool"),
    ({"pushes": 0, "waiting": 4.0}, "no push answered"),
    ({"ended": 1, "reasons": ["max-model-len reached"], "late_pushes": 1}, "ended by the server: max-model-len"),
    ({"late_pushes": 1, "cpu_cores": {"api_server": 0.95, "engine": 0.5, "client": 0.95}}, "API server's CPU"),
    ({"late_pushes": 1, "cpu_cores": {"api_server": 0.5, "engine": 0.5, "client": 0.97}}, "client's CPU"),
    ({"late_pushes": 1, "waiting": 2.0}, "engine compute"),
    ({"late_pushes": 1, "pool_use": 0.97}, "engine compute"),
    ({"late_pushes": 1}, "undetermined"),
])
def test_what_ran_out_first_is_named_in_order(changes, words) -> None:
    assert words in limiting_resource(level(**changes))


def test_a_shared_cpu_run_out_is_named_before_any_one_process() -> None:
    busy = level(late_pushes=1, cpu_cores={"api_server": 0.95, "engine": 0.9, "client": 0.1})
    assert limiting_resource(busy, cores=2) == "CPU (all 2 cores busy)"
    assert "API server" in limiting_resource(busy, cores=16)


def test_the_knee_is_the_largest_level_that_kept_pace() -> None:
    result = RampResult([level(streams=8), level(streams=16), level(streams=32, late_pushes=2)], held=16, hold=[],
                        limit="engine compute", fps=2.0, push_frames=8, preroll_pushes=6)
    assert result.knee == 16 and result.level_at(32).late_pushes == 2 and result.level_at(4) is None
    payload = result.to_json()
    assert payload["knee"] == 16 and payload["held"] == 16 and [lv["kept_pace"] for lv in payload["levels"]] == [
        True, True, False]
    assert RampResult([level(refused=1)], None, [], "KV pool", 2.0, 8, 0).knee is None
