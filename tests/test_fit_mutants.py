"""Gaps found by mutation testing of `scaling_laws` and `fit_cli`: each test compares against an
independent reference (closed forms worked by hand, data from a known law, the Chinchilla CSV)
and fails on a plausible bug that the other tests let through."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from scaling import fit_cli
from scaling import scaling_laws as sl

CHINCHILLA_CSV = Path(__file__).parent / "data" / "chinchilla_svg_extracted.csv"


def test_to_dict_allocation_exponents_by_hand() -> None:
    """N_opt ∝ C^(beta/(alpha+beta)), D_opt ∝ C^(alpha/(alpha+beta)) [H22, eq. (4)]: with
    alpha = 0.3, beta = 0.1 that is a = 0.25, b = 0.75 (swapped exponents would read 0.75)."""
    fit = sl.published_fit({"E": 1.0, "A": 1.0, "B": 1.0, "alpha": 0.3, "beta": 0.1})
    d = fit.to_dict()
    assert d["a_exponent"] == pytest.approx(0.25, abs=1e-12)
    assert d["b_exponent"] == pytest.approx(0.75, abs=1e-12)
    # And the allocation itself: G = (alpha A / (beta B))^(1/(alpha+beta)) = 3^2.5 by hand.
    n_opt, d_opt = sl.compute_optimal(fit, 6e16)  # C/6 = 1e16
    assert n_opt == pytest.approx(3**2.5 * 1e16**0.25, rel=1e-12)
    assert d_opt == pytest.approx(1e16**0.75 / 3**2.5, rel=1e-12)


def test_drop_highest_loss_drops_the_highest() -> None:
    runs = sl.RunTable(
        n=np.array([1.0, 2.0, 3.0, 4.0, 5.0]), d=np.ones(5), c=np.ones(5),
        loss=np.array([3.0, 1.0, 5.0, 2.0, 4.0]), source="hand",
    )
    kept = runs.drop_highest_loss(2)
    np.testing.assert_array_equal(kept.loss, [3.0, 1.0, 2.0])  # 5 and 4 gone, order kept
    np.testing.assert_array_equal(kept.n, [1.0, 2.0, 4.0])
    # On the Chinchilla data, as [B24] do: the five dropped runs are the five highest losses.
    full = sl.load_results(CHINCHILLA_CSV)
    five = full.drop_highest_loss(5)
    assert len(five) == 240
    assert five.loss.max() == pytest.approx(np.sort(full.loss)[-6], rel=0)
    assert five.loss.min() == pytest.approx(full.loss.min(), rel=0)


def test_pareto_frontier_keeps_running_minimum_by_hand() -> None:
    x = np.array([5.0, 1.0, 3.0, 2.0, 4.0, 3.0])
    loss = np.array([3.0, 5.0, 4.0, 6.0, 4.5, 3.5])
    # By x: 1 (5.0) kept, 2 (6.0) no, 3 (3.5 then 4.0): 3.5 kept, 4 (4.5) no, 5 (3.0) kept.
    np.testing.assert_array_equal(sl.pareto_frontier(x, loss), [1, 5, 0])


def test_group_budgets_tolerance_is_in_decades() -> None:
    # 0.015 decades apart (0.035 in natural log): one budget at tol 0.02 decades.
    c = np.array([1e19, 10**19.015, 10**19.04, 1e20])
    labels = sl.group_budgets(c, tol_dex=0.02)
    assert labels[0] == labels[1] and labels[2] != labels[1] and labels[3] != labels[2]
    assert len(set(labels.tolist())) == 3


def test_snap_budgets_tolerance_is_in_decades() -> None:
    c = np.array([10**19.04, 10**18.97, 10**19.06, 10**20.045])
    snapped = sl.snap_budgets(c, [1e19, 1e20], tol_dex=0.05)
    np.testing.assert_allclose(snapped[[0, 1, 3]], [1e19, 1e19, 1e20], rtol=1e-12)
    assert np.isnan(snapped[2])


def test_fit_isoflop_exact_parabolas_by_hand() -> None:
    """Losses exactly parabolic in ln N around N*(C) = 0.1 C^0.5: Approach 2 must return
    a = b = 0.5, n_coeff = 0.1, d_coeff = 1/(6 * 0.1), each vertex at N*, loss 3, and each
    budget's C = 6 N D (D given, C not)."""
    n_rows, d_rows, loss_rows, budgets = [], [], [], 10.0 ** np.arange(18, 22)
    for c in budgets:
        n_star = 0.1 * c**0.5
        n = n_star * np.logspace(-0.5, 0.7, 7)  # asymmetric around the vertex
        n_rows.append(n)
        d_rows.append(c / (6 * n))
        loss_rows.append(3.0 + 0.05 * (np.log(n) - math.log(n_star)) ** 2)
    n, d, loss = map(np.concatenate, (n_rows, d_rows, loss_rows))
    iso = sl.fit_isoflop(n, d, loss, budgets=np.repeat(np.arange(4), 7))
    assert [b.flops for b in iso.budgets] == pytest.approx(list(budgets), rel=1e-9)
    for bud, c in zip(iso.budgets, budgets):
        assert bud.valid
        assert bud.n_opt == pytest.approx(0.1 * c**0.5, rel=1e-6)
        assert bud.d_opt == pytest.approx(c / (6 * 0.1 * c**0.5), rel=1e-6)
        assert bud.loss_opt == pytest.approx(3.0, abs=1e-9)
    assert iso.a == pytest.approx(0.5, abs=1e-7) and iso.b == pytest.approx(0.5, abs=1e-7)
    assert iso.n_coeff == pytest.approx(0.1, rel=1e-5)
    assert iso.d_coeff == pytest.approx(1 / 0.6, rel=1e-5)


