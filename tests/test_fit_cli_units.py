"""`python -m scaling fit`: the compute convention of the allocations, the summary,
input checks. References are independent: scipy minimisation along the constraint, numpy."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from scaling import fit_cli
from scaling import scaling_laws as sl

CHINCHILLA_CSV = Path(__file__).parent / "data" / "chinchilla_svg_extracted.csv"
TRUE = {"E": 1.8, "A": 480.0, "B": 2100.0, "alpha": 0.35, "beta": 0.37}
K_SWEEP = 4.0  # C/(ND) of a sweep's small models (accounting.flops_per_token), not 6


def _law_csv(path: Path, k: float) -> Path:
    """Noiseless runs of TRUE on a 6 x 6 grid of N and D, with C = k N D."""
    law = sl.published_fit(TRUE)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["N", "D", "C", "loss"])
        for n in np.logspace(7, 9, 6):
            for d in np.logspace(9, 11, 6):
                w.writerow([repr(float(v)) for v in (n, d, k * n * d, law.predict(n, d))])
    return path


def _argmin_along(c: float, k: float) -> float:
    """N minimising the true law subject to C = k N D, found numerically (not eq. 4)."""
    law = sl.published_fit(TRUE)
    along = lambda u: float(law.predict(math.exp(u), c / (k * math.exp(u))))  # noqa: E731
    res = minimize_scalar(along, bounds=(math.log(1e3), math.log(1e15)), method="bounded", options={"xatol": 1e-10})
    return math.exp(res.x)


def test_allocation_uses_the_runs_own_flops_per_token_per_param(tmp_path: Path) -> None:
    # A sweep counts C with accounting.flops_per_token (C = 3-6 N D for small models); the
    # prediction at a budget C must solve C = k N D in those units, as Approach 2 does. It used
    # 6 N D, so N_opt and D_opt were both (6/4)^0.5 ~ 1.2x too small here.
    out = tmp_path / "fit"
    c = 1e21
    assert fit_cli.main(["--results", str(_law_csv(tmp_path / "runs.csv", K_SWEEP)), "--out", str(out),
                         "--no-plots", "--predict", repr(c)]) == 0
    report = json.loads((out / "fit.json").read_text())
    r3 = report["compute_optimal"][0]["approach3"]
    assert r3["N_opt"] == pytest.approx(_argmin_along(c, K_SWEEP), rel=1e-3)
    assert K_SWEEP * r3["N_opt"] * r3["D_opt"] == pytest.approx(c, rel=1e-9)
    assert report["flops_per_token_per_param"] == pytest.approx(K_SWEEP, rel=1e-12)


def test_chinchilla_csv_keeps_six_nd() -> None:
    # D = C/(6N) in the Chinchilla CSV: k is 6, so its allocations are unchanged.
    runs = sl.load_results(CHINCHILLA_CSV)
    assert runs.flops_per_token_per_param == pytest.approx(6.0, rel=1e-12)


def test_plots_draw_allocations_in_the_runs_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = sl.load_results(_law_csv(tmp_path / "runs.csv", K_SWEEP))
    seen: list[float] = []
    real = sl.compute_optimal

    def spy(fit: sl.ChinchillaFit, c: object, flops_per_token_per_param: float = 6.0) -> object:
        seen.append(flops_per_token_per_param)
        return real(fit, c, flops_per_token_per_param)

    monkeypatch.setattr(sl, "compute_optimal", spy)
    sl.make_plots(tmp_path / "png", runs, sl.published_fit(TRUE), reference=("ref", sl.published_fit(sl.HOFFMANN_2022)))
    assert seen and all(k == pytest.approx(K_SWEEP) for k in seen)


def test_summary_prints_the_kaplan_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The Kaplan power laws were in fit.json only; the printed summary left them out.
    out = tmp_path / "fit"
    assert fit_cli.main(["--results", str(_law_csv(tmp_path / "runs.csv", 6.0)), "--out", str(out), "--no-plots"]) == 0
    text = capsys.readouterr().out
    kaplan = json.loads((out / "fit.json").read_text())["kaplan_frontier"]
    for name in ("N", "D", "C"):
        kf = kaplan[name]
        assert f"L({name}) = {kf['E']:.3f} + ({kf['x_c']:.3g}/{name})^{kf['alpha']:.3f}" in text
    assert "C/(ND)" not in text  # k = 6: no note


def test_bad_values_are_named_by_index() -> None:
    # The message gave min() of the values: "x must be finite and positive; got min=1.0" for a
    # NaN, and a RuntimeWarning ("All-NaN slice") for an all-NaN input.
    y = [3.0, 2.5, 2.2, 2.1, 2.0]
    with pytest.raises(ValueError, match=r"x must be finite and positive; got x\[2\] = nan$"):
        sl.fit_power_law([1, 2, np.nan, 4, 5], y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"x\[0\] = nan, x\[1\] = nan, x\[2\] = nan and 2 more"):
            sl.fit_power_law([np.nan] * 5, y)
    with pytest.raises(ValueError, match=r"D must be finite and positive; got D\[1\] = -1"):
        sl.fit_chinchilla([1e6] * 6, [1e9, -1, 1e9, 1e9, 1e9, 1e9], [3.0] * 6)


def test_csv_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    # A spreadsheet's "CSV UTF-8" starts with a BOM, which became part of the first column's
    # name: "missing column(s) N ...; found ['\ufeffN', ...]".
    plain = _law_csv(tmp_path / "runs.csv", 6.0)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    a, b = sl.load_results(plain), sl.load_results(bom)
    for key in ("n", "d", "c", "loss"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key))


def test_too_few_runs_says_how_many_rows_were_left_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "runs.csv"
    p.write_text("N,C,loss\n1e6,1e15,\n2e6,1e15,3.0\n3e6,1e15,nan\n")
    assert fit_cli.main(["--results", str(p), "--out", str(tmp_path / "o"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "no method could fit 1 usable runs (2 row(s) left out" in err
    # ... and what each method needed.
    assert f"Approach 3: 1 usable runs; the parametric fit needs at least {sl.MIN_POINTS_PARAMETRIC}" in err
    assert "Approach 2 needs at least two IsoFLOP budgets" in err
    for name in ("N", "D", "C"):
        assert f"Kaplan L({name}) (1 runs on its loss frontier): fit_power_law needs at least 4 points, got 1" in err
    assert not (tmp_path / "o").exists()  # no report of nothing


def _frontier_csv(path: Path, n_runs: int) -> Path:
    """Runs of one token count whose loss falls with N as 2.9 + (1e6/N)^0.7: enough for the
    Kaplan law in N (and in C = 6ND), too few for Approach 3 or 2."""
    n = np.logspace(6, 7.5, n_runs)
    path.write_text("N,D,loss\n" + "".join(f"{v!r},1e8,{2.9 + (1e6 / v) ** 0.7!r}\n" for v in map(float, n)))
    return path


@pytest.mark.parametrize("n_runs, drop", [(5, 0), (7, 2)])
def test_too_few_runs_for_approach3_still_fits_the_rest(
    n_runs: int, drop: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Fewer runs than the parametric fit needs (before or after --drop-highest-loss) failed the
    # whole command, though the Kaplan frontier fits need only 4 runs.
    out = tmp_path / "fit"
    argv = ["--results", str(_frontier_csv(tmp_path / "runs.csv", n_runs)), "--out", str(out), "--drop-highest-loss", str(drop)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plots without Approach 3 may not warn either
        assert fit_cli.main(argv) == 0
    report = json.loads((out / "fit.json").read_text())
    assert report["approach3"] == {
        "error": f"5 usable runs; the parametric fit needs at least {sl.MIN_POINTS_PARAMETRIC}",
        "n_points": 5,
        "min_points": sl.MIN_POINTS_PARAMETRIC,
    }
    assert all("Approach 3 skipped" in row["approach3"]["error"] for row in report["compute_optimal"])
    assert "error" in report["approach2"]
    kn = report["kaplan_frontier"]["N"]
    assert kn["n_points"] == 5 and kn["alpha"] == pytest.approx(0.7, rel=1e-3) and kn["E"] == pytest.approx(2.9, rel=1e-4)
    for name in sl.PLOT_NAMES:
        assert (out / f"{name}.png").is_file(), name
    printed = capsys.readouterr().out
    assert f"Approach 3  skipped: 5 usable runs; the parametric fit needs at least {sl.MIN_POINTS_PARAMETRIC}" in printed
    assert "Kaplan      L(N) = 2.900" in printed
    assert "(no Approach-3 allocation)" not in printed  # no allocation table: neither approach has one
