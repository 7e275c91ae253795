"""GPU check and timing of the Mosaic GPU forward (scaling/kernels/flash_attention_mgpu.py).

    PYTHONPATH=.:experiments python3 experiments/check_mgpu.py [--time-only] [--variants ...]

1. Correctness: the Mosaic forward (output and log2 lse) at a few shapes against the f32
   reference on fresh random inputs, and flash_attention(backend="mosaic") gradients (Mosaic
   forward + Triton backward) against the reference's.
2. Timing at B=4, T=4096, H=32, D=128 (causal and not): cuDNN, our Triton forward and Mosaic
   forward variants (block_kv / stages / ping-pong), then forward+backward for cuDNN, Triton
   and backend="mosaic". Same FLOP convention and timer as bench_attention.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench_attention import flops_fwd, header, make_inputs, ratio_stats, rel_err, time_fn, time_interleaved
from scaling.kernels import attention_reference, flash_attention
from scaling.kernels import flash_attention_mgpu as mgpu
from scaling.kernels.flash_attention_mgpu import MosaicConfig, mosaic_forward


def ref_lse(q, k, causal, scale):
    h, kv = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), h // kv, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kf, precision="highest") * scale
    if causal:
        t, s = q.shape[1], k.shape[1]
        logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -jnp.inf)
    return jax.nn.logsumexp(logits, axis=-1) * math.log2(math.e)


def check(cases):
    out = []
    for b, t, s, h, kv, d, causal, dtype, cfg in cases:
        rec = dict(B=b, T=t, S=s, H=h, KV=kv, D=d, causal=causal, dtype=jnp.dtype(dtype).name, cfg=str(cfg))
        try:
            rng = np.random.default_rng()
            q, k, v, do = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
                           ((b, t, h, d), (b, s, kv, d), (b, s, kv, d), (b, t, h, d)))
            o, lse = jax.jit(lambda q, k, v: mosaic_forward(q, k, v, causal=causal, config=cfg))(q, k, v)
            f32 = lambda x: x.astype(jnp.float32)
            ref = lambda q, k, v: attention_reference(q, k, v, causal=causal)
            with jax.default_matmul_precision("highest"):
                o_r, vjp_r = jax.vjp(ref, f32(q), f32(k), f32(v))
                g_r = vjp_r(f32(do))
                lse_r = ref_lse(q, k, causal, 1 / math.sqrt(d))
            rec["err_out"] = rel_err(o, o_r)
            rec["err_lse"] = rel_err(lse, lse_r)
            ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="mosaic", mosaic_config=cfg)
            o2, g = jax.jit(lambda q, k, v, do: (ours(q, k, v), jax.vjp(ours, q, k, v)[1](do)))(q, k, v, do)
            rec["err_disp_out"] = rel_err(o2, o_r)
            rec["err_dq"], rec["err_dk"], rec["err_dv"] = (rel_err(a, r) for a, r in zip(g, g_r))
            rec["nan"] = bool(any(np.isnan(np.asarray(x, np.float32)).any() for x in (o, lse, o2, *g)))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            traceback.print_exc()
        print("check", json.dumps(rec), flush=True)
        out.append(rec)
    return out


def timing(b, t, h, kv, d, causal, variants, reps, fwd_only=False):
    q, k, v, do = make_inputs(b, t, h, kv, d)
    f = flops_fwd(b, t, h, d, causal)
    rows = []
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    o_ref = jax.jit(cudnn)(q, k, v)
    fwd = {"cudnn": cudnn, "triton": lambda q, k, v: flash_attention(q, k, v, causal=causal),
           # the dispatcher's forward (default Mosaic tiles, lse kept for the backward)
           "dispatch-mosaic": lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="mosaic")}
    for name, cfg in variants.items():
        fwd[name] = (lambda cfg: lambda q, k, v: mosaic_forward(q, k, v, causal=causal, config=cfg)[0])(cfg)
    calls = {}
    for name, fn in fwd.items():  # compile and check all, then time them in interleaved rounds
        row = dict(impl=name, B=b, T=t, H=h, KV=kv, D=d, causal=causal)
        cfg = variants.get(name)
        if cfg is not None and cfg.persistent and causal and t > mgpu.PERSISTENT_MAX_CAUSAL_LEN:
            row["note"] = (f"runs one CTA per tile: causal T={t} > PERSISTENT_MAX_CAUSAL_LEN="
                           f"{mgpu.PERSISTENT_MAX_CAUSAL_LEN} (--persistent-max-causal-len)")
        try:
            jf = jax.jit(fn)
            row["err_vs_cudnn"] = rel_err(jf(q, k, v), o_ref)
            calls[name] = functools.partial(jf, q, k, v)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    times = time_interleaved(calls, reps=reps)
    for row in rows:
        if row["impl"] in times:
            sec = statistics.median(times[row["impl"]])
            row.update(ms_fwd=sec * 1e3, tflops_fwd=f / sec / 1e12)
            if "cudnn" in times:
                row["vs_cudnn_fwd"], row["vs_cudnn_q1"], row["vs_cudnn_q3"] = ratio_stats(times["cudnn"],
                                                                                         times[row["impl"]])
        print("time", json.dumps(row), flush=True)
    if fwd_only:
        return rows
    best = max((r for r in rows if r["impl"].startswith("mosaic") and "tflops_fwd" in r),
               key=lambda r: r["tflops_fwd"], default=None)
    both = {"cudnn": cudnn, "triton": fwd["triton"]}
    if best is not None:
        cfg = variants[best["impl"]]
        both["mosaic+triton_bwd"] = lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="mosaic",
                                                                   mosaic_config=cfg)
    for name, fn in both.items():
        row = dict(impl=name + " fwd+bwd", B=b, T=t, H=h, KV=kv, D=d, causal=causal)
        try:
            jb = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
            sec = time_fn(jb, q, k, v, do, reps=reps)
            row.update(ms_fwdbwd=sec * 1e3, tflops_fwdbwd=3.5 * f / sec / 1e12)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print("time", json.dumps(row), flush=True)
        rows.append(row)
    return rows


VARIANTS = {
    "mosaic-kv128-s2-pp": MosaicConfig(block_kv=128, stages=2, pingpong=True),
    "mosaic-kv128-s2": MosaicConfig(block_kv=128, stages=2, pingpong=False),
    "mosaic-kv128-s3-pp": MosaicConfig(block_kv=128, stages=3, pingpong=True),
    "mosaic-kv64-s3-pp": MosaicConfig(block_kv=64, stages=3, pingpong=True),
    "mosaic-kv128-s3-pp-r1k": MosaicConfig(block_kv=128, stages=3, pingpong=True, reduction_scratch_bytes=1024),
    "mosaic-kv128-s3-r1k": MosaicConfig(block_kv=128, stages=3, pingpong=False, reduction_scratch_bytes=1024),
    "mosaic-kv64-s4-pp": MosaicConfig(block_kv=64, stages=4, pingpong=True),
    "mosaic-kv64-s4": MosaicConfig(block_kv=64, stages=4, pingpong=False),
    "mosaic-kv64-s3": MosaicConfig(block_kv=64, stages=3, pingpong=False),
    "mosaic-kv128-s4-pp": MosaicConfig(block_kv=128, stages=4, pingpong=True),  # D=64 only (shared memory)
    "mosaic-kv256-s2-pp": MosaicConfig(block_kv=256, stages=2, pingpong=True),  # D=64 only
    "mosaic-kv256-s3-pp": MosaicConfig(block_kv=256, stages=3, pingpong=True),  # D=64 only
    # persistent: one CTA per SM looping over the query tiles
    "mosaic-kv128-s2-pp-pers": MosaicConfig(block_kv=128, stages=2, pingpong=True, persistent=True),
    "mosaic-kv64-s3-pp-pers": MosaicConfig(block_kv=64, stages=3, pingpong=True, persistent=True),
    "mosaic-kv64-s4-pp-pers": MosaicConfig(block_kv=64, stages=4, pingpong=True, persistent=True),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--time-only", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shapes", default="4,4096,32,32,128,1;4,4096,32,32,128,0;4,4096,32,8,128,1")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--fwd-only", action="store_true", help="skip the forward+backward timings")
    p.add_argument("--out-name", default="check_mgpu")
    p.add_argument("--checks", help="comma list of check case indices (default: all)")
    p.add_argument("--persistent-max-causal-len", type=int,
                   help="override flash_attention_mgpu.PERSISTENT_MAX_CAUSAL_LEN (to time longer causal rows "
                        "on the persistent grid; the -pers variants otherwise run one CTA per tile there)")
    args = p.parse_args()
    if args.persistent_max_causal_len:
        mgpu.PERSISTENT_MAX_CAUSAL_LEN = args.persistent_max_causal_len
    print(header(), flush=True)
    checks = []
    if not args.time_only:
        bf, f16 = jnp.bfloat16, jnp.float16
        pers = MosaicConfig(block_kv=128, stages=2, pingpong=True, persistent=True)
        cases = [
            (2, 1024, 1024, 8, 8, 128, True, bf, None),  # token pairing, causal
            (1, 512, 512, 8, 2, 128, True, bf, None),  # head pairing (GQA 4)
            (1, 384, 640, 6, 2, 64, False, f16, None),  # GQA 3 -> token pairing, T != S
            (1, 1024, 1024, 4, 4, 64, True, bf, None),
            (1, 512, 512, 4, 1, 256, True, bf, None),
            (2, 1024, 1024, 8, 8, 128, False, bf, MosaicConfig(block_kv=64, stages=3, pingpong=False)),
            (4, 2048, 2048, 16, 16, 128, True, bf, pers),  # persistent: 1024 items (16 tiles x 16 heads x 4) over the SMs
            (2, 1024, 1536, 8, 2, 128, False, f16, pers),  # persistent, head pairing, T != S
            (3, 1024, 1024, 12, 4, 64, True, bf, dataclasses.replace(pers, block_kv=64, stages=3)),
            (1, 4096, 4096, 32, 8, 128, True, bf, pers),  # persistent, head pairing: 64 tiles x 16 slots dealt in heavy/light pairs
        ]
        if args.checks:
            cases = [cases[int(i)] for i in args.checks.split(",")]
        checks = check(cases)
    variants = {n: VARIANTS[n] for n in args.variants.split(",") if n}
    rows = []
    for shape in args.shapes.split(";"):
        b, t, h, kv, d, c = (int(x) for x in shape.split(","))
        rows += timing(b, t, h, kv, d, bool(c), variants, args.reps, args.fwd_only)
    print(header())
    for r in rows:
        print(f"{r['impl']:26s} B{r['B']} T{r['T']} D{r['D']} H{r['H']} KV{r['KV']} causal={r['causal']!s:5s} "
              f"fwd {r.get('tflops_fwd', float('nan')):6.0f} x{r.get('vs_cudnn_fwd', float('nan')):.2f} "
              f"({r.get('vs_cudnn_q1', float('nan')):.2f}-{r.get('vs_cudnn_q3', float('nan')):.2f})  "
              f"fwd+bwd {r.get('tflops_fwdbwd', float('nan')):6.0f}  "
              f"err {r.get('err_vs_cudnn', float('nan')):.1e} {r.get('error', '')[:120]}{r.get('note', '')}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], args.out_name + ".json"), "w") as fh:
            json.dump(dict(header=header(), checks=checks, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
