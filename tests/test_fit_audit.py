"""Audit of the scaling-law fitter on odd input: sweep stores read while written or under odd
paths, data that do not determine the law, mixed units, one-budget plots, bad arguments.
Each test failed before its fix; references are independent (the laws that generated the data,
SQLite itself, numbers worked by hand)."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import warnings
from pathlib import Path

import numpy as np
import pytest

from scaling import fit_cli
from scaling import scaling_laws as sl
from test_scaling_laws import V2_D, V2_EVAL_LOSS, V2_N  # the 15-run GPU sweep

LAW = {"E": 1.8, "A": 480.0, "B": 2100.0, "alpha": 0.35, "beta": 0.37}


def _create_store(path: Path, *, wal: bool = True) -> sqlite3.Connection:
    """An empty `points` table with the columns the sweep runner writes (scaling.sweep.COLUMNS)."""
    con = sqlite3.connect(path, isolation_level=None)
    if wal:
        con.execute("PRAGMA journal_mode=WAL")
    con.execute(
        "CREATE TABLE points (id TEXT PRIMARY KEY, n_params INTEGER, tokens INTEGER, flops REAL, target REAL,"
        " final_loss REAL, eval_loss REAL, status TEXT)"
    )
    return con


def _insert(con: sqlite3.Connection, rows: list[tuple]) -> None:
    con.executemany("INSERT INTO points VALUES (?,?,?,?,?,?,?,?)", rows)


def _grid_rows(count: int) -> list[tuple]:
    """`count` finished points of a grid sweep (ids D...), losses from LAW."""
    law = sl.published_fit(LAW)
    out = []
    for i in range(count):
        n, d = 1e6 * 2**i, 2e7 * 1.5**i
        loss = float(law.predict(n, d))
        out.append((f"D{d:.3g}-L{i}-s0", n, d, 6 * n * d, d, loss + 0.05, loss, "done"))
    return out


# --- Sweep stores -------------------------------------------------------------------------------


def test_sweep_store_under_a_path_with_uri_characters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store was opened as the URI f"file:{path}?mode=ro": in a directory named "sweep#2"
    SQLite read '#2...' as a fragment, opened (and created) a database "sweep" in the working
    directory, and the fitter said "no table 'points'"."""
    store = tmp_path / "sweep#2 ?a%41"
    store.mkdir()
    con = _create_store(store / "results.sqlite")
    _insert(con, _grid_rows(4))
    con.close()
    monkeypatch.chdir(tmp_path)
    runs = sl.load_results(store.name)
    assert len(runs) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.name]  # no stray database file


def test_finished_wal_store_is_read_without_writing_beside_it(tmp_path: Path) -> None:
    """A finished sweep's store (WAL mode, runner closed: no -wal file) was opened read-only
    through the WAL, which creates -wal and -shm files beside it: in a directory the reader may
    not write (a shared or read-only results folder) that failed, "attempt to write a readonly
    database". Such a store holds everything in the main file and is read as immutable."""
    con = _create_store(tmp_path / "results.sqlite")
    _insert(con, _grid_rows(5))
    con.close()  # the last connection checkpoints and removes the -wal and -shm files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.sqlite"]
    assert len(sl.load_results(tmp_path)) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.sqlite"]


def test_store_being_written_shows_committed_rows_only(tmp_path: Path) -> None:
    """While a runner writes (WAL, nothing checkpointed into the main file yet), the fitter
    reads through the WAL: it sees every committed point and no uncommitted one. (Reading such
    a store as immutable would see no table at all: the main file is still empty.)"""
    writer = _create_store(tmp_path / "results.sqlite")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    rows = _grid_rows(7)
    _insert(writer, rows[:6])
    writer.execute("BEGIN IMMEDIATE")
    _insert(writer, rows[6:])  # in flight
    try:
        runs = sl.load_results(tmp_path)
        assert len(runs) == 6
        np.testing.assert_allclose(runs.loss, [r[6] for r in rows[:6]], rtol=1e-12)
        writer.execute("COMMIT")
        assert len(sl.load_results(tmp_path)) == 7
    finally:
        writer.close()


