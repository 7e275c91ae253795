"""Where the time to the first token goes: the prefill's GPU kernels against its wall time.

    PYTHONPATH=.:experiments python3 experiments/trace_prefill.py --models 1b,llama2_7b --prompts 128,2048

`Decoder.stream` times its prefill (`Generation.prefill_s`) from before the prefill call to the
first tokens back on the host: the prefill itself, the first tokens' sampling, the megakernel's
cache layout and the read-back. For each (model, prompt) at batch 1 this script
- times that span over `--reps` calls (the decoder's own `prefill_s`, one new token), and the time
  from the call to the first tokens (`first_token_ms`: the cache's allocation and the
  arguments' transfers too);
- times each of its parts with a sync before and after it, by wrapping the decoder's functions:
  the call's return (`*_dispatch_ms`, the host's share) and its outputs ready;
- traces one call under `jax.profiler`, and the prefill call alone, and reports the GPU's kernels
  within each: how many, their summed time, the span from the first one's start to the last one's
  end, the largest gaps between consecutive kernels, and the kernels that take the most time.
The gap between the wall time and the kernels' span is the host's (dispatch, transfers); the
gaps inside the span are the GPU waiting on the host. Writes $OUT/trace_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from scaling import decode
from scaling.model import build_model

from bench_decode import preset  # (experiments/ is on the path)
from trace_decode_step import traced

# The decoder's calls on the way to its first tokens (Decoder.stream; the cache's allocation comes
# before its prefill timer starts), timed apart; those a version of the decoder lacks or does not
# call are left out
PARTS = ("_empty_cache", "_prefill_rows", "_first_tokens", "megakernel_cache")


def timed_parts(dec, prompts, max_len, reps: int) -> dict:
    """Each part's wall time with a sync before and after it (medians over reps calls), and the
    prefill_s of the same calls (which the syncs lengthen a little). A part called while another
    one is traced (a jitted function inside a jitted one) runs unwrapped: it has no time of its own."""
    spent: dict[str, list[float]] = defaultdict(list)
    originals = {name: getattr(decode, name) for name in PARTS if hasattr(decode, name)}

    def wrap(name, fn):
        def run(*a, **k):
            if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((a, k))):
                return fn(*a, **k)  # (inside another part's trace)
            jax.block_until_ready((a, k))  # (the part alone: what was queued before it has run)
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[f"{name}_dispatch"].append(time.perf_counter() - t)  # (the host's share: the call's return)
            jax.block_until_ready(out)
            spent[name].append(time.perf_counter() - t)
            return out
        return run

    try:
        for name, fn in originals.items():
            setattr(decode, name, wrap(name, fn))
        totals = [dec.generate(prompts, 1, max_len=max_len).prefill_s for _ in range(reps)]
    finally:
        for name, fn in originals.items():
            setattr(decode, name, fn)
    med = statistics.median
    return {"prefill_ms_with_syncs": med(totals) * 1e3,
            **{f"{name}_ms": med(v) * 1e3 for name, v in spent.items()},
            "calls_per_generate": {name: len(spent[name]) // reps for name in PARTS if name in spent}}


def traced_part(dec, prompts, max_len, name: str = "_prefill_rows") -> dict:
    """One call of the decoder's part `name` traced alone (its inputs ready before, its outputs
    waited for): its kernels, their span and the gaps inside it."""
    fn, seen = getattr(decode, name), {}

    def run(*a, **k):
        jax.block_until_ready((a, k))
        with tempfile.TemporaryDirectory() as d:
            holder = {}
            seen["kernels"] = traced(lambda: holder.setdefault("out", jax.block_until_ready(fn(*a, **k))), d)
        return holder["out"]

    setattr(decode, name, run)
    try:
        dec.generate(prompts, 1, max_len=max_len)
    finally:
        setattr(decode, name, fn)
    return kernel_summary(seen.get("kernels", []))


def kernel_summary(kernels: list[tuple[str, float, float]], top: int = 12) -> dict:
    """The kernels of one traced call: count, summed time, span, largest gaps, heaviest names."""
    if not kernels:
        return {"error": "no GPU kernels in the trace"}
    busy = sum(d for _, _, d in kernels)
    start, end = kernels[0][1], max(s + d for _, s, d in kernels)
    gaps = []
    reach = kernels[0][1] + kernels[0][2]
    for (name, s, d), prev in zip(kernels[1:], kernels):
        if s > reach:
            gaps.append((s - reach, prev[0][:80], name[:80]))
        reach = max(reach, s + d)
    by_name = defaultdict(lambda: [0, 0.0])
    for name, _, d in kernels:
        by_name[name[:100]][0] += 1
        by_name[name[:100]][1] += d
    return {
        "kernels": len(kernels), "busy_ms": busy / 1e6, "span_ms": (end - start) / 1e6,
        "idle_in_span_ms": sum(g for g, _, _ in gaps) / 1e6,
        "largest_gaps": [{"us": g / 1e3, "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:8]],
        "heaviest": [{"name": n, "count": c, "ms": t / 1e6}
                     for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def one_case(dec, cfg, prompt: int, new: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (1, prompt)).tolist()
    max_len = -(-(prompt + new) // 128) * 128  # (bench_decode.py's cache for this case)
    dec.generate(prompts, 2, max_len=max_len)  # compile, and the megakernel's copy of the weights
    dec.generate(prompts, 2, max_len=max_len)
    walls, firsts = [], []
    for _ in range(reps):
        timing, t = {}, time.perf_counter()
        it = dec.stream(prompts, 1, max_len=max_len, timing=timing)
        next(it)  # (the first tokens, on the host)
        firsts.append(time.perf_counter() - t)
        for _ in it:
            pass
        walls.append(timing["prefill_s"])
    med = statistics.median
    out = {"prompt": prompt, "max_len": max_len, "layers_batch1": dec._step_layers(1).value,
           "prefill_ms": med(walls) * 1e3, "prefill_ms_min_max": [min(walls) * 1e3, max(walls) * 1e3],
           # (from the call: the cache's allocation and the arguments' transfers too)
           "first_token_ms": med(firsts) * 1e3, "first_token_ms_min_max": [min(firsts) * 1e3, max(firsts) * 1e3]}
    out.update(timed_parts(dec, prompts, max_len, reps))
    with tempfile.TemporaryDirectory() as d:
        g = {}
        kernels = traced(lambda: g.setdefault("g", dec.generate(prompts, 1, max_len=max_len)), d)
    out["traced_prefill_ms"] = g["g"].prefill_s * 1e3
    out["trace"] = kernel_summary(kernels)
    out["trace_prefill_rows_alone"] = traced_part(dec, prompts, max_len)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="1b")
    ap.add_argument("--prompts", default="128,2048")
    ap.add_argument("--new", type=int, default=256, help="the benchmark's new tokens: they size the cache")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", default="auto", help="the decoder's layers (DecodeLayerImpl)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.new < 1:
        ap.error(f"--reps and --new must be >= 1, got {args.reps} and {args.new}")
    result = {"versions": {"jax": jax.__version__, "device": jax.devices()[0].device_kind}, "args": vars(args),
              "cases": []}
    for name in args.models.split(","):
        cfg = preset(name)
        dec = decode.Decoder(build_model(cfg, seed=0), layers=args.layers)
        for prompt in (int(p) for p in args.prompts.split(",")):
            case = {"model": name, **one_case(dec, cfg, prompt, args.new, args.reps)}
            result["cases"].append(case)
            print(json.dumps(case, indent=1), flush=True)
        del dec
    out = Path(os.environ.get("OUT", "."))
    (out / "trace_prefill.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
