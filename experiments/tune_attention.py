"""Tune the flash-attention tiles per head dim; prints the `BLOCK_SIZE_TABLE` entries it picks.

    PYTHONPATH=. python experiments/tune_attention.py                   # D = 64, 128, 256
    PYTHONPATH=. python experiments/tune_attention.py --head-dims 128 --budget-s 200

For each head dim it times, on one causal bf16 shape (B·T = 16k tokens, T = 4096, H = 32):
  1. forward candidates (block_q, block_k, num_warps, num_stages), forward pass alone;
  2. fused backward candidates (dK/dV kernel that also accumulates dQ with atomics), backward
     pass alone (_backward on saved o, lse);
  3. split backward: dK/dV candidates with the dQ kernel fixed, then dQ candidates;
and keeps the faster backward of 2 and 3. The kernels are independent, so the best combine. Each candidate that fails to
compile (e.g. out of shared memory) is reported and skipped. A wall-clock budget stops the sweep
early and still prints what was found. Results go to $OUT/tune_attention.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp

from bench_attention import check_suite, fa, flops_fwd, header, make_inputs, time_fn, write_out  # noqa: E402

# Candidates per head dim: (block_q, block_k, num_warps, num_stages) for the forward, the same
# four for the dK/dV kernel (fused: it also accumulates dQ with atomics), and for the two-kernel
# backward the dK/dV and dQ kernels. Rows of q tiles count folded heads. The lists were cut down
# from a wider first sweep (docs/attention.md, run 1) to the candidates that came near the top.
FWD = {
    64: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3), (128, 64, 4, 3)],
    256: [(64, 32, 4, 2), (128, 64, 8, 1)],
}
DKV_FUSED = {
    64: [(64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 2)],
    128: [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 2), (128, 128, 8, 1), (64, 64, 4, 3),
          (32, 64, 4, 3), (128, 64, 8, 2)],
    256: [(64, 64, 8, 1), (32, 64, 4, 2)],
}
DKV = {
    64: [(64, 64, 4, 3), (64, 128, 4, 2), (64, 64, 4, 2)],
    128: [(64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 1), (32, 64, 4, 3)],
    256: [(64, 64, 8, 1)],
}
DQ = {
    64: [(128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2)],
    128: [(64, 64, 4, 2), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)],
    256: [(128, 32, 8, 1)],
}


def _fwd_fields(c):
    return dict(block_q=c[0], block_k=c[1], num_warps_fwd=c[2], num_stages_fwd=c[3])


def _dkv_fields(c):
    return dict(block_q_dkv=c[0], block_k_dkv=c[1], num_warps_dkv=c[2], num_stages_dkv=c[3])


def _dq_fields(c):
    return dict(block_q_dq=c[0], block_k_dq=c[1], num_warps_dq=c[2], num_stages_dq=c[3])


def tune_head_dim(d, *, t=4096, tokens=16384, heads=32, kv_heads=None, causal=True, deadline=float("inf"),
                  reps=10):
    b = tokens // t
    kv = kv_heads or heads
    q, k, v, do = make_inputs(b, t, heads, kv, d)
    f = flops_fwd(b, t, heads, d, causal)
    base = fa.default_block_sizes(d, jnp.bfloat16)
    log = []

    def plan_for(bs):
        return fa._make_plan(q, k, causal=causal, segmented=False, sm_scale=d ** -0.5, blocks=bs,
                             interpret=jax.default_backend() == "cpu")

    def measure(kind, bs):
        plan = plan_for(bs)
        if kind == "fwd":
            fn = jax.jit(lambda q, k, v: fa._forward(q, k, v, None, plan)[0])
            sec = time_fn(fn, q, k, v, reps=reps)
            return f / sec / 1e12
        o, lse = fa._forward(q, k, v, None, plan)
        fn = jax.jit(lambda q, k, v, o, lse, do: fa._backward(q, k, v, None, o, lse, do, plan))
        sec = time_fn(fn, q, k, v, o, lse, do, reps=reps)
        return 2.5 * f / sec / 1e12

    def sweep(kind, candidates, to_fields, current):
        best, best_tf = current, -1.0
        for c in candidates:
            if time.time() > deadline:
                print(f"  {kind} {c}: skipped (budget)", flush=True)
                continue
            bs = dataclasses.replace(current, **to_fields(c))
            t0 = time.time()
            try:
                tf = measure(kind, bs)
                rec = dict(D=d, kind=kind, cand=c, tflops=tf, wall_s=time.time() - t0)
                if tf > best_tf:
                    best, best_tf = bs, tf
            except Exception as e:
                rec = dict(D=d, kind=kind, cand=c, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            print("  tune", json.dumps(rec), flush=True)
            log.append(rec)
        return best, best_tf

    best, tf_fwd = sweep("fwd", FWD[d], _fwd_fields, base)
    fused, tf_fused = sweep("bwd(fused dkv+dq)", DKV_FUSED[d], _dkv_fields, dataclasses.replace(best, fused_dq=True))
    split = dataclasses.replace(best, fused_dq=False)
    split, _ = sweep("bwd(dkv, split)", DKV[d], _dkv_fields, split)
    split, tf_split = sweep("bwd(dq, split)", DQ[d], _dq_fields, split)
    best = fused if tf_fused >= tf_split else split
    print(f"D={d}: best fwd {tf_fwd:.0f} TFLOP/s, bwd fused {tf_fused:.0f} / split {tf_split:.0f} TFLOP/s"
          f"  ->  {best}", flush=True)
    return best, log


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--t", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384, help="B·T")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new candidates after this")
    p.add_argument("--check", nargs="?", const="all", help="run the GPU correctness suite first (or cases i,j)")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    start = time.time()
    print(header(), flush=True)
    print(" ".join(sys.argv), flush=True)
    checks = check_suite(cases=args.check) if args.check else []
    deadline = start + args.budget_s
    results, logs = {}, []
    for d in (int(x) for x in args.head_dims.split(",")):
        best, log = tune_head_dim(d, t=args.t, tokens=args.tokens, heads=args.heads, kv_heads=args.kv_heads, deadline=deadline, reps=args.reps)
        results[d] = dataclasses.asdict(best)
        logs += log
    print("\nBLOCK_SIZE_TABLE entries (bf16):")
    for d, fields in results.items():
        print(f"    ({d}, False): BlockSizes(**{fields}),")
    write_out("tune_attention", dict(header=header(), argv=sys.argv, checks=checks, best=results, log=logs))
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
