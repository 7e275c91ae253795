"""Scaling-law fits: Kaplan power laws, Chinchilla Approaches 2 and 3, compute-optimal allocation.

Sources:
  [K20] Kaplan et al. 2020, "Scaling Laws for Neural Language Models", arXiv:2001.08361.
  [H22] Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models" (Chinchilla),
        arXiv:2203.15556. Approach 2 (IsoFLOP profiles) is their Section 3.2; Approach 3
        (parametric loss) is Section 3.3 and Appendix D.2; compute-optimal allocation is eq. (4).
  [B24] Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt" (Epoch AI),
        arXiv:2404.10102; repository epoch-research/analyzing-chinchilla.

Every fit is numpy + scipy only. The Approach-3 objective is vectorised over many starting
points at once (`_lbfgs_batched`), so the papers' full grid of 4,500 starts runs in seconds;
the best end point is then polished with scipy's L-BFGS-B.
"""

from __future__ import annotations

import csv
import itertools
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from scipy.optimize import minimize

# Hoffmann et al. 2022, eq. (10): L(N, D) = E + A/N^alpha + B/D^beta.
HOFFMANN_2022 = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
# Besiroglu et al. 2024, Table 1 (their refit on the same 245 runs, five highest losses dropped).
BESIROGLU_2024 = {"E": 1.82, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}

FLOPS_PER_TOKEN_PER_PARAM = 6.0  # C ≈ 6 N D: forward 2ND + backward 4ND [K20, Sec. 2.1].
LOG_FLOAT_MAX = math.log(np.finfo(float).max)  # 709.78: e^a past it is inf.
MAX_K_SPREAD = 100.0  # largest max/min of C/(N D) over the runs read as one set of units.
MIN_POINTS_PARAMETRIC = 6  # more observations than the five parameters of L(N, D).
MIN_DISTINCT_PARAMETRIC = 3  # distinct N (and D): E + A/N^alpha has three parameters.
MIN_POINTS_POWER_LAW = 4  # more observations than the three parameters of E + (X_c/X)^alpha.
MIN_POINTS_PER_BUDGET = 3  # a parabola has three coefficients.


# ---------------------------------------------------------------------------------------------
# The LSE-form objective, vectorised over K parameter vectors.
#
# For M power-law terms with inputs x_m and a constant E the model is
#   log L̂ = LSE(c_1 - alpha_1 log x_1, ..., c_M - alpha_M log x_M, e)        [B24, Sec. 2]
# with coefficient_m = exp(c_m), E = exp(e). Parameter layout: [c_1..c_M, e, alpha_1..alpha_M];
# for Chinchilla (M = 2) that is [a, b, e, alpha, beta], the papers' order.
# The loss is the Huber loss of (log L̂ - log L), summed over points (not averaged: [B24]'s
# `custom_huber_loss` returns np.sum), optionally weighted (bootstrap resamples as counts).
# ---------------------------------------------------------------------------------------------


def _lse_objective(
    x_kp: np.ndarray,
    logx_mn: np.ndarray,
    logy_n: np.ndarray,
    delta: float,
    weights: np.ndarray | None = None,
    *,
    chunk: int = 128,
) -> tuple[np.ndarray, np.ndarray]:
    """Summed Huber loss and its gradient for K parameter vectors at once.

    x_kp: [K, 2M+1]; logx_mn: [M, n]; logy_n: [n]; weights: None, [n] or [K, n].
    Returns f: [K], g: [K, 2M+1]. Rows are processed in chunks so the [chunk, n] temporaries
    stay in cache (about 3x faster than one pass over all 4,500 starts).
    """
    k, m = x_kp.shape[0], logx_mn.shape[0]
    f = np.empty(k)
    g = np.empty_like(x_kp, dtype=float)
    for lo in range(0, k, chunk):
        xb = x_kp[lo : lo + chunk]
        wb = weights if weights is None or weights.ndim == 1 else weights[lo : lo + chunk]
        e_b1 = xb[:, m : m + 1]
        terms = [xb[:, j : j + 1] - xb[:, m + 1 + j : m + 2 + j] * logx_mn[j] for j in range(m)]  # [B, n] each
        top = np.maximum(terms[0], e_b1)  # subtracted so exp never overflows
        for t in terms[1:]:
            np.maximum(top, t, out=top)
        for t in terms:
            t -= top
            np.exp(t, out=t)
        w_e = np.exp(e_b1 - top)
        s = w_e.copy()
        for t in terms:
            s += t
        r = np.log(s)
        r += top
        r -= logy_n  # residual log L̂ - log L, [B, n]
        psi = np.clip(r, -delta, delta)  # Huber'(r)
        h = r - 0.5 * psi  # Huber(r) = psi * (r - psi/2) in both regimes
        if wb is not None:
            psi *= wb
        h *= psi
        f[lo : lo + chunk] = h.sum(axis=1)
        psi /= s  # d log L̂ / d term_j = exp(term_j) / s
        for j, t in enumerate(terms):
            t *= psi
            g[lo : lo + chunk, j] = t.sum(axis=1)
            g[lo : lo + chunk, m + 1 + j] = -(t @ logx_mn[j])
        w_e *= psi
        g[lo : lo + chunk, m] = w_e.sum(axis=1)
    return f, g


