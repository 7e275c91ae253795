"""`python -m scaling fit`: refit scaling laws to finished runs and replot, without training.

    python -m scaling fit --results DIR_or_CSV [--out DIR] [--huber-delta 1e-3]
                          [--bootstrap 100] [--drop-highest-loss K]

Writes DIR/fit.json (Approach 3 with optional bootstrap intervals, Approach 2, Kaplan-style
power laws on the loss frontiers, compute-optimal N, D and tokens per parameter for a few
budgets) and the PNGs of `scaling_laws.make_plots`, and prints a summary table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaling import strict_json

if TYPE_CHECKING:  # (imported where used: scipy's optimize alone took 0.5 s of every `fit --help`)
    import numpy as np

    from scaling import scaling_laws as sl

# Chinchilla's nine IsoFLOP budgets [Hoffmann et al. 2022, Fig. 3], for --isoflop-budgets chinchilla.
CHINCHILLA_BUDGETS = (6e18, 1e19, 3e19, 6e19, 1e20, 3e20, 6e20, 1e21, 3e21)
REFERENCES = {
    "none": None,
    # (the parameters by their name in scaling_laws, which is imported after the arguments)
    "hoffmann2022": ("Hoffmann et al. 2022 (published)", "HOFFMANN_2022"),
    "besiroglu2024": ("Besiroglu et al. 2024 (published)", "BESIROGLU_2024"),
}
GROUP_TOL_DEX = 0.02  # chaining tolerance when budgets are inferred from C
SNAP_TOL_DEX = 0.05  # distance to a named budget when budgets are given


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scaling fit",
        description="Fit scaling laws (Chinchilla Approaches 2 and 3, Kaplan power laws) to finished runs.",
    )
    p.add_argument("--results", required=True, help="sweep directory holding results.sqlite, or a CSV of runs")
    p.add_argument("--out", help="output directory (default: RESULTS/fit for a sweep, ./fit_<name> for a CSV)")
    p.add_argument("--huber-delta", type=float, default=1e-3, help="Huber delta on log loss (default 1e-3)")
    p.add_argument("--bootstrap", type=int, default=0, help="bootstrap resamples for confidence intervals (default 0)")
    p.add_argument("--ci", type=float, default=0.95, help="confidence level of the bootstrap intervals")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--drop-highest-loss", type=int, default=0, metavar="K",
                   help="drop the K highest-loss runs before fitting (Besiroglu et al. 2024 drop 5)")
    p.add_argument("--isoflop-tol", type=float, default=None,
                   help=f"IsoFLOP grouping tolerance in decades of C (default {GROUP_TOL_DEX} when inferring "
                        f"budgets, {SNAP_TOL_DEX} when snapping to --isoflop-budgets)")
    p.add_argument("--isoflop-budgets", default=None,
                   help="comma-separated nominal budgets to snap runs to (e.g. 1e19,1e20), or 'chinchilla'")
    p.add_argument("--predict", default=None,
                   help="comma-separated budgets C for compute-optimal predictions (default: every decade "
                        "from the data's range to 1000x its largest budget)")
    p.add_argument("--reference", choices=sorted(REFERENCES), default="none",
                   help="published law to draw on the allocation plot")
    p.add_argument("--plot-prefix", default="", help="prefix for the PNG file names")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    return p


class UsageError(ValueError):
    """A flag's value is outside what it allows; the message names the flag."""


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(tok) for tok in text.split(",") if tok.strip()]
    except ValueError:
        raise UsageError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not vals or not all(math.isfinite(v) and v > 0 for v in vals):
        raise UsageError(f"{what}: expected finite positive numbers, got {text!r}")
    return vals


def check_args(args: argparse.Namespace) -> None:
    """Every flag's value, before any data is read; raises UsageError naming the flag."""

    def require(ok: bool, flag: str, allowed: str, value: Any) -> None:
        if not ok:
            raise UsageError(f"{flag} must be {allowed}, got {value!r}")

    require(math.isfinite(args.huber_delta) and args.huber_delta > 0, "--huber-delta", "a finite number > 0 (e.g. 1e-3)", args.huber_delta)
    require(args.bootstrap >= 0, "--bootstrap", "a number of resamples >= 0", args.bootstrap)
    require(0 < args.ci < 1, "--ci", "a confidence level strictly between 0 and 1 (e.g. 0.95)", args.ci)
    require(args.seed >= 0, "--seed", "an integer >= 0", args.seed)
    require(args.drop_highest_loss >= 0, "--drop-highest-loss", "an integer >= 0", args.drop_highest_loss)
    if args.isoflop_tol is not None:
        require(math.isfinite(args.isoflop_tol) and args.isoflop_tol >= 0, "--isoflop-tol", "a number of decades >= 0", args.isoflop_tol)
    if args.isoflop_budgets and args.isoflop_budgets != "chinchilla":
        _floats(args.isoflop_budgets, "--isoflop-budgets ('chinchilla' or comma-separated budgets)")
    if args.predict:
        _floats(args.predict, "--predict")
    if args.out:
        require(not Path(args.out).exists() or Path(args.out).is_dir(), "--out", "a directory (it is an existing file)", args.out)
    # A separator made the PNGs' folder a missing subfolder of --out: the command failed after
    # writing fit.json, with an error naming no flag.
    seps = {"/", os.sep, os.altsep} - {None}
    require(not any(ch in args.plot_prefix for ch in seps), "--plot-prefix",
            "a file-name prefix without a path separator (the PNGs go in --out)", args.plot_prefix)


