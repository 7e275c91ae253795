"""Where the Mosaic backward's time goes on the GPU, kernel by kernel, from a jax.profiler trace.

    PYTHONPATH=.:experiments python3 experiments/profile_mgpu_bwd.py --shape 1,16384,32,32,128 \
        --variants ds4,ds4-1c

For each variant of `check_mgpu_bwd.VARIANTS`, traces `--calls` calls of the jitted backward
(`mosaic_backward`, o and lse from the Mosaic forward) and prints, per GPU kernel name, the count
and total time per call, plus the busy time per call (the union of the kernel intervals).
Writes $OUT/profile_mgpu_bwd.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile

import jax

from bench_attention import make_inputs
from check_mgpu_bwd import VARIANTS
from scaling.kernels import flash_attention_mgpu_bwd as bwd
from scaling.kernels.flash_attention_mgpu import mosaic_forward
from scaling.profile_summary import load_trace, union_length


def device_kernels(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every complete event on a GPU stream line (the device
    process also has derived lines, "XLA Ops" and the like, that repeat the same time)."""
    events = trace.get("traceEvents", [])
    pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e.get("args", {}).get("name", "")).startswith("/device:GPU")}
    streams = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e.get("pid") in pids and "Stream" in str(e.get("args", {}).get("name", ""))}
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
            if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams and "dur" in e]


def timeline(kernels: list[tuple[str, float, float]], calls: int) -> list[dict]:
    """The last call's kernels in launch order: start (ms from the call's first kernel), duration
    and the idle gap before each, which shows what a kernel boundary costs beyond the kernels."""
    per_call = len(kernels) // calls
    last = sorted(kernels, key=lambda k: k[1])[-per_call:]
    t0, rows, prev_end = last[0][1], [], None
    for name, ts, dur in last:
        rows.append(dict(name=name, start_ms=(ts - t0) / 1e3, ms=dur / 1e3,
                         gap_us=0.0 if prev_end is None else ts - prev_end))
        prev_end = ts + dur
    return rows


def profile(fn, calls: int) -> dict:
    jax.block_until_ready(fn())  # compiled and warm
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn())
        trace, _ = load_trace(d)
    kernels = device_kernels(trace)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in kernels:
        by_name[name][0] += 1
        by_name[name][1] += dur
    busy = union_length([(ts, ts + dur) for _, ts, dur in kernels])
    return {
        "kernels": {n: {"count_per_call": c / calls, "ms_per_call": t / calls / 1e3}
                    for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])},
        "busy_ms_per_call": busy / calls / 1e3,
        "timeline": timeline(kernels, calls),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="1,16384,32,32,128",
                   help="B,T,H,KV,D (causal); several separated by ';'")
    p.add_argument("--variants", default="ds4,ds4-1c")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--timeline", action="store_true", help="also print the last call's kernels in order")
    args = p.parse_args()
    out = {}
    for shape in args.shape.split(";"):
        b, t, h, kv, d = (int(x) for x in shape.split(","))
        q, k, v, do = make_inputs(b, t, h, kv, d)
        o, lse = jax.jit(lambda q, k, v: mosaic_forward(q, k, v, causal=True))(q, k, v)
        for name in args.variants.split(","):
            cfg = VARIANTS[name]
            fn = jax.jit(lambda q, k, v, o, lse, do, cfg=cfg: bwd.mosaic_backward(q, k, v, o, lse, do, causal=True,
                                                                                   config=cfg))
            res = out[f"{shape} {name}"] = profile(lambda fn=fn: fn(q, k, v, o, lse, do), args.calls)
            print(f"== {name}  shape {shape}  busy {res['busy_ms_per_call']:.3f} ms/call  "
                  f"(kernels summed {sum(x['ms_per_call'] for x in res['kernels'].values()):.3f})", flush=True)
            for kname, x in list(res["kernels"].items())[:12]:
                print(f"   {x['ms_per_call']:8.3f} ms  x{x['count_per_call']:.0f}  {kname[:100]}", flush=True)
            if args.timeline:
                print("   last call, in order:  start ms   ms   gap µs  kernel", flush=True)
                for row in res["timeline"]:
                    print(f"   {row['start_ms']:9.3f} {row['ms']:7.3f} {row['gap_us']:7.1f}  {row['name'][:60]}",
                          flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_mgpu_bwd.json"), "w") as fh:
            json.dump(dict(device=str(jax.devices()[0].device_kind), runs=out), fh, indent=1)


if __name__ == "__main__":
    main()
