"""Tune the Pallas decode-layer kernels (scaling.kernels.decode_gemv) against XLA, per weight shape.

    python experiments/tune_decode_gemv.py --models 1b,llama2_7b --out $OUT

For each model shape and each of the four kernels (qkv_rope, out projection + residual,
gate/up + SwiGLU, down + residual), at batch 16 (the kernels' row tile), times a sweep of
tiles (block_k, block_n, rope_parts, num_stages, num_warps) and, beside it, the same work as
XLA does it in the decoder's XLA path (RMSNorm fusion, gemm, RoPE and scatter, SwiGLU, residual
add). Each timing is one jitted call that applies the op to `--layers` distinct weight
copies in sequence (together larger than L2, as in a real step) and is divided by that count:
per-layer microseconds including launch gaps. % of copy BW = weight bytes / time over the
device copy bandwidth measured in the same run.

Writes tune_decode_gemv.json and .md under --out, and per model the best tiles as a
`LayerBlocks.parse` spec (best_<model>.txt), which `decode_variants.py --gemv-blocks` and
`bench_decode.py --gemv-blocks` take.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from scaling import layers  # noqa: E402
from scaling.kernels import decode_gemv as g  # noqa: E402


def timed(fn, *args, reps: int = 10) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make_cases(cfg, batch: int, n_layers: int, s: int, key):
    """Inputs and weights per kernel: {name: (weights tuple, inputs dict, weight bytes/layer)}."""
    d, n, kv, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim
    bf = jnp.bfloat16
    counter = iter(range(1 << 20))

    def rnd(shape, scale=1.0):
        k = jax.random.fold_in(key, next(counter))
        return (jax.random.normal(k, shape, jnp.float32) * scale).astype(bf)

    x = rnd((batch, d))
    return {
        "qkv": dict(w=tuple(rnd(((n + 2 * kv) * h, d), d ** -0.5) for _ in range(n_layers)),
                    x=x, pos=jnp.arange(batch, dtype=jnp.int32) + 100,
                    cache=(rnd((batch, s, kv, h)), rnd((batch, s, kv, h)))),
        "out": dict(w=tuple(rnd((d, n * h), (n * h) ** -0.5) for _ in range(n_layers)), a=rnd((batch, n * h)), x=x),
        "gate_up": dict(w=tuple(rnd((2 * f, d), d ** -0.5) for _ in range(n_layers)), x=x),
        "down": dict(w=tuple(rnd((d, f), f ** -0.5) for _ in range(n_layers)), a=rnd((batch, f)), x=x),
    }


def pallas_fn(op: str, cfg, blocks: g.GemvBlocks):
    inv_freq = layers.rope_frequencies(cfg)
    eps = cfg.norm_eps
    if op == "qkv":
        @jax.jit
        def f(ws, x, pos, cache):
            kc, vc = cache
            qs = []
            for w in ws:
                q, kc, vc = g.qkv_rope(x, w, inv_freq, pos, kc, vc, num_heads=cfg.num_heads, eps=eps, blocks=blocks)
                qs.append(q)
            return qs, kc, vc
        return lambda c: f(c["w"], c["x"], c["pos"], c["cache"])
    if op in ("out", "down"):
        @jax.jit
        def f(ws, a, x):
            for w in ws:
                x = g.matmul_residual(a, w, x, blocks=blocks)
            return x
        return lambda c: f(c["w"], c["a"], c["x"])

    @jax.jit
    def f(ws, x):
        return [g.gate_up_swiglu(x, w, eps=eps, blocks=blocks) for w in ws]
    return lambda c: f(c["w"], c["x"])


def xla_fn(op: str, cfg):
    """The decoder's XLA path for the same work (scaling.decode, rows=False layout)."""
    from scaling import decode

    inv_freq = layers.rope_frequencies(cfg)
    eps = cfg.norm_eps
    n, kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    ones = jnp.ones((cfg.hidden_size,), jnp.float32)
    if op == "qkv":
        @jax.jit
        def f(ws, x, pos, cache):
            kc, vc = cache
            rows = jnp.arange(x.shape[0])
            qs = []
            for w in ws:
                y = jnp.einsum("bd,dx->bx", decode._rms_norm(x, ones, eps), w)
                q = y[:, : n * h].reshape(-1, 1, n, h)
                k = y[:, n * h:(n + kv) * h].reshape(-1, 1, kv, h)
                v = y[:, (n + kv) * h:].reshape(-1, kv, h)
                q = layers.apply_rope(q, pos[:, None], inv_freq)
                k = layers.apply_rope(k, pos[:, None], inv_freq)
                kc = kc.at[rows, pos].set(k[:, 0])
                vc = vc.at[rows, pos].set(v)
                qs.append(q)
            return qs, kc, vc
        return lambda c: f(_cols(c), c["x"], c["pos"], c["cache"])
    if op in ("out", "down"):
        @jax.jit
        def f(ws, a, x):
            for w in ws:
                x = x + jnp.einsum("bk,kd->bd", a, w)
            return x
        return lambda c: f(_cols(c), c["a"], c["x"])

    @jax.jit
    def f(ws, x):
        outs = []
        for w in ws:
            gu = jnp.einsum("bd,dx->bx", decode._rms_norm(x, ones, eps), w)
            gate, up = jnp.split(gu, 2, axis=-1)
            outs.append(jax.nn.silu(gate) * up)
        return outs
    return lambda c: f(_cols(c), c["x"])


