"""Benchmark our Pallas flash attention against cuDNN and XLA (run on a GPU machine).

    PYTHONPATH=. python experiments/bench_attention.py            # the full table
    PYTHONPATH=. python experiments/bench_attention.py --quick    # a few shapes
    PYTHONPATH=. python experiments/bench_attention.py --shape 4,4096,32,8,128 --causal yes
    PYTHONPATH=. python experiments/bench_attention.py --head-dims 64 --out-name bench_d64
    PYTHONPATH=. python experiments/bench_attention.py --check    # GPU correctness suite first
    PYTHONPATH=. python experiments/bench_attention.py --impls cudnn,ours,mosaic   # + Mosaic forward
    PYTHONPATH=. python experiments/bench_attention.py --impls cudnn,auto,tokamax_mosaic,tokamax_triton

Implementations: `ours` = our Pallas kernels with the Triton forward (backend="triton"),
`mosaic` = flash_attention(backend="mosaic"): the Mosaic GPU (Hopper) forward of
flash_attention_mgpu.py and the Mosaic GPU backward of flash_attention_mgpu_bwd.py (a shape
either kernel does not support falls back to the Triton kernel for that pass; the row's note
says so), `mosaic_tbwd` = the Mosaic forward with the Triton backward (mosaic_backward=False),
`auto` = flash_attention(backend="auto"), what the model's pallas path runs (on Hopper the
faster measured forward and the Mosaic backward; the row's note says which),
`cudnn` and `xla` via jax.nn.dot_product_attention, `tokamax_mosaic` / `tokamax_triton` the
tokamax library's kernels (a peer, installed only where it is benchmarked; docs/attention.md
says which wheels to carry).

FLOPs (FlashAttention-2 paper convention): forward 4·B·H·T²·D, halved when causal; backward
2.5× the forward, so forward+backward counts 3.5× the forward. TFLOP/s = FLOPs / median time.
Before timing a shape we compare our output and gradients with cuDNN's (relative error
‖ours − cudnn‖ / ‖cudnn‖). The implementations of a shape are then timed in interleaved rounds
(every round runs each once, in a rotating order); a ratio to cuDNN is the median of the
per-round ratios, printed with its quartiles. If $OUT is set, the table is also written there
as JSON and markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import os
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from scaling import strict_json
from scaling.kernels import BlockSizes, attention_reference, flash_attention
from scaling.kernels import flash_attention_mgpu as mgpu
from scaling.kernels import flash_attention_mgpu_bwd as mgpu_bwd

fa = importlib.import_module("scaling.kernels.flash_attention")  # the module (the package exports the function)

TOKENS = 16384  # B·T fixed across sequence lengths
HEADS = 32  # hidden 4096 at D=128, 2048 at D=64
XLA_MAX_T = 4096  # XLA materialises [B, H, T, T] logits; beyond this it is slow or out of memory


def header() -> str:
    dev = jax.devices()[0]
    return (f"date {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}  "
            f"device {dev.device_kind} ({dev.platform})  jax {jax.__version__}  "
            f"jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else '?'}")


def flops_fwd(b, t, h, d, causal) -> float:
    f = 4.0 * b * h * t * t * d
    return f / 2 if causal else f


def time_fn(fn, *args, warmup: int = 2, reps: int = 10) -> float:
    """Median seconds of `reps` calls after `warmup` calls, each synchronised."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_interleaved(calls: dict, warmup: int = 2, reps: int = 10, queue: int = 1) -> dict[str, list[float]]:
    """Seconds of each call per round, {name: [reps floats]}; `calls` maps a name to a
    zero-argument callable. Every round runs every call once, each synchronised, in an order
    rotated by one place per round, so a slow drift of the card's clocks or temperature lands on
    all of them alike (timing one implementation's reps and then the next one's put the drift
    into their ratio: about ±5% between calls, docs/benchmarks.md).

    queue > 1: a round's sample of a call is `queue` calls issued back to back and synchronised
    once, divided by `queue`. A single synchronised call adds the host's dispatch and round trip
    to the kernels' time, which is a large share of a sub-millisecond kernel (the forty-ninth
    session: the 350m's attention core timed at 0.78 ms alone, 0.36 ms a layer inside the step)."""
    if queue < 1:
        raise ValueError(f"queue must be >= 1, got {queue}")
    names = list(calls)
    for name in names:
        for _ in range(warmup):
            jax.block_until_ready(calls[name]())
    times = {name: [] for name in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            out = [calls[name]() for _ in range(queue)]
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / queue)
            del out
    return times