def _default_out(results: Path) -> Path:
    return results / "fit" if results.is_dir() else Path.cwd() / f"fit_{results.stem}"


def _prediction_budgets(c: np.ndarray) -> list[float]:
    lo = math.ceil(math.log10(c.min()))
    hi = math.floor(math.log10(c.max())) + 3
    return [10.0**k for k in range(lo, hi + 1)]


def _kaplan_fits(runs: sl.RunTable, delta: float) -> tuple[dict[str, Any], dict[str, sl.PowerLawFit]]:
    """L(X) = E + (X_c/X)^alpha on the loss frontier in X (lowest loss at <= X), X in N, D, C."""
    from scaling import scaling_laws as sl

    out: dict[str, Any] = {}
    fits: dict[str, sl.PowerLawFit] = {}
    for name, x in (("N", runs.n), ("D", runs.d), ("C", runs.c)):
        front = sl.pareto_frontier(x, runs.loss)
        try:
            fit = sl.fit_power_law(x[front], runs.loss[front], huber_delta=delta)
        except (ValueError, RuntimeError) as err:
            out[name] = {"error": str(err), "n_frontier_points": int(front.size)}
            continue
        fits[name] = fit
        out[name] = fit.to_dict()
    return out, fits


def _approach3(runs: sl.RunTable, args: argparse.Namespace) -> tuple[sl.ChinchillaFit | None, dict[str, Any]]:
    """The parametric fit and its report; with too few runs it is skipped (the other methods
    may still fit), the report's `error` naming the count and the minimum."""
    from scaling import scaling_laws as sl

    if len(runs) < sl.MIN_POINTS_PARAMETRIC:
        return None, {
            "error": f"{len(runs)} usable runs; the parametric fit needs at least {sl.MIN_POINTS_PARAMETRIC}",
            "n_points": len(runs),
            "min_points": sl.MIN_POINTS_PARAMETRIC,
        }
    try:
        fit3 = sl.fit_chinchilla(runs.n, runs.d, runs.loss, huber_delta=args.huber_delta,
                                 bootstrap=args.bootstrap, seed=args.seed, ci_level=args.ci)
    except (ValueError, RuntimeError) as err:
        return None, {"error": str(err), "n_points": len(runs)}
    return fit3, fit3.to_dict()