def test_sweep_store_without_eval_losses_uses_the_train_loss_for_every_run(tmp_path: Path) -> None:
    """One kind of loss per fit: the eval loss where the store has any (a run without one is a
    missing value, tests/test_scaling_laws.py::test_load_results_sweep_store), else the train
    loss of every run. Mixing them put train losses 0.01-0.4 above the eval losses
    (docs/results/sweep_isoflop_gpu_v2) among eval losses."""
    con = _create_store(tmp_path / "results.sqlite")
    rows = [(*r[:6], None, r[7]) for r in _grid_rows(4)]  # eval_loss NULL everywhere
    _insert(con, rows)
    con.close()
    runs = sl.load_results(tmp_path)
    np.testing.assert_allclose(runs.loss, [r[5] for r in rows], rtol=1e-12)
    assert runs.n_skipped == 0
    # Mixed: the run without an eval loss is left out and counted, never filled with its train loss.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    con = _create_store(mixed / "results.sqlite")
    rows = _grid_rows(4)
    rows[2] = (*rows[2][:6], float("nan"), "done")  # a NaN eval loss is stored as NULL
    _insert(con, rows)
    con.close()
    runs = sl.load_results(mixed)
    assert runs.n_skipped == 1
    np.testing.assert_allclose(runs.loss, [rows[i][6] for i in (0, 1, 3)], rtol=1e-12)


def test_non_number_in_a_sweep_store_names_column_and_point(tmp_path: Path) -> None:
    # Was numpy's "could not convert string to float: 'n/a'", naming neither.
    con = _create_store(tmp_path / "results.sqlite")
    rows = _grid_rows(3)
    rows[1] = (rows[1][0], rows[1][1], "n/a", *rows[1][3:])
    _insert(con, rows)
    con.close()
    with pytest.raises(ValueError, match=re.escape(f"column 'tokens' holds a non-number at point {rows[1][0]}: 'n/a'")):
        sl.load_results(tmp_path)


# --- Data that do not determine the law -----------------------------------------------------------


@pytest.mark.parametrize(
    "n, d, message",
    [
        (np.full(12, 1e8), np.logspace(9, 11, 12), r"at least 3 distinct N values, got 1 \(1e\+08\)"),
        (np.repeat([1e8, 1e9], 6), np.tile(np.logspace(9, 11, 6), 2), r"at least 3 distinct N values, got 2 \(1e\+08, 1e\+09\)"),
        (np.logspace(7, 9, 12), np.full(12, 1e10), r"at least 3 distinct D values, got 1 \(1e\+10\)"),
    ],
)
def test_parametric_fit_needs_three_distinct_n_and_d(n: np.ndarray, d: np.ndarray, message: str) -> None:
    """E + A/N^alpha takes one value per distinct N: through one or two model sizes E, A and
    alpha are not determined. The fit returned an arbitrary point (one size: E = 2.6 and
    alpha = 1.0 for data made with E = 1.8, alpha = 0.35, at objective 0) and `fit` printed
    compute-optimal allocations of 1e11 tokens per parameter from it."""
    loss = sl.published_fit(LAW).predict(n, d)
    with pytest.raises(ValueError, match=message):
        sl.fit_chinchilla(n, d, loss)


def test_cli_on_a_single_model_size_skips_approach3(tmp_path: Path) -> None:
    law = sl.published_fit(LAW)
    d = np.logspace(9, 11, 10)
    csv = tmp_path / "one_size.csv"
    csv.write_text("N,D,loss\n" + "".join(f"1e8,{v!r},{float(law.predict(1e8, v))!r}\n" for v in map(float, d)))
    out = tmp_path / "fit"
    assert fit_cli.main(["--results", str(csv), "--out", str(out), "--no-plots"]) == 0
    report = json.loads((out / "fit.json").read_text())
    assert "at least 3 distinct N values, got 1" in report["approach3"]["error"]
    assert all("error" in row["approach3"] for row in report["compute_optimal"])
    # L(D) on one model size is E + A/N^alpha + B/D^beta with the N term constant: exponent beta.
    assert report["kaplan_frontier"]["D"]["alpha"] == pytest.approx(LAW["beta"], rel=1e-3)


def _runaway_fit_lse(real):
    """_fit_lse whose Approach-3 optimum has a = 800 (A = e^800, past float range), as fits of
    resamples of the 15-run GPU sweep reach (a = 788 ... 15763); other fits unchanged."""

    def fake(logx_mn, logy_n, starts_kp, delta, **kw):
        if starts_kp.shape[1] != 5:
            return real(logx_mn, logy_n, starts_kp, delta, **kw)
        best = np.array([800.0, 7.6, 0.6, 60.0, 0.37])  # [a, b, e, alpha, beta]
        return best, 1e-3, best[None], np.array([1e-3])

    return fake