def ratio_stats(base: list[float], other: list[float]) -> tuple[float, float, float]:
    """Median, first and third quartile over rounds of base / other time (> 1: other is faster)."""
    ratios = np.asarray(base, np.float64) / np.asarray(other, np.float64)
    return float(np.median(ratios)), float(np.quantile(ratios, 0.25)), float(np.quantile(ratios, 0.75))


def rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_inputs(b, t, h, kv, d, dtype=jnp.bfloat16, seed=None):
    seed = int(np.random.SeedSequence().entropy % 2**31) if seed is None else seed
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), dtype)
    k = jax.random.normal(ks[1], (b, t, kv, d), dtype)
    v = jax.random.normal(ks[2], (b, t, kv, d), dtype)
    do = jax.random.normal(ks[3], (b, t, h, d), dtype)
    return q, k, v, do


# tokamax_*: the tokamax library's kernels (implementation="mosaic" | "triton" | "xla"), the
# best public Pallas attention the issue names as a peer.
IMPLS = ("cudnn", "ours", "mosaic", "mosaic_tbwd", "auto", "xla", "tokamax_mosaic", "tokamax_triton", "tokamax_xla")


def impl_fn(name: str, causal: bool, block_sizes: BlockSizes | None = None):
    """attention(q, k, v) for one implementation."""
    if name == "ours":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, block_sizes=block_sizes)
    if name in ("mosaic", "mosaic_tbwd"):
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, block_sizes=block_sizes, backend="mosaic",
                                               mosaic_backward=name == "mosaic")
    if name == "auto":  # what the model's pallas path runs
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, block_sizes=block_sizes, backend="auto")
    if name in ("cudnn", "xla"):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=name)
    if name.startswith("tokamax_"):  # a peer, not a dependency: carried to the GPU machine as wheels
        try:
            import tokamax
        except ImportError as e:
            raise ValueError(f"implementation {name!r} needs the tokamax package ({e}); "
                             "see docs/benchmarks.md for the wheels to carry") from None
        impl = name.removeprefix("tokamax_")
        return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
    raise ValueError(f"unknown implementation {name!r}; allowed: {', '.join(IMPLS)}")


def fwd_and_fwdbwd(fn):
    fwd = jax.jit(fn)

    @jax.jit
    def fwdbwd(q, k, v, do):
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)

    return fwd, fwdbwd


def bench_shape(b, t, h, kv, d, causal, impls, block_sizes=None, reps=10, queue=1):
    """Rows of {impl, tflops_fwd, tflops_fwdbwd, err_*, vs_cudnn_*} for one shape; cuDNN first as
    the check. All implementations are compiled and checked first, then timed together in
    interleaved rounds (`time_interleaved`): times are medians over rounds, and each ratio to
    cuDNN is the median over rounds of the per-round ratio, with its quartiles."""
    q, k, v, do = make_inputs(b, t, h, kv, d)
    f = flops_fwd(b, t, h, d, causal)
    rows, outs, calls = [], {}, {}
    for name in impls:
        row = dict(impl=name, B=b, T=t, H=h, KV=kv, D=d, causal=causal)
        rows.append(row)
        if name == "xla" and t > XLA_MAX_T:
            row.update(skipped=f"T > {XLA_MAX_T}")
            continue
        try:
            if name.startswith("mosaic") and (why := mgpu.unsupported_reason(q.shape, k.shape, q.dtype, causal=causal,
                                                                             segmented=False)):
                row["note"] = f"Triton forward and backward (Mosaic refuses: {why})"
            elif name == "mosaic" and (why := mgpu_bwd.unsupported_reason(q.shape, k.shape, q.dtype, causal=causal,
                                                                          segmented=False)):
                row["note"] = f"Triton backward (Mosaic backward refuses: {why})"
            if name == "auto":  # which kernels backend="auto" picks on this device
                from scaling.kernels.flash_attention import mosaic_forward_preferred
                f_m = mgpu.unsupported_reason(q.shape, k.shape, q.dtype, causal=causal, segmented=False) is None \
                    and mosaic_forward_preferred(q.shape, k.shape, causal=causal, kind=mgpu.device_kind())
                b_m = mgpu_bwd.unsupported_reason(q.shape, k.shape, q.dtype, causal=causal, segmented=False) is None
                row["note"] = f"fwd {'mosaic' if f_m else 'triton'}, bwd {'mosaic' if b_m else 'triton'}"
            fwd, fwdbwd = fwd_and_fwdbwd(impl_fn(name, causal, block_sizes if name in ("ours", "mosaic", "mosaic_tbwd", "auto")
                                                 else None))
            outs[name] = (fwd(q, k, v), fwdbwd(q, k, v, do))
            if name != "cudnn" and "cudnn" in outs:
                o_ref, g_ref = outs["cudnn"]
                o, g = outs[name]
                row["err_out"] = rel_err(o, o_ref)
                row["err_grad"] = max(rel_err(a, r) for a, r in zip(g, g_ref))
            calls[(name, "fwd")] = functools.partial(fwd, q, k, v)
            calls[(name, "fwdbwd")] = functools.partial(fwdbwd, q, k, v, do)
        except Exception as e:  # keep the table going: a failure is a row, not a crash
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    outs.clear()
    times = time_interleaved(calls, reps=reps, queue=queue) if calls else {}
    for row in rows:
        name = row["impl"]
        if (name, "fwd") not in times:
            continue
        t_fwd, t_all = (statistics.median(times[name, part]) for part in ("fwd", "fwdbwd"))
        row.update(ms_fwd=t_fwd * 1e3, ms_fwdbwd=t_all * 1e3,
                   tflops_fwd=f / t_fwd / 1e12, tflops_fwdbwd=3.5 * f / t_all / 1e12)
        if ("cudnn", "fwd") in times:
            for part in ("fwd", "fwdbwd"):
                med, q1, q3 = ratio_stats(times["cudnn", part], times[name, part])
                row.update({f"vs_cudnn_{part}": med, f"vs_cudnn_{part}_q1": q1, f"vs_cudnn_{part}_q3": q3})
    return rows