def _nothing_fitted(approach3: dict[str, Any], approach2: dict[str, Any], kaplan: dict[str, Any]) -> str | None:
    """What each method needed, when none of them produced a fit; None when one did."""
    if "error" not in approach3 or "error" not in approach2 or any("error" not in kf for kf in kaplan.values()):
        return None
    a2 = approach2["error"]
    parts = [f"Approach 3: {approach3['error']}", a2 if a2.startswith("Approach 2") else f"Approach 2: {a2}"]
    parts += [f"Kaplan L({name}) ({kf['n_frontier_points']} runs on its loss frontier): {kf['error']}"
              for name, kf in kaplan.items()]
    return "; ".join(parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    from scaling import scaling_laws as sl  # (after the flags: a usage error needs no scipy)

    results = Path(args.results)
    runs_all = sl.load_results(results)
    left_out = f" ({runs_all.n_skipped} row(s) left out for a missing N, loss, or D and C)" if runs_all.n_skipped else ""
    if len(runs_all) == 0:
        raise ValueError(f"{results}: no usable runs (need N, loss and D or C in each run){left_out}")
    if args.drop_highest_loss >= len(runs_all):
        raise ValueError(f"{results}: {len(runs_all)} usable runs; cannot drop the {args.drop_highest_loss} highest-loss ones")
    runs = runs_all.drop_highest_loss(args.drop_highest_loss)
    out_dir = Path(args.out) if args.out else _default_out(results)

    t0 = time.perf_counter()
    fit3, approach3 = _approach3(runs, args)
    t_fit = time.perf_counter() - t0

    iso: sl.IsoFlopFit | None = None
    tol = args.isoflop_tol
    if args.isoflop_budgets:
        nominal = CHINCHILLA_BUDGETS if args.isoflop_budgets == "chinchilla" else _floats(args.isoflop_budgets, "--isoflop-budgets")
        grouping = f"snapped to {len(nominal)} budgets within {SNAP_TOL_DEX if tol is None else tol} decades"
    elif tol is None and runs.budget is not None:
        grouping = "the sweep's IsoFLOP targets"
    else:
        grouping = f"C chained within {GROUP_TOL_DEX if tol is None else tol} decades"
    try:
        if args.isoflop_budgets:
            labels = sl.snap_budgets(runs.c, nominal, tol_dex=SNAP_TOL_DEX if tol is None else tol)
            iso = sl.fit_isoflop(runs.n, runs.d, runs.loss, runs.c, budgets=labels)
        elif tol is None and runs.budget is not None:
            iso = sl.fit_isoflop(runs.n, runs.d, runs.loss, runs.c, budgets=runs.budget)
        else:
            iso = sl.fit_isoflop(runs.n, runs.d, runs.loss, runs.c, tol_dex=GROUP_TOL_DEX if tol is None else tol)
        approach2: dict[str, Any] = iso.to_dict()
    except ValueError as err:
        approach2 = {"error": str(err)}
    approach2["grouping"] = grouping

    kaplan, kaplan_fits = _kaplan_fits(runs, args.huber_delta)
    needed = _nothing_fitted(approach3, approach2, kaplan)
    if needed:  # (before anything is written: the out dir holds no report of nothing)
        dropped = f", {args.drop_highest_loss} highest-loss dropped" if args.drop_highest_loss else ""
        raise ValueError(f"{results}: no method could fit {len(runs)} usable runs{dropped}{left_out}: {needed}")
    out_dir.mkdir(parents=True, exist_ok=True)

    budgets = _floats(args.predict, "--predict") if args.predict else _prediction_budgets(runs.c)
    # C in the runs' own units: C = k N D, as Approach 2's D* = C/(kN) (a sweep's k is not 6).
    k = runs.flops_per_token_per_param
    predictions = []
    for c in budgets:
        row: dict[str, Any] = {"C": c}
        try:
            if fit3 is None:
                raise ValueError(f"Approach 3 skipped: {approach3['error']}")
            n3, d3 = sl.compute_optimal(fit3, c, k)
            row["approach3"] = {"N_opt": n3, "D_opt": d3, "tokens_per_param": d3 / n3, "loss": float(fit3.predict(n3, d3))}
        except ValueError as err:
            row["approach3"] = {"error": str(err)}
        if iso is not None:
            n2, d2 = float(iso.n_opt(c)), float(iso.d_opt(c))
            row["approach2"] = {"N_opt": n2, "D_opt": d2, "tokens_per_param": d2 / n2}
        predictions.append(row)

    report: dict[str, Any] = {
        "source": str(results),
        "n_runs": len(runs_all),
        "n_runs_used": len(runs),
        "n_rows_skipped": runs_all.n_skipped,
        "dropped_highest_loss": args.drop_highest_loss,
        "huber_delta": args.huber_delta,
        "fit_seconds": round(t_fit, 3),
        "flops_per_token_per_param": k,
        "approach3": approach3,
        "approach2": approach2,
        "kaplan_frontier": kaplan,
        "compute_optimal": predictions,
        "reference": {"hoffmann_2022": sl.HOFFMANN_2022, "besiroglu_2024": sl.BESIROGLU_2024},
    }
    (out_dir / "fit.json").write_text(strict_json.dumps(report, indent=2) + "\n")
    plots: list[Path] = []
    if not args.no_plots:
        ref = REFERENCES[args.reference]
        plots = sl.make_plots(
            out_dir, runs, fit3, iso,
            compute_fit=kaplan_fits.get("C"),
            reference=(ref[0], sl.published_fit(getattr(sl, ref[1]))) if ref else None,
            prefix=args.plot_prefix,
        )
    report["_out_dir"] = str(out_dir)
    report["_plots"] = [str(p) for p in plots]
    return report


def _approach3_lines(report: dict[str, Any]) -> list[str]:
    from scaling import scaling_laws as sl

    f3 = report["approach3"]
    if "error" in f3:  # too few runs (or a failed fit): no parameters to show
        return [f"Approach 3  skipped: {f3['error']}"]
    ci = f3.get("ci")
    lines = [
        "Approach 3  L = E + A/N^alpha + B/D^beta" + (f"   [{100 * f3['ci_level']:.0f}% bootstrap CI, n={f3['n_bootstrap']}]" if ci else ""),
        f"  {'param':<6} {'fit':>12} {'Hoffmann22':>11} {'Besiroglu24':>12}" + (f" {'CI':>24}" if ci else ""),
    ]
    for name in sl.PARAM_NAMES:
        row = f"  {name:<6} {f3[name]:>12.4g} {sl.HOFFMANN_2022[name]:>11.4g} {sl.BESIROGLU_2024[name]:>12.4g}"
        if ci:
            lo, hi = ci[name]
            row += f" {f'[{lo:.4g}, {hi:.4g}]':>24}"
        lines.append(row)
    errors3 = [row["approach3"]["error"] for row in report["compute_optimal"] if "error" in row["approach3"]]
    if errors3:
        lines.append(f"  {errors3[0]}")
    else:
        lines.append(f"  N_opt ∝ C^{f3['a_exponent']:.3f}, D_opt ∝ C^{f3['b_exponent']:.3f}")
    return lines


def _summary(report: dict[str, Any]) -> str:
    lines = [
        f"{report['source']}: {report['n_runs_used']} runs used of {report['n_runs']} "
        f"(dropped {report['dropped_highest_loss']} highest-loss), Huber delta {report['huber_delta']:g}, "
        f"fit {report['fit_seconds']:.1f}s"
        + (f"; skipped {report['n_rows_skipped']} row(s) with a missing N, loss, or D and C" if report["n_rows_skipped"] else ""),
        "",
        *_approach3_lines(report),
    ]
    a2 = report["approach2"]
    if "error" in a2:
        lines.append(f"Approach 2  skipped: {a2['error']}")
    else:
        nb = sum(b["valid"] for b in a2["budgets"])
        lines.append(f"Approach 2  N_opt ∝ C^{a2['a']:.3f}, D_opt ∝ C^{a2['b']:.3f}  ({nb} budgets; {a2['grouping']})")
    for name, kf in report["kaplan_frontier"].items():
        if "error" in kf:
            lines.append(f"Kaplan      L({name}) skipped ({kf['n_frontier_points']} runs on the loss frontier in {name}): {kf['error']}")
        else:
            lines.append(f"Kaplan      L({name}) = {kf['E']:.3f} + ({kf['x_c']:.3g}/{name})^{kf['alpha']:.3f}"
                         f"  (loss frontier in {name}, {kf['n_points']} runs)")
    lines += _allocation_lines(report)
    lines += ["", f"wrote {report['_out_dir']}/fit.json" + (f" and {len(report['_plots'])} PNGs" if report["_plots"] else "")]
    return "\n".join(lines)


def _allocation_lines(report: dict[str, Any]) -> list[str]:
    """The compute-optimal table; none when neither Approach 3 nor Approach 2 has one."""
    from scaling import scaling_laws as sl

    a2 = report["approach2"]
    if "error" in report["approach3"] and "error" in a2:
        return []
    k = report["flops_per_token_per_param"]
    lines = ["", f"  {'C':>9} {'N_opt':>10} {'D_opt':>10} {'D/N':>7} {'loss':>7}" + ("   A2: N_opt     D/N" if "error" not in a2 else "")]
    for row in report["compute_optimal"]:
        r3 = row["approach3"]
        if "error" in r3:  # skipped, or alpha or beta <= 0: no trade-off between N and D to optimise
            line = f"  {row['C']:>9.2e} {'(no Approach-3 allocation)':>38}"
        else:
            line = f"  {row['C']:>9.2e} {r3['N_opt']:>10.3e} {r3['D_opt']:>10.3e} {r3['tokens_per_param']:>7.1f} {r3['loss']:>7.3f}"
        if "approach2" in row:
            r2 = row["approach2"]
            line += f"   {r2['N_opt']:>9.3e} {r2['tokens_per_param']:>6.1f}"
        lines.append(line)
    if abs(k / sl.FLOPS_PER_TOKEN_PER_PARAM - 1) > 1e-3:  # say so when C is not 6ND
        lines.append(f"  (allocations under C = {k:.3g} N D, the runs' median C/(ND))")
    return lines


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        report = run(args)
    except UsageError as err:
        parser.error(str(err))  # usage line + message, exit status 2, as argparse's own errors
    except (OSError, ValueError, RuntimeError) as err:
        # Bad input data (missing path or columns, bad values, too few runs): status 2 like the
        # other commands' input errors; one line, no traceback.
        print(f"fit: error: {err}", file=sys.stderr)
        return 2
    print(_summary(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