def _cols(case) -> tuple:
    """The XLA path's [in, out] layout of the case's weights, made once (not timed)."""
    if "w_cols" not in case:
        case["w_cols"] = tuple(jax.block_until_ready(jnp.asarray(w.T, copy=True)) for w in case["w"])
    return case["w_cols"]


def sweep(op: str, cfg) -> list[g.GemvBlocks]:
    """Candidate tiles, a few likely ones first, then the rest in a fixed shuffled order (the
    per-kernel time budget cuts the tail)."""
    import random

    h = cfg.resolved_head_dim
    parts_ok = [p for p in (1, 2, 4) if h % (2 * p) == 0 and h // 2 // p >= 16]
    grid = []
    for bk, stages, warps, prefetch in itertools.product((128, 256, 512), (1, 2, 3, 4), (4, 8), (0, 1)):
        if prefetch and stages > 2:
            continue
        for x in (parts_ok if op == "qkv" else (16, 32, 64)):
            bn, parts = (16, x) if op == "qkv" else (x, 1)
            tile = bk * (2 * (h // 2 // parts) if op == "qkv" else (2 * bn if op == "gate_up" else bn)) * 2
            if stages * (tile + 16 * bk * 2) > 160 * 1024:  # shared memory of the pipeline
                continue
            grid.append(g.GemvBlocks(block_k=bk, block_n=bn, rope_parts=parts, num_warps=warps, num_stages=stages,
                                     prefetch=prefetch))
    first = [b for b in grid if (b.block_k, b.num_stages, b.prefetch) in ((512, 3, 0), (256, 1, 1), (512, 1, 1), (256, 4, 0))]
    rest = [b for b in grid if b not in first]
    random.Random(0).shuffle(rest)
    return first + rest


def spec(blocks: g.GemvBlocks) -> str:
    return (f"{blocks.block_k}/{blocks.block_n}/{blocks.rope_parts}/{blocks.num_warps}/{blocks.num_stages}/"
            f"{blocks.prefetch}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b,llama2_7b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8, help="distinct weight copies per timed call (together > L2)")
    ap.add_argument("--budget-s", type=float, default=240, help="stop sweeping after this long (best so far kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import bench_decode

    out_dir = Path(args.out or ROOT / "runs" / "tune_decode_gemv")
    out_dir.mkdir(parents=True, exist_ok=True)
    bw = max(bench_decode.measure_bandwidth(1 << 30).values())
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({jax.devices()[0].device_kind})", flush=True)
    per_op_s = args.budget_s / (4 * len(args.models.split(",")))  # each kernel of each model gets its share
    results: dict = {"bandwidth": bw, "device": jax.devices()[0].device_kind, "models": {}}
    lines = ["| model | kernel | MB/layer | XLA us | XLA % BW | best Pallas us | % BW | vs XLA | tiles (k/n/parts/warps/stages/prefetch) | configs tried |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        cfg = bench_decode.preset(name)
        cases = make_cases(cfg, args.batch, args.layers, 384, jax.random.key(0))
        best_spec = []
        res = results["models"][name] = {}
        for op, case in cases.items():
            nbytes = case["w"][0].nbytes
            t_xla = timed(xla_fn(op, cfg), case) / args.layers
            rows = []
            deadline = time.perf_counter() + per_op_s
            for blocks in sweep(op, cfg):
                if time.perf_counter() > deadline:
                    break
                try:
                    t = timed(pallas_fn(op, cfg, blocks), case) / args.layers
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped, reported
                    rows.append({"blocks": spec(blocks), "error": str(e)[:200]})
                    continue
                rows.append({"blocks": spec(blocks), "us": t * 1e6, "bw_frac": nbytes / t / bw})
            ok = [r for r in rows if "us" in r]
            best = min(ok, key=lambda r: r["us"]) if ok else None
            res[op] = {"bytes": nbytes, "xla_us": t_xla * 1e6, "xla_bw_frac": nbytes / t_xla / bw, "sweep": rows,
                       "best": best}
            if best:
                best_spec.append(f"{op}={best['blocks']}")
                lines.append(f"| {name} | {op} | {nbytes / 1e6:.1f} | {t_xla * 1e6:.1f} | {100 * nbytes / t_xla / bw:.0f}% | "
                             f"{best['us']:.1f} | {100 * best['bw_frac']:.0f}% | {t_xla * 1e6 / best['us']:.2f}x | "
                             f"{best['blocks']} | {len(ok)} |")
            else:
                lines.append(f"| {name} | {op} | {nbytes / 1e6:.1f} | {t_xla * 1e6:.1f} | | none compiled | | | | {len(rows)} |")
            print(lines[-1], flush=True)
        (out_dir / f"best_{name}.txt").write_text(",".join(best_spec))
        print(f"best {name}: {','.join(best_spec)}", flush=True)
    table = "\n".join(lines)
    print(table)
    (out_dir / "tune_decode_gemv.md").write_text(table + "\n")
    (out_dir / "tune_decode_gemv.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