def format_table(rows) -> str:
    cols = ["impl", "D", "T", "B", "H", "KV", "causal", "tflops_fwd", "tflops_fwdbwd",
            "vs_cudnn_fwd", "vs_cudnn_fwdbwd", "err_out", "err_grad"]
    lines = ["| " + " | ".join(cols) + " | note |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        cells = []
        for c in cols:
            x = r.get(c, "")
            if isinstance(x, float):
                x = f"{x:.2e}" if c.startswith("err") else f"{x:.2f}" if c.startswith("vs") else f"{x:.0f}"
                if c.startswith("vs") and f"{c}_q1" in r:  # the quartiles of the per-round ratio
                    x += f" ({r[c + '_q1']:.2f}-{r[c + '_q3']:.2f})"
            cells.append(str(x))
        note = " ".join(str(r.get("error", r.get("skipped", r.get("note", "")))).split()).replace("|", "\\|")
        lines.append("| " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines)


def check_suite(seed=None, cases="all") -> list[dict]:
    """Forward and gradients vs the f32 XLA reference on shapes the CPU tests cannot afford.

    cases: "all" or comma-separated indices into the list below.
    """
    all_cases = [  # B, T, S, H, KV, D, causal, segments, dtype
        (2, 1024, 1024, 8, 8, 128, True, False, jnp.bfloat16),
        (1, 1000, 1000, 16, 2, 128, True, False, jnp.bfloat16),
        (2, 777, 777, 8, 1, 64, True, True, jnp.bfloat16),
        (1, 500, 900, 12, 4, 64, False, False, jnp.float16),
        (1, 512, 333, 6, 2, 256, False, True, jnp.bfloat16),
        (1, 1024, 1024, 4, 4, 256, True, False, jnp.bfloat16),
        (1, 300, 300, 8, 8, 128, True, False, jnp.float32),
        (1, 200, 200, 12, 4, 96, True, True, jnp.float16),
    ]
    cases = all_cases if cases == "all" else [all_cases[int(i)] for i in cases.split(",")]
    out = []
    for b, t, s, h, kv, d, causal, segmented, dtype in cases:
        rec = dict(B=b, T=t, S=s, H=h, KV=kv, D=d, causal=causal, segments=segmented, dtype=jnp.dtype(dtype).name)
        try:
            rng = np.random.default_rng(seed)
            q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
            k = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
            v = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
            do = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
            seg = None
            if segmented:  # packed documents, plus q ids absent from kv -> fully masked rows
                seg = (jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1), jnp.int32),
                       jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32))
                if causal:
                    seg = seg[0]
            ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=seg)
            ref = lambda q, k, v: attention_reference(q, k, v, causal=causal, segment_ids=seg)
            o, g = jax.jit(lambda q, k, v, do: (ours(q, k, v), jax.vjp(ours, q, k, v)[1](do)))(q, k, v, do)
            f32 = lambda x: x.astype(jnp.float32)
            with jax.default_matmul_precision("highest"):  # XLA on GPU would use tf32 for f32
                o_r, g_r = jax.jit(lambda q, k, v, do: (ref(q, k, v), jax.vjp(ref, q, k, v)[1](do)))(
                    f32(q), f32(k), f32(v), f32(do))
            rec["err_out"] = rel_err(o, o_r)
            rec["err_dq"], rec["err_dk"], rec["err_dv"] = (rel_err(a, r) for a, r in zip(g, g_r))
            rec["nan"] = bool(any(np.isnan(np.asarray(x, np.float32)).any() for x in (o, *g)))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        print("check", json.dumps(rec), flush=True)
        out.append(rec)
    return out


