"""The markdown table of experiments/bench_remat.py (measured vs predicted per policy, the
largest-batch searches, what was skipped), apart from the driver that measures."""

from __future__ import annotations

import sys
import time

from remat_search import largest_cell

GiB = 2**30


def fmt(x, scale=1.0, spec=",.2f", none="n/a") -> str:
    return none if x is None else format(x * scale, spec)


def rate(x: float, unit: str) -> str:
    """FLOP/s or B/s with an SI prefix (T on a GPU, G on a CPU), 3 significant digits.

    Rounded before the prefix is chosen (999.7e9 is "1 T", not "1e+03 G"); past the largest
    prefix the digits are written out ("1,200 P"), never in exponent form."""
    x = float(f"{x:.3g}")
    prefix, v = next(((p, v) for p, v in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))
                      if abs(x) >= v), ("", 1.0))
    y = x / v
    return f"{y:,.0f} {prefix}{unit}" if abs(y) >= 100 else f"{y:.3g} {prefix}{unit}"


def cell(x) -> str:
    """Text for a markdown table cell: a '|' (in an error message) would split the cell."""
    return str(x).replace("|", "\\|").replace("\n", " ")


def byte_unit(rows: list[dict]) -> tuple[str, int]:
    """MiB for a CPU smoke run (every byte count in the table under 1 GiB), else GiB. Judged on
    the byte counts present: a failed or skipped row has none (it used to count as 1 GiB, which
    put a CPU run's whole table in GiB: 0.00 everywhere)."""
    sizes = [v for r in rows for v in (r.get("xla"), r.get("peak"), r.get("pred", {}).get("memory")) if v]
    return ("MiB", 2**20) if max(sizes, default=0) < GiB else ("GiB", GiB)


def err(pred, meas) -> str:
    return "n/a" if pred is None or not meas else f"{pred / meas - 1:+.0%}"



_DTYPE_NAME = {"bfloat16": "bf16", "float32": "f32 (TF32 matmuls, priced at the f32 rate)"}