def _lbfgs_batched(
    fg: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    x0: np.ndarray,
    *,
    memory: int = 10,
    max_iter: int = 500,
    rtol: float = 1e-6,
) -> tuple[np.ndarray, np.ndarray]:
    """Independent L-BFGS runs from each row of x0, advanced together in numpy.

    fg(x_kp, rows) returns (f[K'], g[K', P]) for the rows `rows` of the batch (so per-row data,
    e.g. bootstrap weights, can be selected). Each row keeps its own history, step and
    stopping state; the line search is a per-row backtracking Armijo search. A row stops when
    its objective decreases by less than rtol (relative) in an iteration, or the search fails.
    Returns (x_kp, f_k) at the end points.
    """
    x = np.array(x0, dtype=float)
    k, p = x.shape
    f, g = fg(x, np.arange(k))
    s_hist = np.zeros((k, memory, p))  # newest pair first
    y_hist = np.zeros((k, memory, p))
    rho = np.zeros((k, memory))  # 1 / s·y; 0 marks an empty slot
    active = np.ones(k, dtype=bool)
    for _ in range(max_iter):
        rows = np.flatnonzero(active)
        if rows.size == 0:
            break
        gr, sh, yh, rh = g[rows], s_hist[rows], y_hist[rows], rho[rows]  # gather once
        have = rh[:, 0] > 0
        gnorm = np.linalg.norm(gr, axis=1)
        yy = np.einsum("kp,kp->k", yh[:, 0], yh[:, 0])
        # Two-loop recursion (Nocedal & Wright 2006, Alg. 7.4), one row per start.
        # Initial Hessian scale s·y / y·y, or a unit-length first step along -g.
        # (rho y.y underflows to 0 when a row has all but converged: gamma is then inf, the
        # direction non-finite, and the descent check below restarts that row along -g. A row
        # running off to a huge coefficient overflows the same way, in the first loop too.)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            q = gr.copy()
            alphas = np.zeros((rows.size, memory))
            for j in range(memory):
                a_j = rh[:, j] * np.einsum("kp,kp->k", sh[:, j], q)
                q -= a_j[:, None] * yh[:, j]
                alphas[:, j] = a_j
            gamma = np.where(have, 1.0 / np.where(have, rh[:, 0] * yy, 1.0), 1.0 / np.maximum(gnorm, 1e-300))  # [K']
            d = gamma[:, None] * q
            for j in reversed(range(memory)):
                b_j = rh[:, j] * np.einsum("kp,kp->k", yh[:, j], d)
                d += (alphas[:, j] - b_j)[:, None] * sh[:, j]
            d = -d
            slope = np.einsum("kp,kp->k", gr, d)
        bad = ~(slope < 0)  # not a descent direction: restart from steepest descent
        if bad.any():
            d[bad] = -gr[bad] / np.maximum(gnorm[bad, None], 1e-300)
            slope[bad] = -gnorm[bad]
            rho[rows[bad]] = 0.0
        # Backtracking Armijo line search, per row.
        step = np.ones(rows.size)
        f_new = np.full(rows.size, np.inf)
        g_new = np.zeros_like(gr)
        todo = np.arange(rows.size)
        f_old = f[rows]
        for _ in range(60):
            ft, gt = fg(x[rows[todo]] + step[todo, None] * d[todo], rows[todo])
            ok = np.isfinite(ft) & (ft <= f_old[todo] + 1e-4 * step[todo] * slope[todo])
            f_new[todo[ok]] = ft[ok]
            g_new[todo[ok]] = gt[ok]
            todo = todo[~ok]
            if todo.size == 0:
                break
            step[todo] *= 0.5
        moved = np.isfinite(f_new)
        active[rows[~moved]] = False  # line search failed: as good as it gets from here
        mr = rows[moved]
        s_new = step[moved, None] * d[moved]
        y_new = g_new[moved] - gr[moved]
        sy = np.einsum("kp,kp->k", s_new, y_new)
        x[mr] += s_new
        f[mr] = f_new[moved]
        g[mr] = g_new[moved]
        # (s·y below 1/float max, as a row runs off to a huge coefficient, made rho = inf.)
        curv = (sy > 1e-12 * np.linalg.norm(s_new, axis=1) * np.linalg.norm(y_new, axis=1)) & (sy > 1.0 / np.finfo(float).max)
        cr = mr[curv]
        s_hist[cr, 1:] = s_hist[cr, :-1]
        s_hist[cr, 0] = s_new[curv]
        y_hist[cr, 1:] = y_hist[cr, :-1]
        y_hist[cr, 0] = y_new[curv]
        rho[cr, 1:] = rho[cr, :-1]
        rho[cr, 0] = 1.0 / sy[curv]
        done = f_old[moved] - f_new[moved] <= rtol * np.abs(f_new[moved])
        active[mr[done]] = False
    return x, f


def _polish(
    fg1: Callable[[np.ndarray], tuple[float, np.ndarray]], x0: np.ndarray
) -> tuple[np.ndarray, float]:
    """scipy L-BFGS-B from x0 with tight tolerances; keeps x0 if scipy ends worse.

    Called once per fit, from an already converged point: scipy's L-BFGS-B calls BLAS on
    5 x 5 matrices, and multithreaded OpenBLAS on a busy machine makes each iteration cost
    milliseconds, so the many-start work stays in `_lbfgs_batched`.
    """
    f0 = fg1(x0)[0]
    res = minimize(fg1, x0, jac=True, method="L-BFGS-B", options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-14})
    if np.isfinite(res.fun) and res.fun <= f0:
        return np.asarray(res.x), float(res.fun)
    return np.asarray(x0, dtype=float), float(f0)


def _distinct_best(x_kp: np.ndarray, f_k: np.ndarray, count: int) -> np.ndarray:
    """Indices of the `count` lowest-objective rows whose end points differ (rounded)."""
    order = np.argsort(f_k)
    order = order[np.isfinite(f_k[order])]
    chosen: list[int] = []
    seen: set[tuple[float, ...]] = set()
    for i in order:
        key = tuple(np.round(x_kp[i], 3))
        if key in seen:
            continue
        seen.add(key)
        chosen.append(int(i))
        if len(chosen) == count:
            break
    return np.array(chosen, dtype=int)


def _fit_lse(
    logx_mn: np.ndarray,
    logy_n: np.ndarray,
    starts_kp: np.ndarray,
    delta: float,
    *,
    refine: int = 8,
) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """Minimises the LSE-form Huber objective from every start; keeps the lowest objective.

    Three stages: batched L-BFGS from all starts to a loose tolerance (rtol 1e-6: enough to
    rank the basins, whose objectives differ by factors, not parts per million); the best
    `refine` distinct end points continued to rtol 1e-13; scipy L-BFGS-B from the best of
    those. Returns (best_x, best_f, coarse_end_x, coarse_end_f).
    """

    def fg(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _lse_objective(x, logx_mn, logy_n, delta)

    def fg1(x: np.ndarray) -> tuple[float, np.ndarray]:
        f, g = _lse_objective(x[None], logx_mn, logy_n, delta)
        return float(f[0]), g[0]

    ends, fends = _lbfgs_batched(fg, starts_kp, rtol=1e-6)
    top = _distinct_best(ends, fends, refine)
    if top.size == 0:
        raise RuntimeError("every start of the fit diverged (non-finite objective)")
    fine, ffine = _lbfgs_batched(fg, ends[top], rtol=1e-13, max_iter=2000)
    best_x, best_f = _polish(fg1, fine[np.argmin(ffine)])
    return best_x, best_f, ends, fends


# ---------------------------------------------------------------------------------------------
# Kaplan-style single-variable power laws [K20, eqs. (1.1)-(1.3)], with an irreducible term
# as in Henighan et al. 2020 / [H22]: L(X) = E + (X_c / X)^alpha.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PowerLawFit:
    """L(X) = E + (x_c / X)^alpha, fitted by Huber loss in log space."""

    E: float
    x_c: float
    alpha: float
    objective: float
    n_points: int
    huber_delta: float

    def predict(self, x: Any) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        return self.E + (self.x_c / x) ** self.alpha

    def to_dict(self) -> dict[str, float | int]:
        return {
            "E": self.E,
            "x_c": self.x_c,
            "alpha": self.alpha,
            "objective": self.objective,
            "n_points": self.n_points,
            "huber_delta": self.huber_delta,
        }


def _as_positive(name: str, values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype=float).ravel()
    bad = np.flatnonzero(~(np.isfinite(arr) & (arr > 0)))
    if bad.size:  # name the entries: a min() hid NaNs (and warned on an all-NaN input)
        shown = ", ".join(f"{name}[{i}] = {arr[i]:g}" for i in bad[:3])
        more = f" and {bad.size - 3} more" if bad.size > 3 else ""
        raise ValueError(f"{name} must be finite and positive; got {shown}{more}")
    return arr


def _check_huber_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float, np.floating)) and delta > 0):  # (NaN fails too)
        raise ValueError(f"huber_delta must be a positive number, got {delta!r}")