def failed_checks(checks: list[dict]) -> list[str]:
    """The check cases that failed outright (an exception, or NaN in the output or gradients), one
    line each; the relative errors are reported, not judged (they depend on the dtype)."""
    bad = []
    for i, rec in enumerate(checks):
        shape = ", ".join(f"{k}={rec[k]}" for k in ("B", "T", "S", "H", "KV", "D", "causal", "segments", "dtype") if k in rec)
        if rec.get("error"):
            bad.append(f"check {i} ({shape}): {rec['error']}")
        elif rec.get("nan"):
            bad.append(f"check {i} ({shape}): NaN in the output or gradients")
    return bad


def write_out(name: str, payload: dict, markdown: str | None = None):
    out_dir = os.environ.get("OUT")
    if not out_dir:
        return
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(strict_json.strict(payload), f, indent=1, default=str, allow_nan=False)
    if markdown is not None:
        with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
            f.write(markdown + "\n")


CHECK_CASES = 8  # len(check_suite's all_cases)


def _ints(flag: str, text: str) -> list[int]:
    """A comma list of integers >= 1; spaces and a repeat dropped."""
    out = []
    for s in (s.strip() for s in text.split(",")):
        if not s:
            continue
        try:
            n = int(s)
        except ValueError:
            raise ValueError(f"{flag}: {s!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"{flag}: {n} must be >= 1")
        out.append(n)
    if not out:
        raise ValueError(f"{flag}: none given")
    return list(dict.fromkeys(out))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before anything compiles: a bad flag exits 2 naming it. Adds
    impl_list, shapes, causals, check_cases, block_sizes and per_dim."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T in {1k, 4k}, causal, D=128 only")
    p.add_argument("--shape", action="append", help="B,T,H,KV,D instead of the sweep (repeatable)")
    p.add_argument("--head-dims", default=None, help="head dims of the sweep (default 128,64)")
    p.add_argument("--seq-lens", default=None, help=f"sequence lengths of the sweep, divisors of {TOKENS} "
                                                    "(default 1024,2048,4096,8192,16384)")
    p.add_argument("--out-name", default="bench_attention", help="file name (no suffix) under $OUT")
    p.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    p.add_argument("--impls", default="cudnn,ours,xla", help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--check", nargs="?", const="all",
                   help=f"run the GPU correctness suite first (or cases i,j of 0..{CHECK_CASES - 1})")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--queue", type=int, default=10,
                   help="calls issued back to back per timed sample, synchronised once (1: each call waited for, "
                        "which adds the host's round trip; the default before the forty-ninth session)")
    p.add_argument("--block-sizes", help="JSON of BlockSizes fields for ours (default: the tuned table)")
    p.add_argument("--block-sizes-from", help="tune_attention.json: use its best BlockSizes per head dim")
    args = p.parse_args(argv)
    try:
        _check_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def _check_args(args) -> None:
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    if args.queue < 1:
        raise ValueError(f"--queue must be >= 1, got {args.queue}")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", args.out_name):
        raise ValueError(f"--out-name {args.out_name!r}: a file name stem, of letters, digits, '.', '_' and '-' "
                         "(no '/')")
    args.impl_list = list(dict.fromkeys(s.strip() for s in args.impls.split(",") if s.strip()))
    if unknown := [i for i in args.impl_list if i not in IMPLS]:
        raise ValueError(f"--impls: unknown {unknown}; allowed: {', '.join(IMPLS)}")
    if not args.impl_list:
        raise ValueError(f"--impls: none given; allowed: {', '.join(IMPLS)}")
    if args.check is not None and args.check != "all":
        try:
            args.check_cases = [int(s) for s in args.check.split(",") if s.strip()]
        except ValueError:
            args.check_cases = None
        if not args.check_cases or any(not 0 <= i < CHECK_CASES for i in args.check_cases):
            raise ValueError(f"--check {args.check!r}: 'all' or comma-separated case numbers in 0..{CHECK_CASES - 1}")
    if (args.shape or args.quick) and (args.head_dims is not None or args.seq_lens is not None):
        raise ValueError("--head-dims and --seq-lens set the sweep, which --shape and --quick replace")
    if args.shape and args.quick:
        raise ValueError("--quick's shapes and --shape's: give one")
    args.causals = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    if args.shape:
        args.shapes = []
        for text in args.shape:
            try:
                parts = [int(s) for s in text.split(",")]
            except ValueError:
                parts = []
            if len(parts) != 5 or any(n < 1 for n in parts):
                raise ValueError(f"--shape {text!r}: B,T,H,KV,D, five integers >= 1")
            b, t, h, kv, d = parts
            if h % kv:
                raise ValueError(f"--shape {text!r}: the heads H={h} must be a multiple of the KV heads KV={kv}")
            args.shapes.append(tuple(parts))
    elif args.quick:
        args.shapes = [(TOKENS // t, t, HEADS, HEADS, 128) for t in (1024, 4096)]
        args.causals = [True] if args.causal == "both" else args.causals
    else:
        dims = _ints("--head-dims", args.head_dims if args.head_dims is not None else "128,64")
        lens = _ints("--seq-lens", args.seq_lens if args.seq_lens is not None else "1024,2048,4096,8192,16384")
        if bad := [t for t in lens if TOKENS % t]:
            raise ValueError(f"--seq-lens: {bad} do not divide {TOKENS} (the sweep's B·T); --shape B,T,H,KV,D takes "
                             "any shape")
        args.shapes = [(TOKENS // t, t, HEADS, HEADS, d) for d in dims for t in lens]
    args.block_sizes_obj = None
    if args.block_sizes:
        try:
            args.block_sizes_obj = BlockSizes(**json.loads(args.block_sizes))
        except (ValueError, TypeError) as e:
            raise ValueError(f"--block-sizes {args.block_sizes!r}: a JSON object of BlockSizes fields "
                             f"({', '.join(f.name for f in dataclasses.fields(BlockSizes))}): {e}") from None
    args.per_dim = {}
    if args.block_sizes_from:
        try:
            with open(args.block_sizes_from) as f:
                args.per_dim = {int(d): BlockSizes(**fields) for d, fields in json.load(f)["best"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"--block-sizes-from {args.block_sizes_from!r}: want tune_attention.json's "
                             f"{{\"best\": {{head_dim: BlockSizes fields}}}} ({type(e).__name__}: {e})") from None
    out = os.environ.get("OUT")
    if out:
        if os.path.exists(out) and not os.path.isdir(out):
            raise ValueError(f"$OUT={out!r} is not a folder")
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise ValueError(f"$OUT={out!r}: cannot make the output folder ({e.strerror or e})") from None
        if not os.access(out, os.W_OK | os.X_OK):
            raise ValueError(f"$OUT={out!r}: the output folder is not writable")


def main(argv=None) -> int:
    args = parse_args(argv)
    if (backend := jax.default_backend()) != "gpu":
        print(f"error: bench_attention.py times attention kernels on a GPU; JAX's backend here is {backend!r} "
              "(tests/test_bench_attention.py covers its CPU parts)", file=sys.stderr)
        return 2
    print(header(), flush=True)
    print(" ".join(sys.argv), flush=True)
    checks = check_suite(cases=args.check) if args.check else []
    block_sizes, per_dim = args.block_sizes_obj, args.per_dim
    if args.block_sizes_from:
        print("block sizes from", args.block_sizes_from, per_dim, flush=True)
    rows = []
    for b, t, h, kv, d in args.shapes:
        for causal in args.causals:
            for r in bench_shape(b, t, h, kv, d, causal, args.impl_list, per_dim.get(d, block_sizes), reps=args.reps,
                                 queue=args.queue):
                rows.append(r)
                print("row", json.dumps(r), flush=True)
    table = format_table(rows)
    print(header())
    print(table)
    write_out(args.out_name, dict(header=header(), argv=sys.argv, checks=checks, rows=rows,
                                      block_sizes={d: dataclasses.asdict(bs) for d, bs in per_dim.items()} or (
                                          dataclasses.asdict(block_sizes) if block_sizes else "table")),
              header() + "\n\n" + table)
    if bad := failed_checks(checks):  # the timings are written, but the run is not a pass
        print("error: --check failed:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
