"""Where a batch-1 decode step's time goes between kernels, from the GPU's own kernel timeline.

    PYTHONPATH=.:experiments python3 experiments/trace_decode_step.py --model 1b

Runs the decoder (`layers="megakernel"` by default) on random weights under `jax.profiler`, reads
the GPU kernel events back from the XPlane file (`jax.profiler.ProfileData`) and reports, per
decode step: the megakernel's own duration, the period from one megakernel's start to the
next, and the other kernels that run in between (name, median duration). The gap (period minus
the kernel) is the time the GPU's memory system spends on anything but the step's weights.
`--loop` also traces bench_megakernel's bare loop (the kernel, then argmax) for comparison.
Greedy megakernel chunks are one `megakernel_loop` launch each: the summary then divides by the
chunk's steps. Writes $OUT/trace_decode_step.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from scaling import decode
from scaling.model import build_model

from bench_decode import parse_sampling, preset  # (experiments/ is on the path)

MEGAKERNEL_MARK = "_body"  # the megakernel's kernel name holds its body function's name


def gpu_kernels(xplane: str) -> list[tuple[str, float, float]]:
    """(name, start_ns, duration_ns) of every kernel on the first GPU's streams, by start."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane)
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            out += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    return sorted(out, key=lambda k: k[1])


def summarise(kernels, mark: str) -> dict:
    """Per interval between consecutive kernels named with `mark`: its own time, the period, and
    what ran between (medians over the intervals)."""
    starts = [i for i, k in enumerate(kernels) if mark in k[0]]
    if len(starts) < 3:  # (the name differs): the kernel that takes the most time in all
        total = defaultdict(float)
        for n, _, d in kernels:
            total[n] += d
        mark = max(total, key=total.get) if total else mark
        starts = [i for i, k in enumerate(kernels) if k[0] == mark]
    if len(starts) < 3:
        return {"error": f"{len(starts)} kernels named with {mark!r}; names seen: "
                         f"{sorted({k[0][:80] for k in kernels})[:20]}"}
    own, period, gap, between = [], [], [], defaultdict(list)
    for a, b in zip(starts, starts[1:]):
        name, t0, d = kernels[a]
        t1 = kernels[b][1]
        if t1 - t0 > 20 * d:  # (a chunk boundary: the host's turn, not a step)
            continue
        own.append(d)
        period.append(t1 - t0)
        gap.append(t1 - t0 - d)
        for n, _, dd in kernels[a + 1: b]:
            between[n[:100]].append(dd)
    med = statistics.median
    return {
        "step_kernel": mark[:100], "steps": len(own), "kernel_us": med(own) / 1e3, "period_us": med(period) / 1e3,
        "gap_us": med(gap) / 1e3,
        "gap_p10_p90_us": [float(np.percentile(gap, 10)) / 1e3, float(np.percentile(gap, 90)) / 1e3],
        "between": {n: {"count_per_step": len(v) / len(own), "median_us": med(v) / 1e3}
                    for n, v in sorted(between.items(), key=lambda kv: -sum(kv[1]))},
    }


def traced(fn, out_dir: str) -> list:
    with jax.profiler.trace(out_dir):
        fn()
    files = glob.glob(f"{out_dir}/**/*.xplane.pb", recursive=True)
    return gpu_kernels(max(files, key=os.path.getmtime))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1b")
    ap.add_argument("--layers", default="megakernel", help="the decoder's layers (DecodeLayerImpl)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=129)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--loop", action="store_true", help="also bench_megakernel's bare loop")
    ap.add_argument("--sampling", default="greedy", help="bench_decode's --sampling spec, one of them (e.g. "
                    "temperature=0.8/top_p=0.95): sampled steps run step by step, so the sampler's kernels show")
    ap.add_argument("--skip-entry-check", action="store_true",
                    help="skip the token entry's check against the f32-row entry (two more kernel compiles)")
    args = ap.parse_args(argv)
    try:
        sampling = parse_sampling(args.sampling)
    except ValueError as e:
        ap.error(str(e))
    cfg = preset(args.model)
    model = build_model(cfg, seed=0)
    dec = decode.Decoder(model, chunk=args.chunk, layers=args.layers,
                         sampler=sampling.pop("sampler", decode.SAMPLERS[0]))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (1, args.prompt)).tolist()
    max_len = -(-(args.prompt + args.new) // 128) * 128
    dec.generate(prompts, args.new, max_len=max_len, **sampling)  # compile
    result = {"versions": {"jax": jax.__version__, "device": jax.devices()[0].device_kind}, "args": vars(args)}
    mark = MEGAKERNEL_MARK if args.layers == "megakernel" else "fusion"
    with tempfile.TemporaryDirectory() as d:
        g = {}
        kernels = traced(lambda: g.setdefault("g", dec.generate(prompts, args.new, max_len=max_len, **sampling)), d)
        result["decoder"] = summarise(kernels, mark)
        result["decoder"]["step_ms_timed"] = 1e3 * g["g"].decode_s / g["g"].decode_steps
        # (greedy megakernel chunks are one megakernel_loop launch: per step, its share of one)
        per_call = args.chunk if args.layers == "megakernel" and not sampling and decode._loop_runs(cfg, max_len) else 1
        if per_call > 1 and "kernel_us" in result["decoder"]:
            result["decoder"].update(steps_per_kernel=per_call,
                                     kernel_us_per_step=result["decoder"]["kernel_us"] / per_call,
                                     period_us_per_step=result["decoder"]["period_us"] / per_call)
        print("decoder", json.dumps(result["decoder"], indent=1), flush=True)
    if args.loop and args.layers == "megakernel":
        import bench_megakernel as bm
        from scaling import layers

        plan = decode.megakernel_plan(cfg, max_len)
        bm.time_decode(plan, layers.rope_frequencies(cfg), args.prompt, 64, 1)  # compile
        with tempfile.TemporaryDirectory() as d:
            kernels = traced(lambda: bm.time_decode(plan, layers.rope_frequencies(cfg), args.prompt, 64, 2), d)
            result["loop"] = summarise(kernels, mark)
            print("loop", json.dumps(result["loop"], indent=1), flush=True)
    if args.layers == "megakernel" and not args.skip_entry_check:  # the token entry against the f32-row entry
        from scaling.kernels import decode_megakernel as mk
        from scaling import layers

        plan = decode.megakernel_plan(cfg, max_len)
        inv_freq = layers.rope_frequencies(cfg)
        w = dec.megakernel_weights
        cache = (jax.random.normal(jax.random.key(3), plan.cache_shape) * 0.5).astype(w["embed_vd"].dtype)
        tok, pos = 17, args.prompt
        a = jax.jit(lambda c: mk.megakernel_token_step(tok, pos, w["embed_vd"], mk.rope_tables(max_len, inv_freq),
                                                      w["units"], c, plan=plan))(cache)
        b = jax.jit(lambda c: mk.megakernel_step(w["embed_vd"][tok].astype(np.float32), mk.rope_table(
            jax.numpy.int32(pos), inv_freq), pos, w["units"], c, plan=plan))(cache)
        la, lb = np.asarray(a[0], np.float64), np.asarray(b[0], np.float64)
        result["token_entry_check"] = {"rel": float(np.linalg.norm(la - lb) / np.linalg.norm(lb)),
                                       "argmax_equal": bool(la.argmax() == lb.argmax()),
                                       "cache_equal": bool(np.array_equal(np.asarray(a[2]), np.asarray(b[2])))}
        print("token entry check", result["token_entry_check"], flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "trace_decode_step.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