def fit_power_law(x: Any, loss: Any, *, huber_delta: float = 1e-3) -> PowerLawFit:
    """Fits L = E + (x_c/x)^alpha as log L̂ = LSE(c - alpha log x, e), c = alpha log x_c.

    Starting grid: alpha over typical LM exponents, E over fractions of the lowest loss, and
    c chosen so that each start passes through the data's geometric-mean point.
    """
    x = _as_positive("x", x)
    loss = _as_positive("loss", loss)
    if x.shape != loss.shape:
        raise ValueError(f"x and loss differ in length: {x.size=} {loss.size=}")
    if x.size < MIN_POINTS_POWER_LAW:
        raise ValueError(f"fit_power_law needs at least {MIN_POINTS_POWER_LAW} points, got {x.size}")
    _check_huber_delta(huber_delta)
    if np.unique(x).size < 3:  # E, x_c and alpha: a curve through fewer x values is not determined
        raise ValueError(f"fit_power_law needs at least 3 distinct x values, got {np.unique(x).size} ({np.unique(x).tolist()})")
    logx, logy = np.log(x), np.log(loss)
    lx_mid, y_mid = logx.mean(), float(np.exp(logy.mean()))
    starts = []
    for alpha in (0.03, 0.07, 0.15, 0.3, 0.6, 1.0, 2.0):
        for frac in (1e-3, 0.25, 0.5, 0.75, 0.9, 0.97):
            e_val = frac * loss.min()
            c = math.log(max(y_mid - e_val, 1e-6)) + alpha * lx_mid
            starts.append((c, math.log(e_val), alpha))
    best, fbest, _, _ = _fit_lse(logx[None], logy, np.array(starts), huber_delta)
    c, e, alpha = best
    return PowerLawFit(
        E=float(np.exp(e)),
        x_c=float(np.exp(c / alpha)) if alpha != 0 else float("inf"),
        alpha=float(alpha),
        objective=fbest,
        n_points=int(x.size),
        huber_delta=huber_delta,
    )


def pareto_frontier(x: Any, loss: Any) -> np.ndarray:
    """Indices (ascending x) of the points with lower loss than every point of smaller x."""
    x = np.asarray(x, dtype=float)
    loss = np.asarray(loss, dtype=float)
    keep, best = [], np.inf
    for i in np.lexsort((loss, x)):
        if loss[i] < best:
            keep.append(int(i))
            best = loss[i]
    return np.array(keep, dtype=int)


# ---------------------------------------------------------------------------------------------
# Chinchilla Approach 2: IsoFLOP profiles [H22, Sec. 3.2].
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IsoFlopBudget:
    """One IsoFLOP profile: L ≈ p0 + p1 u + p2 u^2 with u = log N."""

    flops: float  # geometric mean of the group's C
    n_points: int
    coeffs: tuple[float, float, float]  # (p0, p1, p2)
    n_opt: float
    d_opt: float
    loss_opt: float
    log_n_range: tuple[float, float]
    valid: bool  # convex, minimum inside the sampled N range
    reason: str = ""
    n: tuple[float, ...] = field(default=(), repr=False)  # the runs of this budget
    loss: tuple[float, ...] = field(default=(), repr=False)

    def predict(self, n: Any) -> np.ndarray:
        u = np.log(np.asarray(n, dtype=float))
        p0, p1, p2 = self.coeffs
        return p0 + p1 * u + p2 * u * u


@dataclass(frozen=True)
class IsoFlopFit:
    """N_opt = n_coeff C^a and D_opt = d_coeff C^b, fitted over the valid budgets."""

    budgets: tuple[IsoFlopBudget, ...]
    a: float
    b: float
    n_coeff: float
    d_coeff: float

    def n_opt(self, c: Any) -> np.ndarray:
        return self.n_coeff * np.asarray(c, dtype=float) ** self.a

    def d_opt(self, c: Any) -> np.ndarray:
        return self.d_coeff * np.asarray(c, dtype=float) ** self.b

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "n_coeff": self.n_coeff,
            "d_coeff": self.d_coeff,
            "budgets": [
                {
                    "flops": bud.flops,
                    "n_points": bud.n_points,
                    "coeffs": list(bud.coeffs),
                    "n_opt": bud.n_opt,
                    "d_opt": bud.d_opt,
                    "loss_opt": bud.loss_opt,
                    "valid": bool(bud.valid),
                    "reason": bud.reason,
                }
                for bud in self.budgets
            ],
        }


def group_budgets(c: Any, *, tol_dex: float = 0.02) -> np.ndarray:
    """Integer budget label per run: runs whose sorted log10 C differ by <= tol_dex chain together.

    Exactly equal budgets (a sweep) group for any tol_dex >= 0; for C read off a figure
    (Chinchilla) a tolerance of a few hundredths of a decade separates the IsoFLOP columns.
    """
    if not tol_dex >= 0:
        raise ValueError(f"tol_dex must be >= 0 decades, got {tol_dex!r}")
    logc = np.log10(_as_positive("C", c))  # (a NaN or negative C had joined the first group)
    order = np.argsort(logc, kind="stable")
    labels = np.empty(logc.size, dtype=int)
    label = 0
    for j, i in enumerate(order):
        if j and logc[i] - logc[order[j - 1]] > tol_dex:
            label += 1
        labels[i] = label
    return labels


def snap_budgets(c: Any, nominal: Sequence[float], *, tol_dex: float = 0.05) -> np.ndarray:
    """Budget label per run: the nominal budget within tol_dex decades of its C, else NaN.

    For data whose budgets are known (Chinchilla's nine IsoFLOP budgets, 6e18 ... 3e21 [H22,
    Fig. 3]) but whose C values are noisy; NaN runs belong to no profile.
    """
    if not tol_dex >= 0:
        raise ValueError(f"tol_dex must be >= 0 decades, got {tol_dex!r}")
    logc = np.log10(_as_positive("C", c))
    nom = np.log10(_as_positive("nominal budgets", nominal))
    if nom.size == 0:
        raise ValueError("nominal budgets: expected at least one budget, got none")
    dist = np.abs(logc[:, None] - nom[None])
    j = np.argmin(dist, axis=1)
    return np.where(dist[np.arange(logc.size), j] <= tol_dex, 10.0 ** nom[j], np.nan)


