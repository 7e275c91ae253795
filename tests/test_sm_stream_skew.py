"""experiments/sm_stream_skew.py's summary (numpy only; the stream itself needs a GPU and Triton):
made-up launches where one SM is slow every time, whichever program it runs, against noise."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from sm_stream_skew import skew_summary  # noqa: E402


def _launches(slow_sm: bool, launches: int = 10, programs: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    sm = np.array([rng.permutation(programs) for _ in range(launches)])  # a new SM per program each launch
    dur = 100.0 + rng.normal(0, 0.1, (launches, programs))
    if slow_sm:
        dur = dur + 10.0 * (sm == 5) + 2.0 * (sm == 2)  # SM 5 10% slower, SM 2 2%, every launch
    return dur, sm


def test_a_slow_sm_is_told_from_its_programs_and_from_noise():
    out = skew_summary(*_launches(slow_sm=True))
    assert out["slowest_over_median"]["median"] == pytest.approx(0.10, abs=0.005)
    assert out["slowest_sms"][-2:] == [2, 5] and out["sm_relative_time"]["5"] == pytest.approx(1.10, abs=0.005)
    assert out["corr_halves_by_sm"] > 0.99 and abs(out["corr_halves_by_program"]) < 0.9
    assert out["programs_on_distinct_sms"] == 1.0 and out["same_sm_each_launch_for_a_program"] < 0.5


def test_noise_alone_correlates_with_nothing():
    out = skew_summary(*_launches(slow_sm=False, launches=40, programs=64, seed=1))
    assert out["slowest_over_median"]["median"] < 0.005
    assert abs(out["corr_halves_by_sm"]) < 0.4 and abs(out["corr_halves_by_program"]) < 0.4
