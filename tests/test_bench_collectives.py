"""experiments/bench_collectives.py on simulated CPU devices: it runs, and its bandwidth column
is the ring formula's (accounting.collective_seconds) solved for W from its own timings."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import bench_collectives as B  # noqa: E402


def test_cpu_run_reports_the_formulas_bandwidth(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert B.main(["--sizes-mib", "2", "--iters", "1", "--json", str(out)]) == 0
    rows = [r.strip("|").split("|") for r in capsys.readouterr().out.splitlines() if r.startswith("| all-")
            or r.startswith("| reduce-")]
    assert [r[0].strip() for r in rows] == ["all-gather", "reduce-scatter", "all-reduce", "all-to-all"]
    n = 8  # tests/conftest.py
    for kind, mib, ms, kernel_ms, w, _ in rows:
        assert kernel_ms.strip() == "-"  # no device kernels in a CPU trace: W comes from the wall time
        nbytes, t = float(mib) * 2**20, float(ms) / 1e3
        factor = 2 if kind.strip() == "all-reduce" else 1
        assert float(w) == pytest.approx(factor * (n - 1) / n * nbytes / t / 1e9, rel=2e-3)
    saved = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in saved] == [r[0].strip() for r in rows]
    assert all(r["bytes"] % (n * n) == 0 and r["kernel_s"] is None for r in saved)


def test_kernel_time_is_the_mean_collective_kernel_of_a_trace(monkeypatch):
    """On a GPU the time comes from the trace's collective kernels: summed over devices and
    calls, divided by their count (a fake summary stands in for the trace)."""
    from scaling import profile_summary as ps

    cats = {c: {"us": 0.0, "count": 0} for c in ps.CATEGORIES}
    cats[ps.COLLECTIVE] = {"us": 2 * 5 * 30.0, "count": 2 * 5}  # 5 calls on 2 devices, 30 us each
    cats[ps.COPY] = {"us": 1e6, "count": 1}  # other kernels do not count
    monkeypatch.setattr(ps, "load_trace", lambda d: ({}, d))
    monkeypatch.setattr(ps, "summarize", lambda trace: {"mode": "device", "categories": cats})
    import jax.numpy as jnp

    assert B.kernel_seconds(lambda x: x + 1, jnp.ones(4), 5, 2) == pytest.approx(30e-6)


@pytest.mark.parametrize("argv", [["--sizes-mib", "0"], ["--kinds", "all-gather,broadcast"], ["--kinds", ","]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2
    if "--kinds" in argv:
        assert "allowed: all-gather, reduce-scatter, all-reduce, all-to-all" in capsys.readouterr().err