def fit_isoflop(
    n: Any,
    d: Any | None,
    loss: Any,
    c: Any | None = None,
    *,
    budgets: Any | None = None,
    tol_dex: float = 0.02,
    min_points: int = 5,
) -> IsoFlopFit:
    """Chinchilla Approach 2 [H22, Sec. 3.2].

    For each budget, fit a parabola in log N to the losses and take its minimum N*(C); then
    D*(C) = C / (k N*) with k = median C/(N D) of that budget (k = 6 when D = C/(6N)). Finally
    log N* = log n_coeff + a log C and log D* = log d_coeff + b log C by least squares over the
    valid budgets (convex parabola, minimum inside the sampled range of N).

    Give `d` (tokens) or `c` (FLOPs) or both; a missing one uses C = 6 N D. Budgets are the
    explicit `budgets` labels if given (numbers; NaN = in no budget, e.g. from `snap_budgets`),
    else `group_budgets(c, tol_dex=tol_dex)`; groups with fewer than `min_points` runs or
    fewer than three distinct N are skipped.
    """
    n = _as_positive("N", n)
    loss = _as_positive("loss", loss)
    if d is None and c is None:
        raise ValueError("fit_isoflop needs tokens D or FLOPs C")
    d_in = _as_positive("D", d) if d is not None else None
    c_in = _as_positive("C", c) if c is not None else None
    sizes = {"N": n.size, "D": None if d_in is None else d_in.size, "loss": loss.size, "C": None if c_in is None else c_in.size}
    if len({v for v in sizes.values() if v is not None}) > 1:
        raise ValueError("inputs differ in length: " + " ".join(f"{k}={v}" for k, v in sizes.items() if v is not None))
    d = d_in if d_in is not None else c_in / (FLOPS_PER_TOKEN_PER_PARAM * n)
    c = c_in if c_in is not None else FLOPS_PER_TOKEN_PER_PARAM * n * d
    if budgets is not None:
        labels = np.asarray(budgets, dtype=float)
        if labels.shape != n.shape:
            raise ValueError(f"budgets has {labels.size} labels for {n.size} runs")
    else:
        labels = group_budgets(c, tol_dex=tol_dex).astype(float)
    out: list[IsoFlopBudget] = []
    small: list[int] = []  # sizes of the groups skipped for too few runs
    for lab in np.unique(labels[np.isfinite(labels)]):
        idx = np.flatnonzero(labels == lab)
        if idx.size < max(min_points, MIN_POINTS_PER_BUDGET) or np.unique(n[idx]).size < MIN_POINTS_PER_BUDGET:
            small.append(int(idx.size))
            continue
        u = np.log(n[idx])
        p2, p1, p0 = np.polyfit(u, loss[idx], 2)
        cb = float(np.exp(np.mean(np.log(c[idx]))))
        k = float(np.median(c[idx] / (n[idx] * d[idx])))
        lo, hi = float(u.min()), float(u.max())
        if p2 <= 0:
            u_opt, valid, reason = float(u[np.argmin(loss[idx])]), False, "parabola not convex"
        else:
            u_opt = -p1 / (2 * p2)
            valid = bool(lo <= u_opt <= hi)
            reason = "" if valid else "minimum outside sampled N range"
        n_opt = float(np.exp(u_opt))
        out.append(
            IsoFlopBudget(
                flops=cb,
                n_points=int(idx.size),
                coeffs=(float(p0), float(p1), float(p2)),
                n_opt=n_opt,
                d_opt=cb / (k * n_opt),
                loss_opt=float(p0 + p1 * u_opt + p2 * u_opt**2),
                log_n_range=(lo, hi),
                valid=valid,
                reason=reason,
                n=tuple(float(v) for v in n[idx]),
                loss=tuple(float(v) for v in loss[idx]),
            )
        )
    out.sort(key=lambda bud: bud.flops)
    good = [bud for bud in out if bud.valid]
    if len(good) < 2:
        raise ValueError(
            f"Approach 2 needs at least two IsoFLOP budgets with an interior minimum; found {len(good)} "
            f"of {len(out)} budgets with >= {min_points} runs"
            + (f" ({len(small)} smaller group(s) of {', '.join(map(str, sorted(small)))} run(s) skipped)" if small else "")
            + " (try explicit budgets or another tol_dex)"
        )
    logc = np.log([bud.flops for bud in good])
    a, log_kn = np.polyfit(logc, np.log([bud.n_opt for bud in good]), 1)
    b, log_kd = np.polyfit(logc, np.log([bud.d_opt for bud in good]), 1)
    return IsoFlopFit(
        budgets=tuple(out), a=float(a), b=float(b), n_coeff=float(np.exp(log_kn)), d_coeff=float(np.exp(log_kd))
    )


# ---------------------------------------------------------------------------------------------
# Chinchilla Approach 3: parametric L(N, D) = E + A/N^alpha + B/D^beta [H22, Sec. 3.3, App. D.2],
# fitted as in [B24]: Huber(delta=1e-3) on log L, LSE form, L-BFGS from a grid of starts.
# ---------------------------------------------------------------------------------------------

# [H22, App. D.2] / [B24]: alpha, beta in {0, 0.5, ..., 2}; e in {-1, -0.5, ..., 1};
# a, b in {0, 5, ..., 25}: 5 * 5 * 5 * 6 * 6 = 4,500 starts.
PAPER_GRID = {
    "alpha": np.arange(0.0, 2.5, 0.5),
    "beta": np.arange(0.0, 2.5, 0.5),
    "e": np.arange(-1.0, 1.5, 0.5),
    "a": np.arange(0.0, 30.0, 5.0),
    "b": np.arange(0.0, 30.0, 5.0),
}
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")


def paper_grid() -> np.ndarray:
    """The 4,500 starting points of [H22, App. D.2], rows [a, b, e, alpha, beta]."""
    g = PAPER_GRID
    return np.array(list(itertools.product(g["a"], g["b"], g["e"], g["alpha"], g["beta"])), dtype=float)


@dataclass(frozen=True)
class ChinchillaFit:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    objective: float  # summed Huber loss at the optimum
    n_points: int
    huber_delta: float
    ci: dict[str, tuple[float, float]] | None = None  # bootstrap percentile intervals
    ci_level: float | None = None
    n_bootstrap: int = 0
    bootstrap_samples: np.ndarray | None = field(default=None, repr=False, compare=False)  # [B, 5]

    @property
    def params_log(self) -> np.ndarray:
        """[a, b, e, alpha, beta], the optimiser's coordinates.

        A fit that sends E to 0 (e < -745 underflows e^e, as where the data leave E unidentified)
        has e = -inf here; math.log(0.0) raised "math domain error"."""
        def log(v: float) -> float:
            return math.log(v) if v > 0 else -math.inf

        return np.array([log(self.A), log(self.B), log(self.E), self.alpha, self.beta])

    def predict(self, n: Any, d: Any) -> np.ndarray:
        n = np.asarray(n, dtype=float)
        d = np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def objective_at(self, n: Any, d: Any, loss: Any) -> float:
        """The fit's objective evaluated at these parameters on (n, d, loss)."""
        return chinchilla_objective(self.params_log, n, d, loss, huber_delta=self.huber_delta)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in PARAM_NAMES}
        out.update(objective=self.objective, n_points=self.n_points, huber_delta=self.huber_delta)
        out["a_exponent"] = self.beta / (self.alpha + self.beta)  # N_opt ∝ C^a, [H22] eq. (4)
        out["b_exponent"] = self.alpha / (self.alpha + self.beta)  # D_opt ∝ C^b
        if self.ci is not None:
            out["ci"] = {k: list(v) for k, v in self.ci.items()}
            out["ci_level"] = self.ci_level
            out["n_bootstrap"] = self.n_bootstrap
        return out


def published_fit(params: dict[str, float], n_points: int = 0) -> ChinchillaFit:
    """A ChinchillaFit holding published parameters (e.g. HOFFMANN_2022), for comparisons."""
    return ChinchillaFit(
        E=params["E"], A=params["A"], B=params["B"], alpha=params["alpha"], beta=params["beta"],
        objective=math.nan, n_points=n_points, huber_delta=1e-3,
    )


def chinchilla_objective(
    params_log: Sequence[float], n: Any, d: Any, loss: Any, *, huber_delta: float = 1e-3
) -> float:
    """Summed Huber loss of log L̂ - log L at [a, b, e, alpha, beta] (for independent checks)."""
    logx = np.log(np.stack([np.asarray(n, dtype=float), np.asarray(d, dtype=float)]))
    f, _ = _lse_objective(np.asarray(params_log, dtype=float)[None], logx, np.log(np.asarray(loss, float)), huber_delta)
    return float(f[0])


