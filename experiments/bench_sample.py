"""The sampler alone: XLA's (`decode.sample`, two sorts) against the Pallas kernel (no sort).

    python experiments/bench_sample.py --vocab 128256 --batches 1,8,64 --out DIR

For each logits distribution, batch and sampling spec, both samplers draw `--draws` tokens in one
jitted loop (a fresh key a draw, as the decode step folds the position into the row's key), so the
time per draw has no dispatch in it. The distributions are normal logits of a few scales: a
near-flat one (scale 0.01) is the kernel's worst case (many rejected candidates, then bisection),
a peaked one (scale 8) its best. Each draw's tokens are compared between the two samplers (they
use the same Gumbel noise, so they must agree up to f32 rounding of a mass at top_p: the count of
disagreeing rows is printed).

Writes DIR/bench_sample.json and DIR/bench_sample.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_attention import time_fn  # noqa: E402
from scaling import decode  # noqa: E402
from scaling.kernels import sample as sample_kernel  # noqa: E402

SPECS = {  # name -> (temperature, top_k, top_p)
    "temperature": (0.8, None, None),
    "top_k=50": (0.8, 50, None),
    "top_p=0.95": (0.8, None, 0.95),
    "top_p=0.5": (0.8, None, 0.5),
    "top_k=50/top_p=0.9": (0.8, 50, 0.9),
}
KERNEL_KEYS = ("splits", "chunk", "num_warps", "max_candidates", "exchange")  # sample_rows' integer settings


def parse_variants(spec: str) -> dict[str, dict]:
    """'auto,one:splits=1,w4:num_warps=4' -> {'auto': {}, 'one': {'splits': 1}, 'w4': {'num_warps': 4}}:
    the Pallas sampler's keyword arguments (sample_rows' KERNEL_KEYS)."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, rest = item.partition(":")
        kw = {}
        for part in filter(None, rest.split("/")):
            key, sep, value = part.partition("=")
            if not sep or key not in KERNEL_KEYS or not value.isdigit():
                raise SystemExit(f"--variants: {part!r} in {item!r} is not key=int with a key in "
                                 f"{', '.join(KERNEL_KEYS)}")
            kw[key] = int(value)
        out[name] = kw
    return out


def sample_with(sampling: decode.Sampling, kernel_kw: dict | None):
    """decode.sample, or with kernel_kw its Pallas branch with those sample_rows arguments."""
    if kernel_kw is None:
        return lambda logits, keys, t, p: decode.sample(logits, keys, t, p, sampling)

    def fn(logits, keys, t, p):
        v = logits.shape[-1]
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
        return sample_kernel.sample_rows(logits, noise, t, p, top_k=sampling.top_k, use_top_p=sampling.use_top_p,
                                         **kernel_kw)
    return fn


def draw_loop(sample_fn, draws: int):
    """jit(logits, temperature, top_p) -> (tokens of every draw [draws, B]); keys folded per draw."""

    @jax.jit
    def run(logits, temperature, top_p):
        base = jax.random.key(0)
        rows = jnp.arange(logits.shape[0])

        def body(i, toks):
            keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), i))(rows)
            tok, _ = sample_fn(logits, keys, temperature, top_p)
            return toks.at[i].set(tok)

        return jax.lax.fori_loop(0, draws, body, jnp.zeros((draws, logits.shape[0]), jnp.int32))

    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--scales", default="0.01,1,3,8", help="std of the normal logits, comma-separated")
    p.add_argument("--specs", default=",".join(SPECS), help=f"comma-separated, from {list(SPECS)}")
    p.add_argument("--variants", default="pallas:", help="Pallas sampler settings, 'name:key=int/...' "
                   f"comma-separated (sample_rows' {', '.join(KERNEL_KEYS)}; none: its defaults)")
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    variants = parse_variants(args.variants)
    specs = args.specs.split(",")
    for s in specs:
        if s not in SPECS:
            raise SystemExit(f"--specs: {s!r} is not one of {list(SPECS)}")
    batches = [int(b) for b in args.batches.split(",")]
    scales = [float(s) for s in args.scales.split(",")]
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  vocab {args.vocab}  "
          f"draws {args.draws}", flush=True)
    rows = []
    for batch in batches:
        for scale in scales:
            logits = scale * jax.random.normal(jax.random.key(1), (batch, args.vocab), jnp.float32)
            for name in specs:
                temperature, top_k, top_p = SPECS[name]
                use_top_p = top_p is not None
                t_args = (logits, jnp.float32(temperature), jnp.float32(top_p if use_top_p else 1.0))
                sampling = decode.Sampling(greedy=False, top_k=top_k, use_top_p=use_top_p)
                out = {}
                for sampler, kw in (("xla", None), *variants.items()):
                    fn = draw_loop(sample_with(sampling, kw), args.draws)
                    out[sampler] = (time_fn(fn, *t_args, warmup=1, reps=args.reps) / args.draws * 1e6, fn(*t_args))
                for sampler in variants:
                    differ = int(jnp.sum(out["xla"][1] != out[sampler][1]))
                    row = {"batch": batch, "scale": scale, "spec": name, "variant": sampler,
                           "kernel_args": variants[sampler], "xla_us": out["xla"][0], "pallas_us": out[sampler][0],
                           "speedup": out["xla"][0] / out[sampler][0], "rows_differ": differ,
                           "rows": batch * args.draws}
                    rows.append(row)
                    print(f"batch {batch:3d} scale {scale:5g} {name:20s} xla {row['xla_us']:8.1f} us  "
                          f"{sampler:8s} {row['pallas_us']:8.1f} us  {row['speedup']:5.2f}x  "
                          f"differ {differ}/{row['rows']}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "vocab": args.vocab,
                "draws": args.draws, "reps": args.reps}
        (args.out / "bench_sample.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = [f"{meta}", "", "| batch | logit scale | spec | Pallas variant | XLA µs/draw | Pallas µs/draw | "
                 "XLA/Pallas | rows differ |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['scale']:g} | {r['spec']} | {r['variant']} {r['kernel_args'] or ''} | "
                  f"{r['xla_us']:.1f} | {r['pallas_us']:.1f} | {r['speedup']:.2f}x | {r['rows_differ']}/{r['rows']} |"
                  for r in rows]
        (args.out / "bench_sample.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
