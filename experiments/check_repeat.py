"""Run-to-run check of the attention kernels on a GPU: the same inputs, many calls, identical bits?

    PYTHONPATH=.:experiments python3 experiments/check_repeat.py [--repeats 50] [--impls auto,cudnn]

Persistent kernels hand work between loop iterations through shared-memory barriers; a missing
wait shows up as a result that changes from one call to the next (and, rarely, as a wrong one),
which a single comparison with a reference can miss. For each shape: forward output and
gradients of the first call against the f32 reference (relative error), then `--repeats` more
calls, each compared bit for bit with the first; prints the number of calls that differed and
the largest difference. Our kernels write every output element once, in a fixed order, so any
difference is a bug; cuDNN is printed beside them for comparison (its backward may sum in a
varying order). Writes $OUT/check_repeat.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from bench_attention import header, impl_fn, make_inputs, rel_err
from scaling.kernels import attention_reference

SHAPES = "4,4096,32,8,128,1;8,2048,32,8,64,1;2,8192,32,32,128,1;4,4096,32,32,128,0;3,1000,16,4,64,1"


def run(shape, impl: str, repeats: int) -> dict:
    b, t, h, kv, d, causal = shape
    q, k, v, do = make_inputs(b, t, h, kv, d)
    fn = impl_fn(impl, causal)
    step = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, *vjp(do)))(*jax.vjp(fn, q, k, v)))
    first = step(q, k, v, do)
    # compared on the device: pulling four [B, T, H, D] arrays to the host per call costs more than the calls
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
    same = jax.jit(lambda a, b: (jnp.all(bits(a) == bits(b)), jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))))
    f32 = lambda x: x.astype(jnp.float32)
    ref = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, *vjp(do)))(
        *jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=causal), q, k, v)))
    with jax.default_matmul_precision("highest"):
        expect = ref(f32(q), f32(k), f32(v), f32(do))
    rec = dict(impl=impl, B=b, T=t, H=h, KV=kv, D=d, causal=causal, repeats=repeats,
               err=dict(zip(("out", "dq", "dk", "dv"), (rel_err(a, r) for a, r in zip(first, expect)))))
    del expect
    differing, worst = 0, 0.0
    for _ in range(repeats):
        checks = [same(a, f) for a, f in zip(step(q, k, v, do), first)]
        if not all(bool(eq) for eq, _ in checks):
            differing += 1
            worst = max(worst, *(float(m) for _, m in checks))
    rec.update(differing_calls=differing, max_abs_diff=worst,
               nan=bool(any(jnp.isnan(x).any() for x in first)))
    print(json.dumps(rec), flush=True)
    return rec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES, help="B,T,H,KV,D,causal;...")
    p.add_argument("--impls", default="auto,cudnn")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    print(header(), flush=True)
    rows = [run(tuple(int(x) for x in s.split(",")), impl, args.repeats)
            for s in args.shapes.split(";") for impl in args.impls.split(",")]
    for r in rows:
        errs = " ".join(f"{k} {v:.1e}" for k, v in r["err"].items())
        print(f"{r['impl']:6s} B{r['B']} T{r['T']} H{r['H']} KV{r['KV']} D{r['D']} causal={r['causal']}: "
              f"rel. err vs f32 {errs}; {r['differing_calls']}/{r['repeats']} calls differed "
              f"(max |diff| {r['max_abs_diff']:.2e}){' NaN' if r['nan'] else ''}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_repeat.json"), "w") as fh:
            json.dump(dict(header=header(), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