def _ci_from_samples(samples_bp: np.ndarray, level: float) -> dict[str, tuple[float, float]]:
    """Percentile intervals of E, A, B, alpha, beta from optima in the optimiser's coordinates
    [a, b, e, alpha, beta].

    The percentiles are taken in those coordinates and then mapped through exp (monotone, so
    it keeps the order): a resample whose coefficient runs off (a > 709, as on 15 points that
    do not identify the law) gives an upper bound of inf. Exponentiating first gave inf samples,
    between which np.percentile interpolates inf - inf = nan, with RuntimeWarnings.
    """
    lo, hi = 50 * (1 - level), 50 * (1 + level)
    q = np.percentile(samples_bp, [lo, hi], axis=0)  # [2, 5]: rows lo, hi
    with np.errstate(over="ignore"):
        nat = np.column_stack([np.exp(q[:, 2]), np.exp(q[:, 0]), np.exp(q[:, 1]), q[:, 3], q[:, 4]])  # [2, 5]
    return {name: (float(nat[0, j]), float(nat[1, j])) for j, name in enumerate(PARAM_NAMES)}


def fit_chinchilla(
    n: Any,
    d: Any,
    loss: Any,
    *,
    huber_delta: float = 1e-3,
    bootstrap: int = 0,
    seed: int = 0,
    ci_level: float = 0.95,
    starts: np.ndarray | None = None,
) -> ChinchillaFit:
    """Chinchilla Approach 3 fit of L(N, D) = E + A/N^alpha + B/D^beta.

    Minimises sum_i Huber_delta(LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i) over
    [a, b, e, alpha, beta] (A = e^a, B = e^b, E = e^e) with L-BFGS from every row of `starts`
    (default: the papers' 4,500-point grid) and keeps the lowest objective [H22, App. D.2; B24].

    bootstrap > 0 resamples the points with replacement that many times and refits each
    resample from the full-data optimum and the best distinct end points of the full grid
    (the optimum's neighbourhood: a cheap stand-in for the full grid per resample); `ci` holds
    the percentile intervals at `ci_level`.
    """
    n = _as_positive("N", n)
    d = _as_positive("D", d)
    loss = _as_positive("loss", loss)
    if not (n.size == d.size == loss.size):
        raise ValueError(f"inputs differ in length: N={n.size} D={d.size} loss={loss.size}")
    if n.size < MIN_POINTS_PARAMETRIC:
        raise ValueError(f"the parametric fit needs at least {MIN_POINTS_PARAMETRIC} points, got {n.size}")
    # E + A/N^alpha takes one value per distinct N: through fewer than three, E, A and alpha are
    # not determined (likewise E, B, beta and D), and the fit returned an arbitrary one (a
    # single model size gave alpha = 1.0 with objective 0, and 1e11 tokens per parameter).
    for name, v in (("N", n), ("D", d)):
        distinct = np.unique(v)
        if distinct.size < MIN_DISTINCT_PARAMETRIC:
            raise ValueError(
                f"the parametric fit needs at least {MIN_DISTINCT_PARAMETRIC} distinct {name} values, "
                f"got {distinct.size} ({', '.join(f'{x:g}' for x in distinct)})"
            )
    _check_huber_delta(huber_delta)
    if not (isinstance(bootstrap, (int, np.integer)) and bootstrap >= 0):
        raise ValueError(f"bootstrap must be a count of resamples >= 0, got {bootstrap!r}")
    if bootstrap and not 0 < ci_level < 1:
        raise ValueError(f"ci_level must lie strictly between 0 and 1 (e.g. 0.95), got {ci_level!r}")
    if bootstrap and not (isinstance(seed, (int, np.integer)) and seed >= 0):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    logx = np.log(np.stack([n, d]))  # [2, n]
    logy = np.log(loss)
    starts = paper_grid() if starts is None else np.atleast_2d(np.asarray(starts, dtype=float))
    if starts.ndim != 2 or starts.shape[1] != len(PARAM_NAMES) or starts.shape[0] == 0:  # (numpy's broadcast error named nothing)
        raise ValueError(f"starts must have shape [K, 5] (rows [a, b, e, alpha, beta], K >= 1), got shape {starts.shape}")
    if not np.isfinite(starts).all():
        raise ValueError(f"starts must be finite; row {int(np.flatnonzero(~np.isfinite(starts).all(axis=1))[0])} is not")
    best, fbest, ends, fends = _fit_lse(logx, logy, starts, huber_delta)
    a, b, e, alpha, beta = (float(v) for v in best)
    # A coefficient past float range (math.exp raised OverflowError, a traceback from `fit`):
    # the best fit runs off, as on resamples of the 15-run GPU sweep (A = e^788, alpha = 63),
    # and L(N, D) has no finite form to report or predict with.
    over = [f"{name} = e^{v:.4g}" for name, v in (("A", a), ("B", b), ("E", e)) if v > LOG_FLOAT_MAX]
    if over:
        raise ValueError(
            f"the parametric fit runs off: {', '.join(over)} is past float range (alpha = {alpha:.4g}, "
            f"beta = {beta:.4g}); these {n.size} runs do not determine L(N, D) (more runs, or a wider "
            "range of N and D, would)"
        )

    ci = samples = None
    if bootstrap > 0:
        samples = _bootstrap(logx, logy, best, ends[_distinct_best(ends, fends, 8)], huber_delta, bootstrap, seed)
        ci = _ci_from_samples(samples, ci_level)
    return ChinchillaFit(
        E=math.exp(e),
        A=math.exp(a),
        B=math.exp(b),
        alpha=alpha,
        beta=beta,
        objective=fbest,
        n_points=int(n.size),
        huber_delta=huber_delta,
        ci=ci,
        ci_level=ci_level if bootstrap > 0 else None,
        n_bootstrap=int(bootstrap),
        bootstrap_samples=samples,
    )