def test_isoflop_budget_flops_is_geometric_mean() -> None:
    c_used = np.array([10**19.03, 10**18.97, 10**19.05, 10**18.99, 10**19.0])  # one budget, jittered
    n = np.tile(np.logspace(7, 9, 5), 2)
    loss = 3.0 + 0.05 * (np.log(n) - math.log(1e8)) ** 2
    iso = sl.fit_isoflop(n, None, loss, np.r_[c_used, np.full(5, 1e20)], budgets=np.repeat([0.0, 1.0], 5))
    assert iso.budgets[0].flops == pytest.approx(10 ** (np.log10(c_used).mean()), rel=1e-12)
    assert iso.budgets[1].flops == pytest.approx(1e20, rel=1e-12)


def test_huber_objective_by_hand() -> None:
    """Residuals r = log L̂ - log L of 5e-4, -2e-3 and 1e-2 at delta = 1e-3 (in log space):
    0.5 r^2 for the first, delta (|r| - delta/2) for the others, whatever the loss's scale."""
    p = {"E": 1.8, "A": 480.0, "B": 2100.0, "alpha": 0.35, "beta": 0.37}
    law = sl.published_fit(p)
    n, d = np.array([1e8, 1e9, 1e10]), np.array([1e10, 1e11, 1e12])
    r = np.array([5e-4, -2e-3, 1e-2])
    loss = law.predict(n, d) * np.exp(-r)
    assert loss.min() > 2.0  # a delta read in loss units would put 5e-4 in the linear regime
    want = 0.5 * 5e-4**2 + 1e-3 * (2e-3 - 5e-4) + 1e-3 * (1e-2 - 5e-4)
    assert law.objective_at(n, d, loss) == pytest.approx(want, rel=1e-6)


def _write_power_law_csv(path: Path) -> tuple[float, float, float]:
    """Runs whose loss is E + (C_c/C)^alpha exactly in C, with N and D varying along C."""
    e, cc, alpha = 1.7, 3e8, 0.05
    c = np.logspace(17, 21, 12)
    n = np.sqrt(c / 6) * np.linspace(0.5, 2.0, 12)
    d = c / (6 * n)
    loss = e + (cc / c) ** alpha
    path.write_text("N,D,C,loss\n" + "".join(f"{a:.17g},{b:.17g},{k:.17g},{l:.17g}\n" for a, b, k, l in zip(n, d, c, loss)))
    return e, cc, alpha


