"""experiments/bench_collectives.py on simulated CPU devices: it runs, and its bandwidth column
is the ring formula's (accounting.collective_seconds) solved for W from its own timings."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import bench_collectives as B  # noqa: E402


def test_cpu_run_reports_the_formulas_bandwidth(capsys):
    assert B.main(["--sizes-mib", "2", "--iters", "1"]) == 0
    rows = [r.strip("|").split("|") for r in capsys.readouterr().out.splitlines() if r.startswith("| all-")
            or r.startswith("| reduce-")]
    assert [r[0].strip() for r in rows] == ["all-gather", "reduce-scatter", "all-reduce"]
    n = 8  # tests/conftest.py
    for kind, mib, ms, w, _ in rows:
        nbytes, t = float(mib) * 2**20, float(ms) / 1e3
        factor = 2 if kind.strip() == "all-reduce" else 1
        assert float(w) == pytest.approx(factor * (n - 1) / n * nbytes / t / 1e9, rel=2e-3)


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        B.main(["--sizes-mib", "0"])
    assert e.value.code == 2
