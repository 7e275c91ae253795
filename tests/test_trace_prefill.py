"""experiments/trace_prefill.py's summary of a traced call's kernels, on a hand-made timeline."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import trace_prefill  # noqa: E402


def test_kernel_summary_counts_busy_time_span_and_gaps():
    # (name, start_ns, duration_ns): b overlaps a; gaps of 1000 ns before c and 3000 ns before d
    kernels = [("a", 0, 2000), ("b", 1000, 3000), ("c", 5000, 1000), ("a", 9000, 500)]
    got = trace_prefill.kernel_summary(kernels)
    assert got["kernels"] == 4
    assert got["busy_ms"] == pytest.approx(6500 / 1e6)
    assert got["span_ms"] == pytest.approx(9500 / 1e6)
    assert got["idle_in_span_ms"] == pytest.approx(4000 / 1e6)
    assert [(g["us"], g["after"], g["before"]) for g in got["largest_gaps"]] == [(3.0, "c", "a"), (1.0, "b", "c")]
    assert got["heaviest"][0] == {"name": "b", "count": 1, "ms": pytest.approx(3000 / 1e6)}
    assert got["heaviest"][1] == {"name": "a", "count": 2, "ms": pytest.approx(2500 / 1e6)}
    assert trace_prefill.kernel_summary([]) == {"error": "no GPU kernels in the trace"}


def test_cli_refuses_fewer_than_one_rep(capsys):
    with pytest.raises(SystemExit):
        trace_prefill.main(["--reps", "0"])
    assert "--reps and --new must be >= 1, got 0 and 256" in capsys.readouterr().err