def test_cli_kaplan_frontier_recovers_law_in_c(tmp_path: Path) -> None:
    csv = tmp_path / "runs.csv"
    e, cc, alpha = _write_power_law_csv(csv)
    out = tmp_path / "fit"
    assert fit_cli.main(["--results", str(csv), "--out", str(out), "--no-plots"]) == 0
    kc = json.loads((out / "fit.json").read_text())["kaplan_frontier"]["C"]
    assert "error" not in kc, kc
    assert kc["n_points"] == 12  # loss falls with C: every run is on the frontier
    assert kc["E"] == pytest.approx(e, rel=1e-4)
    assert kc["alpha"] == pytest.approx(alpha, rel=1e-3)


def test_cli_passes_seed_and_ci_level(tmp_path: Path) -> None:
    """--seed and --ci reach the bootstrap: the report's intervals are the library's for that
    seed and level, and the 50% interval is the 25th-75th percentile of the resampled optima."""
    rng = np.random.default_rng(5)
    n = np.repeat(np.logspace(7.5, 10, 4), 4)
    d = np.tile(np.logspace(9, 12, 4), 4)
    law = sl.published_fit({"E": 1.8, "A": 480.0, "B": 2100.0, "alpha": 0.35, "beta": 0.37})
    loss = law.predict(n, d) * np.exp(0.01 * rng.standard_normal(n.size))
    csv = tmp_path / "runs.csv"
    csv.write_text("N,D,loss\n" + "".join(f"{a:.17g},{b:.17g},{l:.17g}\n" for a, b, l in zip(n, d, loss)))
    out = tmp_path / "fit"
    argv = ["--results", str(csv), "--out", str(out), "--no-plots", "--bootstrap", "8", "--seed", "7", "--ci", "0.5"]
    assert fit_cli.main(argv) == 0
    f3 = json.loads((out / "fit.json").read_text())["approach3"]
    assert f3["ci_level"] == 0.5
    ref = sl.fit_chinchilla(n, d, loss, bootstrap=8, seed=7, ci_level=0.5)
    q = np.percentile(ref.bootstrap_samples[:, 3], [25, 75])
    assert f3["ci"]["alpha"] == pytest.approx(list(q), rel=1e-9)
    other = sl.fit_chinchilla(n, d, loss, bootstrap=8, seed=0, ci_level=0.5)
    assert other.ci["alpha"] != pytest.approx(ref.ci["alpha"], rel=1e-6)  # the seed matters here


def test_cli_snaps_to_named_budgets_within_005_decades(tmp_path: Path) -> None:
    """--isoflop-budgets snaps C within 0.05 decades by default (the flag's help): runs that
    miss their budget by +-0.03 decades belong to it, seven per budget."""
    law = sl.published_fit({"E": 1.8, "A": 480.0, "B": 2100.0, "alpha": 0.35, "beta": 0.37})
    rows = []
    for c in (1e18, 1e19, 1e20):
        n_star, _ = sl.compute_optimal(law, c)
        for i, n in enumerate(n_star * np.logspace(-0.6, 0.6, 7)):
            used = c * 10 ** (0.03 if i % 2 else -0.03)
            rows.append((n, used / (6 * n), used, float(law.predict(n, used / (6 * n)))))
    csv = tmp_path / "runs.csv"
    csv.write_text("N,D,C,loss\n" + "".join(",".join(f"{v:.17g}" for v in r) + "\n" for r in rows))
    out = tmp_path / "fit"
    assert fit_cli.main(["--results", str(csv), "--out", str(out), "--no-plots", "--isoflop-budgets", "1e18,1e19,1e20"]) == 0
    a2 = json.loads((out / "fit.json").read_text())["approach2"]
    assert "error" not in a2, a2.get("error")
    assert [b["n_points"] for b in a2["budgets"]] == [7, 7, 7]
