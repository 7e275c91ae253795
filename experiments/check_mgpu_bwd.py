"""GPU check and timing of the Mosaic GPU backward (scaling/kernels/flash_attention_mgpu_bwd.py).

    PYTHONPATH=.:experiments python3 experiments/check_mgpu_bwd.py [--time-only] [--variants ...]

1. Correctness: gradients of flash_attention(backend="mosaic") (Mosaic forward + Mosaic
   backward) against the f32 reference's on fresh random inputs, at shapes the CPU tests
   cannot afford; asserts the Mosaic backward was selected for each.
2. Timing per shape (B, T, H, KV, D, causal): cuDNN, Triton (ours), Mosaic fwd + Triton bwd and
   Mosaic fwd + Mosaic bwd per backward tile variant, forward+backward TFLOP/s (3.5x the forward
   FLOPs, bench_attention.py's convention) and the ratio to cuDNN (median and quartiles over
   interleaved rounds, bench_attention.time_interleaved); then the backward alone split into its
   parts (delta, dK/dV kernel, dQ kernel) for each variant, also interleaved, so the slow part
   is visible (--no-peers leaves out the two Triton-backward rows). Writes
   $OUT/check_mgpu_bwd.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench_attention import flops_fwd, header, make_inputs, ratio_stats, rel_err, time_interleaved
from scaling.kernels import attention_reference, flash_attention
from scaling.kernels import flash_attention_mgpu_bwd as bwd
from scaling.kernels.flash_attention_mgpu import mosaic_forward

VARIANTS = {
    "d": bwd.MosaicBwdConfig(),
    "dkv3": bwd.MosaicBwdConfig(stages_dkv=3),
    "dq128": bwd.MosaicBwdConfig(block_kv_dq=128),
    "dkv3-dq128": bwd.MosaicBwdConfig(stages_dkv=3, block_kv_dq=128),
    "dq128s3": bwd.MosaicBwdConfig(block_kv_dq=128, stages_dq=3),
    # D=64 only (register budget): 128 keys per consumer, or 128-row q slots.
    "kv128": bwd.MosaicBwdConfig(block_kv_dkv=128, block_kv_dq=128),
    "q128": bwd.MosaicBwdConfig(block_q_dkv=128, block_kv_dq=128),
    # delta inside the dQ kernel instead of the XLA reduction (timed in the seventh session: within ±4%, not the default)
    "fd": bwd.MosaicBwdConfig(delta_in_dq=True),
    "q128-fd": bwd.MosaicBwdConfig(block_q_dkv=128, block_kv_dq=128, delta_in_dq=True),
    # persistent kernels (one CTA per SM looping over its tiles): dK/dV, dQ, both
    "p": bwd.MosaicBwdConfig(persistent=True),
    "pq": bwd.MosaicBwdConfig(persistent_dq=True),
    "p-pq": bwd.MosaicBwdConfig(persistent=True, persistent_dq=True),
    # dQ fused into the dK/dV kernel (TMA reduce-adds, D=128 only; docs/attention.md, "Fused dQ")
    "f": bwd.MosaicBwdConfig(fused_dq=True),
    "f3": bwd.MosaicBwdConfig(fused_dq=True, stages_dkv=3),  # ~231 KB of shared memory: fits only just
    # two f32 staging tiles per consumer: the store waits for the reduce-add two steps back, not one
    "f2": bwd.MosaicBwdConfig(fused_dq=True, dq_stage_buffers=2),
    # the staging tiles' swizzle (the f32 store's bank pattern): none, 64 bytes; and both changes
    "f-s0": bwd.MosaicBwdConfig(fused_dq=True, dq_stage_swizzle=0),
    "f-s64": bwd.MosaicBwdConfig(fused_dq=True, dq_stage_swizzle=64),
    "f2-s0": bwd.MosaicBwdConfig(fused_dq=True, dq_stage_buffers=2, dq_stage_swizzle=0),
    # twelfth session: dSᵀ to a global-memory workspace, dQ = dS K in a kernel of its own
    "ds2": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=2),
    "ds-c": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=3, ds_workspace_max_bytes=1 << 20),  # chunked
    "ds3": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=3),
    "ds4": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4),
    "ds4t2": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=2, ds_dq_tiles=4),  # 4 q tiles per dQ CTA
    "ds4t3": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=3, ds_dq_tiles=4),
    "ds6": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=6),  # 229 KB: just fits
    "ds4-dkv3": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4, stages_dkv=3),
    # thirteenth session: each head's dQ CTAs launched together (K shared in L2), the same for the
    # dK/dV kernel, and one chunk whatever the size (several chunks now write in place; before
    # that, they were concatenated: ds4 of the thirteenth session's first call). The "-dk" rows of
    # that session's raw files ran delta as a Pallas kernel, since dropped (no gain).
    "ds4h": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4, ds_dq_head_major=True),
    "ds4t3h": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=3, ds_dq_tiles=4, ds_dq_head_major=True),
    "ds4hk": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4, ds_dq_head_major=True, dkv_head_major=True),
    "ds4-1c": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4, ds_workspace_max_bytes=16 << 30),
    # fourteenth session: 4.5 GB, two chunks at B·T = 16k, T = 16k (each 16 KV heads, 4.31 GB)
    "ds4-2c": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4, ds_workspace_max_bytes=4500 << 20),
    "ds4-4c": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4, ds_workspace_max_bytes=2200 << 20),  # 4 x 8 heads
    "ds4-7c": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4, ds_workspace_max_bytes=1400 << 20),  # 5 and 4 heads
    # for the correctness checks: 3.5 MB, so at T = 1k (1.1 MB per head) runs of 2 heads, not 3 + 3 + 2
    "ds4-c3": bwd.MosaicBwdConfig(dq_from_ds=True, stages_dq=4, ds_workspace_max_bytes=3500 << 10),
}


def check(cases, configs):
    out = []
    for (b, t, s, h, kv, d, causal, dtype), cfg_name in ((c, n) for c in cases for n in configs):
        cfg = VARIANTS[cfg_name] if cfg_name else None
        rec = dict(B=b, T=t, S=s, H=h, KV=kv, D=d, causal=causal, dtype=jnp.dtype(dtype).name, config=cfg_name)
        try:
            why = bwd.unsupported_reason((b, t, h, d), (b, s, kv, d), dtype, causal=causal, segmented=False,
                                         config=cfg)
            assert why is None, why
            rng = np.random.default_rng()
            q, k, v, do = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
                           ((b, t, h, d), (b, s, kv, d), (b, s, kv, d), (b, t, h, d)))
            ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="mosaic", mosaic_bwd_config=cfg)
            o, g = jax.jit(lambda q, k, v, do: (ours(q, k, v), jax.vjp(ours, q, k, v)[1](do)))(q, k, v, do)
            f32 = lambda x: x.astype(jnp.float32)
            ref = lambda q, k, v: attention_reference(q, k, v, causal=causal)
            with jax.default_matmul_precision("highest"):
                o_r, vjp_r = jax.vjp(ref, f32(q), f32(k), f32(v))
                g_r = vjp_r(f32(do))
            rec["err_out"] = rel_err(o, o_r)
            rec["err_dq"], rec["err_dk"], rec["err_dv"] = (rel_err(a, r) for a, r in zip(g, g_r))
            rec["nan"] = bool(any(np.isnan(np.asarray(x, np.float32)).any() for x in (o, *g)))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            traceback.print_exc()
        print("check", json.dumps(rec), flush=True)
        out.append(rec)
    return out


def _row(name, shape, **kw):
    b, t, h, kv, d, causal = shape
    return dict(impl=name, B=b, T=t, H=h, KV=kv, D=d, causal=causal, **kw)


def timing(shape, variants, reps, peers=True):
    """Every implementation of this shape timed in interleaved rounds (bench_attention's
    time_interleaved), then the backward's parts of every variant, also interleaved."""
    b, t, h, kv, d, causal = shape
    q, k, v, do = make_inputs(b, t, h, kv, d)
    f = flops_fwd(b, t, h, d, causal)
    impls = {"cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")}
    if peers:
        impls["triton"] = lambda q, k, v: flash_attention(q, k, v, causal=causal)
        impls["mosaic+triton_bwd"] = lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="mosaic",
                                                                     mosaic_backward=False)
    for name, cfg in variants.items():
        impls[f"mosaic+mbwd-{name}"] = (lambda cfg: lambda q, k, v: flash_attention(
            q, k, v, causal=causal, backend="mosaic", mosaic_bwd_config=cfg))(cfg)
    rows, calls, g_ref = {}, {}, None
    for name, fn in impls.items():
        row = rows[name] = _row(name, shape)
        try:
            jb = jax.jit(lambda q, k, v, do, fn=fn: jax.vjp(fn, q, k, v)[1](do))
            g = jb(q, k, v, do)
            if g_ref is None:
                g_ref = g
            else:
                row["err_grad_vs_cudnn"] = max(rel_err(a, r) for a, r in zip(g, g_ref))
            calls[name] = (lambda jb=jb: jb(q, k, v, do))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    times = time_interleaved(calls, reps=reps)
    for name, ts in times.items():
        sec = float(np.median(ts))
        rows[name].update(ms_fwdbwd=sec * 1e3, tflops_fwdbwd=3.5 * f / sec / 1e12)
        if "cudnn" in times:
            med, lo, hi = ratio_stats(times["cudnn"], ts)
            rows[name].update(vs_cudnn_fwdbwd=med, vs_cudnn_q1=lo, vs_cudnn_q3=hi)
    for row in rows.values():
        print("time", json.dumps(row), flush=True)
    rows = list(rows.values())
    # The backward alone and its parts (same inputs; o and lse from the Mosaic forward).
    o, lse = jax.jit(lambda q, k, v: mosaic_forward(q, k, v, causal=causal))(q, k, v)
    delta_fn = jax.jit(bwd.output_row_dot)
    delta = delta_fn(o, do)
    part_calls, part_rows = {("delta (XLA)", "ms"): lambda: delta_fn(o, do)}, {}
    # FLOPs: dK/dV 4 matmuls, dQ 3 (each 2·B·H·T²·D, halved when causal).
    part_flops = {}
    for name, cfg in variants.items():
        geo = bwd._Geometry(batch=b, q_len=t, kv_len=t, heads=h, kv_heads=kv, head_dim=d, causal=causal,
                            sm_scale=1 / math.sqrt(d), cfg=cfg)
        parts = {
            "bwd": jax.jit(lambda q, k, v, o, lse, do, cfg=cfg: bwd.mosaic_backward(
                q, k, v, o, lse, do, causal=causal, config=cfg)),
            "dkv": jax.jit(lambda q, k, v, o, lse, do, geo=geo: bwd._dkv_call(q, k, v, do, lse, delta, geo, False)),
            # with delta_in_dq the dQ kernel reads O and also produces delta
            "dq": jax.jit(lambda q, k, v, o, lse, do, geo=geo: bwd._dq_call(
                q, k, v, do, lse, o if geo.cfg.delta_in_dq else delta, geo, False)),
        }
        if cfg.dq_from_ds:  # the dK/dV kernel also writes dSᵀ; the dQ kernel reads it
            ds = jax.jit(lambda q, k, v, do, lse, geo=geo: bwd._dkv_call(q, k, v, do, lse, delta, geo, False)[2])(
                q, k, v, do, lse)
            dq_fn = jax.jit(lambda ds, k, geo=geo: bwd._dq_from_ds_call(ds, k, geo, False))  # ds an argument,
            parts["dq"] = lambda q, k, v, o, lse, do, ds=ds, dq_fn=dq_fn: dq_fn(ds, k)  # not a captured constant
        if cfg.fused_dq:  # one kernel (dK, dV and the dQ reduce-adds; the zeroed f32 dQ included)
            def fused_dkv(q, k, v, o, lse, do, geo=geo):
                acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
                dk, dv = bwd._dkv_call(q, k, v, do, lse, delta, geo, False, acc)
                return acc[...], dk, dv

            parts = {"bwd": parts["bwd"], "dkv": jax.jit(fused_dkv)}
        part_rows[name] = _row(f"mbwd-{name} parts", shape)
        for part, fn in parts.items():
            try:
                jax.block_until_ready(fn(q, k, v, o, lse, do))
                part_calls[(name, part)] = (lambda fn=fn: fn(q, k, v, o, lse, do))
                part_flops[(name, part)] = {"bwd": 2.5 * f, "dkv": (2.5 if cfg.fused_dq else 2.0) * f,
                                            "dq": (0.5 if cfg.dq_from_ds else 1.5) * f}[part]
            except Exception as e:
                part_rows[name][f"error_{part}"] = f"{type(e).__name__}: {str(e)[:300]}"
    times = time_interleaved(part_calls, reps=reps)
    row = _row("delta (XLA)", shape)  # from the host: mostly dispatch (profile_mgpu_bwd.py: 0.09 ms on the GPU)
    row["ms"] = float(np.median(times.pop(("delta (XLA)", "ms")))) * 1e3
    print("part", json.dumps(row), flush=True)
    rows.append(row)
    for (name, part), ts in times.items():
        sec = float(np.median(ts))
        part_rows[name][f"ms_{part}"] = sec * 1e3
        part_rows[name][f"tflops_{part}"] = part_flops[(name, part)] / sec / 1e12
    for row in part_rows.values():
        print("part", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--time-only", action="store_true")
    p.add_argument("--variants", default="d,dkv3,dq128,dkv3-dq128")
    p.add_argument("--shapes", default="4,4096,32,32,128,1;4,4096,32,32,128,0;4,4096,32,8,128,1;4,4096,32,32,64,1")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-peers", action="store_true", help="time only cuDNN and the Mosaic backward variants "
                   "(not the Triton kernels)")
    p.add_argument("--check-configs", default=",f", help="variant names for the correctness checks "
                   "('' = the default tiles)")
    args = p.parse_args()
    print(header(), flush=True)
    checks = []
    if not args.time_only:
        bf, f16 = jnp.bfloat16, jnp.float16
        checks = check([
            (2, 1024, 1024, 8, 8, 128, True, bf),
            (2, 1024, 1024, 8, 8, 128, False, bf),
            (1, 512, 512, 8, 2, 128, True, bf),  # GQA 4
            (1, 384, 640, 6, 2, 64, False, f16),  # GQA 3, T != S
            (1, 1024, 1024, 4, 4, 64, True, bf),
            (1, 768, 768, 12, 4, 128, True, f16),
        ], args.check_configs.split(","))
    rows = []
    for shape in filter(None, args.shapes.split(";")):  # --shapes "": the correctness checks only
        b, t, h, kv, d, c = (int(x) for x in shape.split(","))
        names = [n for n in args.variants.split(",") if n]
        variants = {n: VARIANTS[n] for n in names
                    if bwd.unsupported_reason((b, t, h, d), (b, t, kv, d), jnp.bfloat16, causal=bool(c),
                                              segmented=False, config=VARIANTS[n]) is None
                    and (d == 64 or VARIANTS[n].block_kv_dkv == 64 and VARIANTS[n].block_q_dkv == 64)}
        rows += timing((b, t, h, kv, d, bool(c)), variants, args.reps, peers=not args.no_peers)
    print(header())
    for r in checks:
        print("check", {k: (f"{x:.1e}" if isinstance(x, float) else x) for k, x in r.items()})
    for r in rows:
        if "ms_fwdbwd" in r or "error" in r:
            print(f"{r['impl']:30s} T{r['T']} H{r['H']} KV{r['KV']} D{r['D']} causal={r['causal']!s:5s} "
                  f"fwd+bwd {r.get('tflops_fwdbwd', float('nan')):6.0f} x{r.get('vs_cudnn_fwdbwd', float('nan')):.2f} "
                  f"[{r.get('vs_cudnn_q1', float('nan')):.2f}-{r.get('vs_cudnn_q3', float('nan')):.2f}] "
                  f"err {r.get('err_grad_vs_cudnn', float('nan')):.1e} {r.get('error', '')[:150]}")
        else:
            print(f"{r['impl']:30s} " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in r.items() if k.startswith(("ms", "tflops", "error"))))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_mgpu_bwd.json"), "w") as fh:
            json.dump(dict(header=header(), checks=checks, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