def report(args, cal: dict | None, rows: list[dict], notes: list[str], wall: float) -> str:
    seq = next((r["seq"] for r in rows if "seq" in r), args.seq)
    unit, ub = byte_unit(rows)
    dev = cal["device"] if cal else "?"
    lines = [
        f"# bench_remat: `{args.model}`, {_DTYPE_NAME.get(getattr(args, 'compute_dtype', 'bfloat16'), '?')} compute, "
        f"batch {args.batch} x {seq}, one {dev}",
        "",
        f"{time.strftime('%Y-%m-%d')}, jax {cal['jax'] if cal else '?'}; `python experiments/bench_remat.py "
        + " ".join(sys.argv[1:]) + f"`; {wall:.0f} s.",
        "",
    ]
    if cal:
        def r(key, unit):
            if cal.get(key):
                return f"**{rate(cal[key], unit)}**"
            if key == "host" and cal.get("backend") == "cpu":
                return f"none ({cal.get('host_error', '?')}; no host time charged)"
            return f"n/a ({cal.get(key + '_error', '?')}; table default used)"

        lines += [
            f"Measured in this run: the layer's bf16 matmuls (forward + backward at {args.batch} x {seq} tokens) "
            f"{r('matmul', 'FLOP/s')} (a square {cal.get('matmul_n', '?')}^3: {r('matmul_square', 'FLOP/s')}); "
            f"the output head's f32 backward matmuls {r('f32_matmul', 'FLOP/s')}; device copy "
            f"(x * 2, {cal['copy_bytes'] / GiB:g} GiB, read + write) {r('copy', 'B/s')}"
            + (f" ({rate(cal['copy_4gib'], 'B/s')} at 4 GiB)" if cal.get("copy_4gib") else "")
            + f"; {cal.get('attention_impl', '?')} attention fwd+bwd at the model's shapes {r('attention', 'FLOP/s')} "
            f"(3 x causal forward FLOPs); device -> pinned host -> device in one compiled program "
            f"{r('host', 'B/s')}" + (" one way" if cal.get("host") else "")
            + (f" ({rate(cal['host_larger_only'], 'B/s')} from the "
                                     f"{max(int(k) for k in cal['host_roundtrip_s']) / GiB:g} GiB round trip alone)"
                                     if cal.get("host") and cal.get("host_larger_only") else "") + ".",
            "",
        ]
    lines += [
        "Peak: `memory_stats()['peak_bytes_in_use']`; XLA: `memory_analysis()` (temp + args + outputs - aliased); "
        "predicted: `accounting.training_memory` (largest phase) and `accounting.training_time` (calibrated: measured "
        "rates above, kernels adding up); roofline: `accounting.training_roofline` (datasheet peaks, perfect "
        "overlap); MFU: model FLOPs / (datasheet peak x measured step). Errors are predicted / measured - 1.",
        "",
        f"| policy | peak {unit} | XLA {unit} | predicted {unit} | error | predicted peak phase | step ms | predicted ms "
        f"(matmul at the {cal.get('matmul_n', 8192) if cal else 8192}^3 rate + attn + memory) | error | predicted ms, "
        f"layer-matmul rate | roofline ms | MFU | "
        f"largest batch (measured) | predicted largest | peak {unit} at largest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pr = r.get("pred", {})
        if "seconds" not in r:
            lines.append(f"| {r['policy']} | {cell(r.get('error', 'failed'))} | | {fmt(pr.get('memory'), 1 / ub)} | | "
                         f"{pr.get('phase', '')} | | {fmt(pr.get('seconds'), 1e3, ',.1f')} | | "
                         f"{fmt(pr.get('seconds_layer_rate'), 1e3, ',.1f')} | {fmt(pr.get('roofline'), 1e3, ',.1f')} | | | "
                         f"{pr.get('largest', 'n/a')} | |")
            continue
        meas_mem = r.get("peak") or r.get("xla")
        parts = (f" ({pr['matmul_s'] * 1e3:,.1f} + {pr['attention_s'] * 1e3:,.1f} + {pr['memory_s'] * 1e3:,.1f}"
                 + (f"; host {pr['host_s'] * 1e3:,.1f}" if pr.get("host_s") else "") + ")") if "seconds" in pr else ""
        mfu = (pr["model_flops"] / (pr["peak_flops"] * r["seconds"])) if "model_flops" in pr else None
        s = r.get("search", {})
        largest = largest_cell(s) if s else "n/a"
        st = s.get("step") or {}
        peak_at = st.get("peak") if st.get("ok") and st.get("batch") == s.get("found") else None
        lines.append(
            f"| {r['policy']} | {fmt(r.get('peak'), 1 / ub)} | {fmt(r['xla'], 1 / ub)} | {fmt(pr.get('memory'), 1 / ub)} | "
            f"{err(pr.get('memory'), meas_mem)} | {pr.get('phase', '')} | {r['seconds'] * 1e3:,.1f} | "
            f"{fmt(pr.get('seconds'), 1e3, ',.1f')}{parts} | {err(pr.get('seconds'), r['seconds'])} | "
            f"{fmt(pr.get('seconds_layer_rate'), 1e3, ',.1f')} ({err(pr.get('seconds_layer_rate'), r['seconds'])}) | "
            f"{fmt(pr.get('roofline'), 1e3, ',.1f')} | {fmt(mfu, 100, '.1f')}{'%' if mfu else ''} | {cell(largest)} | "
            f"{pr.get('largest', 'n/a')} | {fmt(peak_at, 1 / ub)} |"
        )
    for r in rows:
        pr = r.get("pred", {})
        if pr.get("seconds_host_overlapped") and r.get("seconds"):
            lines += ["", f"{r['policy']}: {pr['host_bytes'] / 1e9:.2f} GB per step to pinned host and back at the "
                      f"measured {rate(cal['host'], 'B/s') if cal and cal.get('host') else 'table default rate'}: "
                      f"{pr['host_s'] * 1e3:,.1f} ms. Predicted step with the transfers after the compute "
                      f"(accounting.StepTime, the table's column): {pr['seconds'] * 1e3:,.1f} ms "
                      f"({err(pr['seconds'], r['seconds'])}); with them overlapping the compute: "
                      f"{pr['seconds_host_overlapped'] * 1e3:,.1f} ms ({err(pr['seconds_host_overlapped'], r['seconds'])}); "
                      f"measured {r['seconds'] * 1e3:,.1f} ms."]
    searched = [r for r in rows if r.get("search", {}).get("probes") is not None]
    if searched:
        s0 = searched[0]["search"]
        lines += ["", f"Largest-batch search (batch: XLA {unit} (compile seconds); limit "
                  f"{fmt(s0.get('limit'), 1 / ub)} {unit}: the device's bytes_limit or --capacity-gib"
                  + (f"; pinned host {fmt(s0['host_limit'], 1 / ub)} {unit} (XLA's pinned-host pool, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, default 64 GiB; at most 90% of available RAM), held against "
                     "XLA's host bytes, or the accounting's offloaded residuals where XLA reports none"
                     if s0.get("host_limit") else "")
                  + "). Probes are compile-only (memory_analysis)"
                  + (", bracketed with autotuning off (xla_gpu_autotune_level=0), then the bracket's lower side "
                     "compiled autotuned (the normal compile) and its upper side too unless the autotune difference "
                     "measured cannot bring it under the limit" if s0.get("autotune") else "")
                  + "; then one real step at the batch found.", ""]
        for r in searched:
            s = r["search"]

            def probe_text(p, ref=None):
                b, d, h, _, sec, src = p
                delta = f", {(d - ref) / 2**20:+,.0f} MiB vs autotune off" if ref is not None else ""
                host = f" + host {h / ub:.2f}" + (" predicted" if src == "predicted" else "") if h else ""
                return f"{b}: {d / ub:.2f}{host} ({sec:.0f} s{delta})"

            fast = {p[0]: p[1] for p in s["probes"] if not p[3]}
            parts = [f"planner {s['predicted']}", f"measured {r['batch']}: {r['xla'] / ub:.2f}"]
            if s.get("autotune"):
                parts.append("autotune off: " + (", ".join(probe_text(p) for p in s["probes"] if not p[3]) or "none"))
                parts.append("autotuned: " + (", ".join(probe_text(p, fast.get(p[0])) for p in s["probes"] if p[3])
                                              or "none"))
            else:
                parts.append("probes: " + (", ".join(probe_text(p) for p in s["probes"]) or "none"))
            st = s.get("step")
            if st and not st.get("measured"):
                kind = "" if not s.get("autotune") else (" (autotuned)" if st.get("tuned") else " (autotune off)")
                parts.append(f"real step at {st['batch']}{kind}: "
                             + ((f"peak {fmt(st['peak'], 1 / ub)}" if st.get("peak") else "ran") if st["ok"]
                                else f"failed: {st.get('error')}"))
            if s.get("stopped"):
                parts.append(f"stopped: {s['stopped']}")
            lines.append(f"- {r['policy']}: " + "; ".join(parts))
    if notes:
        lines += ["", "Skipped or failed:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines)
