"""The rule of ``granularity: "auto"`` and its configuration keys."""

from __future__ import annotations

import pytest

from cords_vllm.compress.unit_choice import AUTO, DEFAULT_MIN_UNITS, Unit, compression_unit
from cords_vllm.config import KVPolicyConfig, KVPolicyConfigError


@pytest.mark.parametrize("fixed", ["token", "frame", "block"])
def test_a_fixed_unit_is_kept_whatever_the_count(fixed):
    for kept, frame in [(0, 16), (16, 16), (10_000, 16), (64, None)]:
        assert compression_unit(fixed, kept, frame) == Unit(fixed)


@pytest.mark.parametrize(("kept", "frame", "min_units", "unit"), [
    (32 * 16, 16, 32, Unit("frame")),       # exactly min_units whole frames
    (32 * 16 - 1, 16, 32, Unit("block", 8)),  # one token short: runs of half a frame
    (32 * 4, 16, 32, Unit("block", 4)),
    (32 * 6, 16, 32, Unit("block", 4)),     # runs divide the frame: 6 does not divide 16
    (63, 16, 32, Unit("token")),
    (17, 16, 32, Unit("token")),            # a tight budget: single tokens
    (3 * 256, 256, 3, Unit("frame")),
    (384, 64, 32, Unit("block", 8)),        # 2,048 candidates of 64-token frames, 384 kept
    (1536, 256, 32, Unit("block", 32)),
    (1536, 324, 32, Unit("block", 36)),     # 18 x 18-token frames: the largest divisor of 324 up to 48
    (4096, None, 32, Unit("block", 128)),   # frames unknown: the widest run keeping min_units
    (40, None, 32, Unit("token")),
    (4096, 0, 32, Unit("block", 128)),
])
def test_auto_keeps_min_units_of_the_widest_run_that_divides_a_frame(kept, frame, min_units, unit):
    chosen = compression_unit(AUTO, kept, frame, min_units)
    assert chosen == unit
    width = {"token": 1, "frame": frame}.get(chosen.granularity, chosen.group_size)
    assert kept // width >= min_units or width == 1


def test_auto_is_the_default_and_min_units_round_trips():
    config = KVPolicyConfig.parse("cords", {})
    assert (config.granularity, config.min_units) == (AUTO, DEFAULT_MIN_UNITS)
    config = KVPolicyConfig.parse("cords", {"min_units": 3})
    assert config.min_units == 3 and KVPolicyConfig.parse("cords", config.to_json()) == config
    assert config.settings()["granularity"] == AUTO


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_a_bad_min_units_stops_the_configuration(value):
    with pytest.raises(KVPolicyConfigError, match="'min_units' must be an integer >= 1"):
        KVPolicyConfig.parse("cords", {"min_units": value})


def test_an_unknown_granularity_names_auto_among_the_choices():
    with pytest.raises(KVPolicyConfigError, match=r"\['auto', 'token', 'frame', 'block'\]"):
        KVPolicyConfig.parse("cords", {"granularity": "frames"})