def test_coefficient_past_float_range_is_a_value_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """math.exp(800) raised OverflowError, which `fit` does not catch: a traceback instead of
    Approach 3 reported as not determined, and no Approach 2 or Kaplan results."""
    monkeypatch.setattr(sl, "_fit_lse", _runaway_fit_lse(sl._fit_lse))
    n = np.repeat(np.logspace(7.5, 9, 3), 3)
    d = np.tile(np.logspace(9, 10.5, 3), 3)
    loss = sl.published_fit(LAW).predict(n, d) * np.exp(0.005 * np.random.default_rng(0).standard_normal(n.size))
    with pytest.raises(ValueError, match=r"A = e\^800 is past float range \(alpha = 60"):
        sl.fit_chinchilla(n, d, loss)
    csv = tmp_path / "runs.csv"
    csv.write_text("N,D,loss\n" + "".join(f"{a!r},{b!r},{c!r}\n" for a, b, c in zip(*(map(float, v) for v in (n, d, loss)))))
    out = tmp_path / "fit"
    assert fit_cli.main(["--results", str(csv), "--out", str(out), "--no-plots"]) == 0
    report = json.loads((out / "fit.json").read_text())
    assert "past float range" in report["approach3"]["error"]
    assert "error" not in report["kaplan_frontier"]["C"]  # the other methods still report


# A bootstrap resample of the 15-run GPU sweep (V2_*; resample 170 of the seed-0 bootstrap in
# test_bootstrap_interval_of_a_runaway_coefficient_is_inf_not_nan): multiplicities. Resample 75
# ([1, 2, 1, 0, 0, 0, 1, 2, 1, 1, 1, 0, 1, 2, 2]) ran off past e^709.78 on the full grid
# (OverflowError), which test_coefficient_past_float_range_is_a_value_error covers deterministically.
RESAMPLE_170 = [0, 2, 2, 1, 1, 0, 3, 2, 1, 1, 0, 0, 2, 0, 0]


