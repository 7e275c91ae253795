"""The largest-batch search of experiments/bench_remat.py, as pure functions: which batch to
probe next, the bracket the probes give, and the result a parent rebuilds from a child's
reported probes (also from a child killed at its deadline). No JAX here; tested on the CPU in
tests/test_bench_remat.py.

A probe's usage: its bytes over the limit, device and pinned host (search: host_used), the
larger of the two; it fits when <= 1.
"""

from __future__ import annotations

import math


def usage(dev: float, host: float, limit: float, host_cap: float | None) -> float:
    r = dev / limit
    return max(r, host / host_cap) if host_cap and host else r


def bracket(points: dict[int, float]) -> tuple[int, int | None]:
    """(largest batch that fits or 0, smallest that does not or None)."""
    lo = max((b for b, r in points.items() if r <= 1), default=0)
    hi = min((b for b, r in points.items() if r > 1), default=None)
    return lo, hi


def settled(lo: int, hi: int | None, max_batch: int) -> bool:
    """Nothing left to probe: lo fits and lo + 1 does not (hi < lo: not monotone), or lo is the cap."""
    return (hi is not None and hi <= lo + 1) or (hi is None and lo >= max_batch)


def next_probe(points: dict[int, float], max_batch: int, start: int | None = None) -> int | None:
    """The next batch to probe, None when settled: `start` first (the planner's prediction),
    then where the line through the two sides of the gap (or the two probes nearest it)
    crosses the limit, kept inside the gap; bisection where no line can be drawn."""
    lo, hi = bracket(points)
    if settled(lo, hi, max_batch):
        return None
    upper = hi - 1 if hi is not None else max_batch
    if start is not None and start not in points and lo < start <= upper:
        return start
    if lo in points and hi is not None:
        (b1, r1), (b2, r2) = (lo, points[lo]), (hi, points[hi])
    else:
        anchor = lo if lo in points else hi
        near = sorted(points, key=lambda b: (abs(b - anchor), b))[:2]
        (b1, r1), (b2, r2) = sorted((b, points[b]) for b in near) if len(near) == 2 else ((0, 0.0), (0, 0.0))
    slope = (r2 - r1) / (b2 - b1) if b2 != b1 else 0.0
    if slope > 0:
        est = math.floor(b1 + (1 - r1) / slope)
    else:
        est = lo * 2 if hi is None else (lo + hi) // 2
    return min(max(est, lo + 1), upper)


def inferred_over(b: int, fast: dict[int, float], tuned: dict[int, float]) -> bool:
    """Batch b, over the limit with autotuning off, is over it autotuned too: by more than
    twice the largest autotune difference measured at a batch probed both ways."""
    both = [x for x in tuned if x in fast]
    return b in fast and bool(both) and fast[b] - 2 * max(abs(tuned[x] - fast[x]) for x in both) > 1


def summarize_search(events: list[dict], max_batch: int, measured_peak: float | None = None) -> dict | None:
    """The search's result from a child's events (search_start, probe..., step..., search)."""
    start = next((e for e in events if e["kind"] == "search_start"), None)
    if start is None:
        return None
    limit, cap, b0 = start["limit"], start.get("host_limit"), start["batch"]
    fast: dict[int, tuple] = {}
    tuned: dict[int, tuple] = {b0: (start["xla"], start.get("host_used", 0))}  # the measured step's own compile
    probes = []
    for e in events:
        if e["kind"] == "probe":
            h = e.get("host_used", e.get("host", 0))
            (tuned if e["tuned"] else fast)[e["batch"]] = (e["xla"], h)
            probes.append([e["batch"], e["xla"], h, e["tuned"], e["seconds"], e.get("host_source", "xla")])
    r_fast = {b: usage(d, h, limit, cap) for b, (d, h) in fast.items()}
    r_tuned = {b: usage(d, h, limit, cap) for b, (d, h) in tuned.items()}
    lo, hi = bracket({**r_fast, **r_tuned})
    steps = [e for e in events if e["kind"] == "step"]
    step = steps[-1] if steps else None
    if step is None and lo == b0:
        step = {"batch": b0, "ok": True, "tuned": True, "peak": measured_peak, "measured": True}
    done = next((e for e in events if e["kind"] == "search"), None)
    return {
        "predicted": start.get("predicted"), "limit": limit, "host_limit": cap, "autotune": start.get("autotune", False),
        "found": lo, "hi": hi, "bracketed": (hi is not None and hi == lo + 1) or (hi is None and lo >= max_batch),
        "monotone": hi is None or hi > lo,
        "lo_autotuned": lo in tuned, "hi_autotuned": hi is None or hi in tuned,
        "hi_inferred": hi is not None and hi not in tuned and inferred_over(hi, r_fast, r_tuned),
        "probes": probes, "step": step,
        "stopped": done.get("stopped") if done else "killed at its deadline",
    }


def largest_cell(s: dict) -> str:
    """The table's 'largest batch (measured)' cell from summarize_search's result."""
    if s.get("skipped"):
        return f"skipped: {s['skipped']}"
    lo, hi = s["found"], s["hi"]
    monotone = hi is None or hi > lo
    # Not monotone (a batch below the one found is over the limit): "≥ 12, < 10" would say
    # nothing fits; the cell names the batch that broke the order instead.
    text = str(lo) if s["bracketed"] else f"≥ {lo}" + (f", < {hi}" if hi and monotone else "")
    why = []
    if not s["bracketed"]:
        why.append("not bracketed" if monotone else f"probes not monotone: {hi} is over the limit")
    if s.get("autotune"):  # which sides of the bracket were compiled the normal (autotuned) way
        # (lo 0, nothing fits: no lower side to compile)
        lo_ok, hi_ok = s.get("lo_autotuned") or not lo, s.get("hi_autotuned") or s.get("hi_inferred")
        if hi is None:  # no upper side (yet, or the cap): only the lower one to check
            hi_ok = lo_ok
        if not lo_ok and not hi_ok:
            why.append("autotune-off probes only")
        elif not lo_ok or not hi_ok:
            why.append(f"{lo if not lo_ok else hi}: autotune-off probe only")
    st = s.get("step")
    if not st:
        if lo:  # (nothing fits: no step to run)
            why.append("no real step")
    elif not st["ok"]:
        why.append(f"real step failed: {st.get('error', '?')[:80]}")
    elif st.get("after_host_oom"):
        why.append(f"a real step at {st['after_host_oom']} ran out of XLA's pinned-host pool; one ran at {st['batch']}")
    elif st["batch"] != lo:
        why.append(f"real step ran at {st['batch']}")
    return text + (f" ({'; '.join(why)})" if why else "")