def _bootstrap(
    logx: np.ndarray,
    logy: np.ndarray,
    best: np.ndarray,
    neighbours: np.ndarray,
    delta: float,
    n_resamples: int,
    seed: int,
) -> np.ndarray:
    """Refits on `n_resamples` resamples with replacement; returns [n_resamples, 5] optima.

    A resample is a vector of multiplicities (multinomial counts), so all resamples x starts
    run as one weighted batch.
    """
    rng = np.random.default_rng(seed)
    npts = logy.size
    counts = rng.multinomial(npts, np.full(npts, 1.0 / npts), size=n_resamples).astype(float)  # [B, n]
    starts = np.vstack([best[None], neighbours])  # [S, 5]
    s = starts.shape[0]
    x0 = np.tile(starts, (n_resamples, 1))  # row r*S + j: resample r, start j
    w_rows = np.repeat(counts, s, axis=0)

    def fg(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _lse_objective(x, logx, logy, delta, w_rows[rows])

    ends, fends = _lbfgs_batched(fg, x0, rtol=1e-6)
    fends = np.where(np.isfinite(fends), fends, np.inf).reshape(n_resamples, s)
    best_rows = np.arange(n_resamples) * s + np.argmin(fends, axis=1)

    def fg_best(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _lse_objective(x, logx, logy, delta, counts[rows])

    out, _ = _lbfgs_batched(fg_best, ends[best_rows], rtol=1e-13, max_iter=2000)
    return out


def compute_optimal(
    fit: ChinchillaFit, c: Any, flops_per_token_per_param: float = FLOPS_PER_TOKEN_PER_PARAM
) -> tuple[np.ndarray | float, np.ndarray | float]:
    """(N_opt, D_opt) minimising L(N, D) subject to C = k N D [H22, eq. (4) and App. D.3].

    With D = C/(kN), dL/dN = -alpha A N^(-alpha-1) + beta B (C/k)^(-beta) N^(beta-1) = 0, so
    N^(alpha+beta) = (alpha A / (beta B)) (C/k)^beta. Writing G = (alpha A / (beta B))^(1/(alpha+beta)):
      N_opt = G (C/k)^(beta/(alpha+beta)),   D_opt = (C/k) / N_opt = G^-1 (C/k)^(alpha/(alpha+beta)).
    The stationary point is the minimum: both terms are convex in log N along the constraint.
    Returns floats for scalar C, arrays otherwise.
    """
    c_arr = np.asarray(c, dtype=float)
    if not np.all(np.isfinite(c_arr) & (c_arr > 0)):
        raise ValueError(f"compute budgets C must be finite and positive, got {c!r}")
    kf = flops_per_token_per_param
    if not (isinstance(kf, (int, float, np.floating)) and math.isfinite(kf) and kf > 0):  # 0 gave inf, NaN or < 0 gave NaN
        raise ValueError(f"flops_per_token_per_param (k in C = k N D) must be a finite number > 0 (6 for C = 6ND), got {kf!r}")
    bad = {k: v for k, v in (("A", fit.A), ("B", fit.B), ("alpha", fit.alpha), ("beta", fit.beta)) if not v > 0}
    if bad:
        raise ValueError(
            f"the fit has no compute-optimal allocation: {bad} must be positive (the data show no "
            "trade-off between N and D, e.g. every IsoFLOP minimum sits at the smallest model)"
        )
    s = fit.alpha + fit.beta
    g = (fit.alpha * fit.A / (fit.beta * fit.B)) ** (1.0 / s)
    ck = c_arr / flops_per_token_per_param
    n_opt = g * ck ** (fit.beta / s)
    d_opt = ck ** (fit.alpha / s) / g
    if c_arr.ndim == 0:
        return float(n_opt), float(d_opt)
    return n_opt, d_opt


# ---------------------------------------------------------------------------------------------
# Reading results.
# ---------------------------------------------------------------------------------------------

# Accepted CSV column names, case-insensitive; the first present wins.
CSV_COLUMNS = {
    "N": ("N", "n_params", "params", "Model Size"),
    "D": ("D", "tokens", "Training Tokens"),
    "C": ("C", "flops", "Training FLOP"),
    "loss": ("eval_loss", "loss", "final_loss"),
}
SWEEP_DB = "results.sqlite"
SWEEP_COLUMNS = ("n_params", "tokens", "flops", "final_loss", "eval_loss", "status")


@dataclass(frozen=True)
class RunTable:
    """Finished runs: parameters N, tokens D, training FLOPs C and final loss, one entry per run."""

    n: np.ndarray
    d: np.ndarray
    c: np.ndarray
    loss: np.ndarray
    source: str
    # The IsoFLOP budget each run was planned for (a sweep store's `target` of its `C...`
    # points; NaN for other runs), or None when the source does not say.
    budget: np.ndarray | None = None
    n_skipped: int = 0  # rows left out for a missing (blank / NULL / NaN) N, loss, or D and C

    def __len__(self) -> int:
        return int(self.loss.size)

    @property
    def flops_per_token_per_param(self) -> float:
        """k in C = k N D, the median over the runs: 6 where D = C/(6N) (the Chinchilla CSV);
        a sweep counts C with accounting.flops_per_token, and its small models have k of 3-6."""
        return float(np.median(self.c / (self.n * self.d)))

    def drop_highest_loss(self, k: int) -> "RunTable":
        """Without the k highest-loss runs ([B24] drop five: early-training outliers)."""
        if k <= 0:
            return self
        if k >= len(self):
            raise ValueError(f"cannot drop {k} of {len(self)} runs")
        keep = np.sort(np.argsort(self.loss, kind="stable")[: len(self) - k])
        budget = None if self.budget is None else self.budget[keep]
        return RunTable(self.n[keep], self.d[keep], self.c[keep], self.loss[keep], self.source, budget, self.n_skipped)


def _complete(
    cols: dict[str, tuple[str, np.ndarray]],
    labels: Sequence[str],
    source: str,
    budget: np.ndarray | None = None,
) -> RunTable:
    """Checks the values, fills D = C/(6N) or C = 6ND where missing, and leaves out (and
    counts) the rows without N, loss, or both D and C.

    cols: key ("N", "D", "C", "loss") -> (the column's name in the source, values with NaN
    for a missing value); labels: how to name each row in an error ("line 7", "point X").
    A value that is present must be finite and positive: anything else is an error naming
    the column and the rows, never a silently dropped run.
    """
    for key in ("N", "D", "C", "loss"):
        name, v = cols[key]
        bad = np.flatnonzero(~np.isnan(v) & ~(np.isfinite(v) & (v > 0)))
        if bad.size:
            where = ", ".join(f"{labels[i]} ({v[i]:g})" for i in bad[:5])
            more = f" and {bad.size - 5} more" if bad.size > 5 else ""
            what = f"{name!r}" if name == key else f"{name!r} ({key})"
            raise ValueError(
                f"{source}: column {what} must hold finite positive numbers (leave a cell blank "
                f"for a missing value); got {where}{more}"
            )
    n, d, c, loss = (cols[key][1] for key in ("N", "D", "C", "loss"))
    d = np.where(np.isnan(d), c / (FLOPS_PER_TOKEN_PER_PARAM * n), d)
    c = np.where(np.isnan(c), FLOPS_PER_TOKEN_PER_PARAM * n * d, c)
    ok = np.isfinite(n) & np.isfinite(d) & np.isfinite(c) & np.isfinite(loss)
    # k = C/(N D) is the training FLOPs per token per parameter: 6 for the dense part [K20,
    # Sec. 2.1], 3-6 for a sweep's small models (embedding lookups are free), more with long
    # contexts. A spread over more than MAX_K_SPREAD is no architecture but units that differ
    # between rows (tokens in billions, C in PF-days, or a D filled as C/(6N) from such a C);
    # it was used as it came: Approach 2 grouped and Kaplan's L(C) fitted mismatched C.
    if ok.any():
        k = c[ok] / (n[ok] * d[ok])
        lo, hi = int(np.argmin(k)), int(np.argmax(k))
        if k[hi] > MAX_K_SPREAD * k[lo]:
            at = np.flatnonzero(ok)
            names = "{!r}, {!r} and {!r}".format(*(cols[key][0] for key in ("N", "D", "C")))
            raise ValueError(
                f"{source}: columns {names} disagree about units: C/(N D) is {k[lo]:.3g} at "
                f"{labels[at[lo]]} but {k[hi]:.3g} at {labels[at[hi]]}, more than a factor of "
                f"{MAX_K_SPREAD:g} apart (training FLOPs are about 6 N D); give every row in the same units"
            )
    return RunTable(n[ok], d[ok], c[ok], loss[ok], source, None if budget is None else budget[ok], int((~ok).sum()))


def _float(s: Any) -> float:
    if s is None:
        return math.nan
    if isinstance(s, str):
        s = s.strip()
        if not s:
            return math.nan
    return float(s)


def _load_csv(path: Path) -> RunTable:
    with path.open(newline="", encoding="utf-8-sig") as fh:  # (a spreadsheet's BOM is not part of the first name)
        reader = csv.DictReader(fh)
        rows, lines = [], []
        try:
            header = reader.fieldnames or []
            for row in reader:
                rows.append(row)
                lines.append(f"line {reader.line_num}")
        except (UnicodeDecodeError, csv.Error) as err:
            raise ValueError(f"{path}: not a readable CSV file (UTF-8 text): {err}") from None
    lower = {h.strip().lower(): h for h in header}

    def pick(key: str) -> str | None:
        for cand in CSV_COLUMNS[key]:
            if cand.lower() in lower:
                return lower[cand.lower()]
        return None

    cols = {key: pick(key) for key in CSV_COLUMNS}
    missing = [f"{key} (one of {', '.join(CSV_COLUMNS[key])})" for key in ("N", "loss") if cols[key] is None]
    if cols["D"] is None and cols["C"] is None:
        missing.append(f"D or C (one of {', '.join(CSV_COLUMNS['D'] + CSV_COLUMNS['C'])})")
    if missing:
        raise ValueError(f"{path}: missing column(s) {'; '.join(missing)}; found {header}")

    def column(key: str) -> np.ndarray:
        name = cols[key]
        if name is None:
            return np.full(len(rows), np.nan)
        out = np.empty(len(rows))
        for i, r in enumerate(rows):
            try:
                out[i] = _float(r[name])
            except (TypeError, ValueError):
                raise ValueError(f"{path}: column {name!r} holds a non-number at {lines[i]}: {r[name]!r}") from None
        return out

    return _complete({key: (cols[key] or key, column(key)) for key in ("N", "D", "C", "loss")}, lines, str(path))


def _load_sweep(db: Path) -> RunTable:
    try:
        return _read_sweep(db)
    except sqlite3.DatabaseError as err:  # not a database, a locked or corrupt file
        raise ValueError(f"{db}: cannot read the sweep store: {err}") from None


def _read_sweep(db: Path) -> RunTable:
    # Path.as_uri() percent-encodes '?', '#' and '%': pasted into "file:{db}?mode=ro", a
    # directory named "sweep#2" made SQLite open (and create) a file "sweep" in the cwd.
    # A store without a -wal or -journal file beside it (no runner writing, none crashed) is
    # read as immutable: mode=ro on a WAL store created -wal/-shm files next to it, and failed
    # ("attempt to write a readonly database") where the directory is not writable. With one
    # (a runner is live), read-only through it, which sees the runner's committed rows.
    side = [db.with_name(db.name + ext) for ext in ("-wal", "-journal")]
    mode = "mode=ro" if any(f.exists() for f in side) else "immutable=1"
    con = sqlite3.connect(f"{db.resolve().as_uri()}?{mode}", uri=True)
    try:
        have = {row[1] for row in con.execute("PRAGMA table_info(points)")}
        if not have:
            raise ValueError(f"{db}: no table 'points'")
        missing = [col for col in SWEEP_COLUMNS if col not in have]
        if missing:
            raise ValueError(f"{db}: table 'points' lacks column(s) {', '.join(missing)}")
        # `target` and `id` came with the sweep runner (older or hand-made stores may lack them).
        target = "target" if "target" in have else "NULL"
        pid = "id" if "id" in have else "rowid"
        rows = con.execute(
            f"SELECT n_params, tokens, flops, eval_loss, final_loss, {target}, {pid} "
            "FROM points WHERE status = 'done' ORDER BY rowid"
        ).fetchall()
    finally:
        con.close()
    ids = [str(row[6]) for row in rows]
    names = ("n_params", "tokens", "flops", "eval_loss", "final_loss", "target")
    arr = np.empty((len(rows), 6))
    for i, row in enumerate(rows):
        for j, name in enumerate(names):
            try:
                arr[i, j] = _float(row[j])
            except (TypeError, ValueError):
                raise ValueError(f"{db}: column {name!r} holds a non-number at point {ids[i]}: {row[j]!r}") from None
    # One kind of loss for every run: the held-out eval loss where the store has any, else the
    # train loss. Filling a missing eval loss with the train loss (the mean over the last
    # logging window, 0.01-0.4 above the eval loss on docs/results/sweep_isoflop_gpu_v2) made
    # that run an outlier of up to 10% in a fit whose residuals are ~1%; such a run is now a
    # missing value, left out and counted.
    use_eval = bool(np.isfinite(arr[:, 3]).any())
    loss_name, loss = ("eval_loss", arr[:, 3]) if use_eval else ("final_loss", arr[:, 4])
    # IsoFLOP points (ids `C<budget>-L<depth>-s<seed>`) record the budget they were planned
    # for as `target`; the C they used differs by up to half a step, which for short runs is
    # more than the spacing `group_budgets` chains over, so the fitter groups by the target.
    isoflop = np.array([i.startswith("C") for i in ids], dtype=bool)
    budget = np.where(isoflop, arr[:, 5], np.nan)
    cols = {
        "N": ("n_params", arr[:, 0]),
        "D": ("tokens", arr[:, 1]),
        "C": ("flops", arr[:, 2]),
        "loss": (loss_name, loss),
    }
    labels = [f"point {i}" for i in ids]
    return _complete(cols, labels, str(db), budget if np.isfinite(budget).any() else None)


def load_results(path: str | Path) -> RunTable:
    """Runs from a CSV file or from a sweep directory holding `results.sqlite`.

    CSV: columns (case-insensitive) N | n_params | params | Model Size; D | tokens | Training Tokens
    and/or C | flops | Training FLOP; eval_loss | loss | final_loss. A missing D is C/(6N), a
    missing C is 6ND (the Chinchilla CSV gives C, so D = C/(6N) as in [B24]).
    Sweep store: table `points`, rows with status 'done'; loss = eval_loss if any row has one
    (a row without one is then a missing value), else final_loss for every row; `budget` holds
    the IsoFLOP points' `target`.

    Rows with a missing N or loss, or neither D nor C, are left out and counted in `n_skipped`;
    a value that is present but not finite and positive is an error naming its column and row.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"results path does not exist: {p}")
    if p.is_dir():
        db = p / SWEEP_DB
        if not db.is_file():
            raise FileNotFoundError(f"{p} is a directory without a sweep store {SWEEP_DB}")
        return _load_sweep(db)
    if p.suffix in (".sqlite", ".db"):
        return _load_sweep(p)
    return _load_csv(p)


# ---------------------------------------------------------------------------------------------
# Plots.
# ---------------------------------------------------------------------------------------------

PLOT_NAMES = ("isoflop", "loss_vs_compute", "optimal_allocation", "residuals")


def make_plots(
    out_dir: str | Path,
    runs: RunTable,
    fit: ChinchillaFit | None,
    isoflop: IsoFlopFit | None = None,
    *,
    compute_fit: PowerLawFit | None = None,
    reference: tuple[str, ChinchillaFit] | None = None,
    prefix: str = "",
    title: str = "",
) -> list[Path]:
    """Writes PNGs: IsoFLOP profiles, loss vs compute with the frontier, N_opt and D_opt vs C,
    and the Approach-3 residuals. `fit` None (Approach 3 skipped) leaves its curves out, and
    the residuals plot says so. `reference` = (label, fit) adds a published law to the
    allocation plot. Allocations use the runs' own C = k N D (`flops_per_token_per_param`),
    so the curves sit on the same compute axis as the runs. Returns the written paths."""
    if not isinstance(out_dir, (str, Path)) or not str(out_dir):  # (None: pathlib's TypeError named no argument)
        raise ValueError(f"make_plots: out_dir must be the directory for the PNGs (a str or Path), got {out_dir!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    tag = f" ({title})" if title else ""

    def save(fig: Any, name: str) -> None:
        path = out / f"{prefix}{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    c_lo, c_hi = runs.c.min(), runs.c.max()
    cnorm = LogNorm(c_lo, c_hi)
    k = runs.flops_per_token_per_param

    def optimal(f: ChinchillaFit, c: np.ndarray) -> tuple[Any, Any]:
        return compute_optimal(f, c, k)

    no_allocation = "Approach 3 skipped" if fit is None else ""
    if fit is not None:
        try:  # a fit without an N-D trade-off (alpha or beta <= 0) has no Approach-3 allocation to draw
            optimal(fit, c_hi)
        except ValueError as err:
            no_allocation = str(err)
    cmap = plt.get_cmap("viridis")

    # 1. IsoFLOP profiles with their parabolas.
    fig, ax = plt.subplots(figsize=(7, 4.8))
    if isoflop is not None and isoflop.budgets:
        for bud in isoflop.budgets:
            color = cmap(cnorm(bud.flops))
            lo, hi = bud.log_n_range
            ax.scatter(bud.n, bud.loss, s=12, color=color, alpha=0.7)
            grid = np.exp(np.linspace(lo, hi, 100))
            ax.plot(grid, bud.predict(grid), color=color, lw=1.5, ls="-" if bud.valid else ":",
                    label=f"C = {bud.flops:.1e}")
            if bud.valid:
                ax.plot(bud.n_opt, bud.loss_opt, marker="*", ms=11, color=color, mec="k", mew=0.6)
        ax.legend(fontsize=7, ncol=2, title="IsoFLOP budget (★ = minimum)", title_fontsize=8)
    else:
        ax.scatter(runs.n, runs.loss, c=runs.c, norm=cnorm, cmap=cmap, s=12)
        ax.text(0.5, 0.95, "no IsoFLOP budget with enough runs", transform=ax.transAxes, ha="center", va="top")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("final loss")
    ax.set_title(f"Approach 2: IsoFLOP profiles, parabola in log N{tag}")
    ax.grid(True, which="major", alpha=0.3)
    save(fig, "isoflop")

    # 2. Loss vs compute, with the frontier.
    fig, ax = plt.subplots(figsize=(7, 4.8))
    sc = ax.scatter(runs.c, runs.loss, c=runs.n, norm=LogNorm(runs.n.min(), runs.n.max()), cmap="plasma", s=12, alpha=0.8)
    fig.colorbar(sc, ax=ax, label="parameters N")
    front = pareto_frontier(runs.c, runs.loss)
    ax.step(runs.c[front], runs.loss[front], where="post", color="0.3", lw=1, label="empirical frontier")
    cgrid = np.logspace(math.log10(c_lo), math.log10(c_hi) + 1, 200)
    if not no_allocation:
        n_opt, d_opt = optimal(fit, cgrid)
        ax.plot(cgrid, fit.predict(n_opt, d_opt), color="C0", lw=2, label="Approach 3: L(N_opt(C), D_opt(C))")
    if compute_fit is not None:
        ax.plot(cgrid, compute_fit.predict(cgrid), color="C2", lw=1.5, ls="--",
                label=f"power law on frontier: E + (C_c/C)^{compute_fit.alpha:.3f}")
    if fit is not None:
        ax.axhline(fit.E, color="C0", ls=":", lw=1, label=f"E = {fit.E:.3f}")
    # One budget (C equal to rounding): autoscaling a log axis over it warned "identical low and high xlims".
    one_budget = c_hi < 1.01 * c_lo
    if one_budget:
        ax.set_xlim(c_lo / 2, c_hi * 10)  # (the curves above span c_lo ... 10 c_hi)
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("final loss")
    ax.set_title(f"Loss vs compute{tag}")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    save(fig, "loss_vs_compute")

    # 3. N_opt and D_opt vs C.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    cgrid = np.logspace(math.log10(c_lo) - 0.5, math.log10(c_hi) + 2, 200)
    n3, d3 = optimal(fit, cgrid) if not no_allocation else (None, None)
    for ax, which, y3 in ((axes[0], "N", n3), (axes[1], "D", d3)):
        if y3 is not None:
            ax.plot(cgrid, y3, color="C0", lw=2, label=f"Approach 3 (exponent {fit.beta / (fit.alpha + fit.beta) if which == 'N' else fit.alpha / (fit.alpha + fit.beta):.3f})")
        else:
            why = "skipped" if fit is None else "no compute-optimal allocation\n(alpha or beta <= 0)"
            ax.text(0.5, 0.97, f"Approach 3: {why}", transform=ax.transAxes, ha="center", va="top", fontsize=8, color="C0")
        if reference is not None:
            nr, dr = optimal(reference[1], cgrid)
            ax.plot(cgrid, nr if which == "N" else dr, color="0.4", ls=":", lw=1.5, label=reference[0])
        if isoflop is not None:
            good = [bud for bud in isoflop.budgets if bud.valid]
            pts = [bud.n_opt if which == "N" else bud.d_opt for bud in good]
            ax.scatter([bud.flops for bud in good], pts, color="C3", zorder=3, label="IsoFLOP minima")
            y2 = isoflop.n_opt(cgrid) if which == "N" else isoflop.d_opt(cgrid)
            ax.plot(cgrid, y2, color="C3", ls="--", lw=1.5,
                    label=f"Approach 2 fit (exponent {isoflop.a if which == 'N' else isoflop.b:.3f})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training compute C (FLOPs)")
        ax.set_ylabel("compute-optimal parameters N_opt" if which == "N" else "compute-optimal tokens D_opt")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(f"Compute-optimal allocation{tag}")
    save(fig, "optimal_allocation")

    # 4. Residuals of the Approach-3 fit in log space; without a fit, a note (so that no
    # earlier fit's residuals.png stays in the folder as if it were this one's).
    if fit is None:
        fig, ax = plt.subplots(figsize=(7, 2))
        ax.text(0.5, 0.5, "Approach 3 skipped: no residuals", transform=ax.transAxes, ha="center", va="center")
        ax.set_axis_off()
        save(fig, "residuals")
        return written
    res = np.log(runs.loss) - np.log(fit.predict(runs.n, runs.d))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    sc = axes[0].scatter(runs.c, res, c=runs.n, norm=LogNorm(runs.n.min(), runs.n.max()), cmap="plasma", s=12)
    fig.colorbar(sc, ax=axes[0], label="parameters N")
    axes[0].axhline(0, color="k", lw=0.8)
    for sgn in (-1, 1):
        axes[0].axhline(sgn * fit.huber_delta, color="0.5", lw=0.8, ls=":")
    if one_budget:
        axes[0].set_xlim(c_lo / 2, c_hi * 2)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("training compute C (FLOPs)")
    axes[0].set_ylabel("log L - log L̂")
    axes[0].set_title(f"Approach-3 residuals (dotted: ±Huber δ = {fit.huber_delta:g})")
    axes[0].grid(True, which="major", alpha=0.3)
    axes[1].hist(res, bins=40, color="C0", alpha=0.8)
    axes[1].set_xlabel("log L - log L̂")
    axes[1].set_ylabel("runs")
    axes[1].set_title(f"median |res| = {np.median(np.abs(res)):.4f}")
    save(fig, "residuals")
    return written