def test_fit_that_runs_off_is_quiet() -> None:
    """Fits whose coefficients run off (the law is not identified by these runs): the batched
    L-BFGS printed RuntimeWarnings (overflow in 1/s·y, then invalid values in the two-loop
    recursion), and math.exp overflowed. Where the best end point lands depends on the
    optimiser's path (BLAS rounding), so a fit or the ValueError are both accepted, but nothing
    may warn or raise another error; a fit's E may underflow to 0 and still evaluate."""
    idx = np.repeat(np.arange(15), RESAMPLE_170)
    n, d, loss = (np.asarray(v, dtype=float)[idx] for v in (V2_N, V2_D, V2_EVAL_LOSS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            # (40 starts of the grid, among them rows that run off: a tenth of the full fit's time)
            fit = sl.fit_chinchilla(n, d, loss, starts=sl.paper_grid()[4200:4400:5])
        except ValueError as err:
            assert "past float range" in str(err)
        else:
            assert all(math.isfinite(getattr(fit, name)) for name in sl.PARAM_NAMES)
            assert fit.objective_at(n, d, loss) == pytest.approx(fit.objective, rel=1e-6)


def test_a_fit_with_e_underflowed_to_zero_evaluates() -> None:
    """E = e^e is 0.0 for e < -745 (fits that leave E unidentified get there); params_log then
    raised "math domain error" (math.log(0.0)), and with it objective_at. Independent check:
    the Huber sum written out with L̂ = A/N^alpha + B/D^beta."""
    fit = sl.published_fit({**LAW, "E": 0.0})
    assert fit.params_log[2] == -math.inf
    n, d = np.array([1e8, 1e9, 1e10]), np.array([1e10, 1e9, 1e12])
    loss = np.array([1.5, 0.9, 0.2])
    r = np.log(LAW["A"] / n ** LAW["alpha"] + LAW["B"] / d ** LAW["beta"]) - np.log(loss)
    delta = 1e-3
    want = np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum()
    assert fit.objective_at(n, d, loss) == pytest.approx(want, rel=1e-12)


# --- Units ------------------------------------------------------------------------------------


def _csv(path: Path, rows: list[tuple]) -> Path:
    path.write_text("N,D,C,loss\n" + "".join(",".join("" if v is None else repr(float(v)) for v in r) + "\n" for r in rows))
    return path


def test_rows_in_different_units_are_an_error(tmp_path: Path) -> None:
    """C in PF-days (8.64e19 FLOPs) on some rows and FLOPs on others, or D filled as C/(6N)
    from a PF-day C: C/(N D) differs by 8.64e19 between rows. It was used as read: Approach 2
    grouped and Kaplan's L(C) fitted C values in two units."""
    law = sl.published_fit(LAW)
    grid = [(n, d) for n in (1e8, 3e8, 1e9) for d in (1e9, 1e10, 1e11)]
    flops = [(n, d, 6 * n * d, float(law.predict(n, d))) for n, d in grid]
    mixed = [(n, d, c / 8.64e19 if i % 2 else c, l) for i, (n, d, c, l) in enumerate(flops)]
    with pytest.raises(ValueError, match=r"columns 'N', 'D' and 'C' disagree about units: C/\(N D\) is 6\.94e-20 at line 3 but 6 at line 2"):
        sl.load_results(_csv(tmp_path / "mixed.csv", mixed))
    filled = [(n, None if i % 2 else d, c / 8.64e19, l) for i, (n, d, c, l) in enumerate(flops)]
    with pytest.raises(ValueError, match="disagree about units"):
        sl.load_results(_csv(tmp_path / "filled.csv", filled))
    # One unit throughout is fine, whatever it is: k = 6 / 8.64e19 on every row.
    runs = sl.load_results(_csv(tmp_path / "pfdays.csv", [(n, d, c / 8.64e19, l) for n, d, c, l in flops]))
    assert runs.flops_per_token_per_param == pytest.approx(6 / 8.64e19, rel=1e-12)


# --- Plots ------------------------------------------------------------------------------------


def test_plots_of_a_single_budget_do_not_warn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of one IsoFLOP budget (C equal up to rounding): autoscaling the log C axis of the
    loss-vs-compute and residual plots warned "Attempting to set identical low and high
    xlims". A law without an allocation (alpha < 0) leaves loss-vs-compute without curves,
    so one call reaches both plots."""
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: None)  # (rendering is not under test)
    n = np.logspace(8, 9.5, 8)
    d = 1e20 / (6 * n)
    law = sl.published_fit({**LAW, "alpha": -0.1})
    runs = sl.RunTable(n, d, 6 * n * d, law.predict(n, d), "one budget")
    assert len(np.unique(runs.c)) > 1  # equal up to rounding, not exactly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = sl.make_plots(tmp_path, runs, law)
    assert [p.stem for p in written] == list(sl.PLOT_NAMES)
    # Plots asked for without a place to put them: pathlib's TypeError, naming no argument.
    for out_dir in (None, ""):
        with pytest.raises(ValueError, match="out_dir must be the directory for the PNGs"):
            sl.make_plots(out_dir, runs, law)


# --- Arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0.0, -6.0, float("nan"), float("inf")])
def test_compute_optimal_rejects_bad_flops_per_token_per_param(k: float) -> None:
    # k = 0 returned (inf, inf) with a RuntimeWarning; NaN or k < 0 returned (nan, nan).
    with pytest.raises(ValueError, match=r"flops_per_token_per_param .* must be a finite number > 0"):
        sl.compute_optimal(sl.published_fit(LAW), 1e21, k)


def test_budget_helpers_reject_bad_input() -> None:
    # A negative or NaN C joined the first budget (log10 gave NaN, with a RuntimeWarning).
    with pytest.raises(ValueError, match=r"C must be finite and positive; got C\[1\] = -1"):
        sl.group_budgets([1e19, -1.0, 1e20])
    with pytest.raises(ValueError, match=r"C\[0\] = nan"):
        sl.group_budgets([np.nan, 1e19])
    # No nominal budget: numpy's "attempt to get argmin of an empty sequence".
    with pytest.raises(ValueError, match="nominal budgets: expected at least one budget"):
        sl.snap_budgets([1e19], [])


def test_fit_chinchilla_checks_starts_shape() -> None:
    # Four columns: "operands could not be broadcast together with shapes (3,0) (16,)".
    n = np.repeat(np.logspace(7.5, 9, 3), 3)
    d = np.tile(np.logspace(9, 10.5, 3), 3)
    loss = sl.published_fit(LAW).predict(n, d)
    with pytest.raises(ValueError, match=r"starts must have shape \[K, 5\] .* got shape \(3, 4\)"):
        sl.fit_chinchilla(n, d, loss, starts=np.zeros((3, 4)))
    with pytest.raises(ValueError, match="starts must be finite; row 1 is not"):
        sl.fit_chinchilla(n, d, loss, starts=[[1, 1, 0, 0.3, 0.3], [1, 1, np.nan, 0.3, 0.3]])


def test_plot_prefix_with_a_separator_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--plot-prefix sub/` made the PNG paths OUT/sub/*.png, a missing folder: the command
    failed after writing fit.json, with "[Errno 2] No such file or directory" naming no flag."""
    csv = tmp_path / "runs.csv"
    csv.write_text("N,D,loss\n1e8,1e9,3.0\n")
    with pytest.raises(SystemExit) as exc:
        fit_cli.main(["--results", str(csv), "--out", str(tmp_path / "o"), "--plot-prefix", "sub/"])
    assert exc.value.code == 2
    assert "error: --plot-prefix must be a file-name prefix without a path separator" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
