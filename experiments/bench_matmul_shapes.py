"""bf16 matmul rate at each preset's own shapes, beside the square 8192^3 the hardware table uses.

    PYTHONPATH=. python3 experiments/bench_matmul_shapes.py                      # GPU
    PYTHONPATH=. JAX_PLATFORMS=cpu python3 experiments/bench_matmul_shapes.py \\
        --models tiny --tokens 256 --square 256 --reps 2                         # CPU smoke run

For each preset (configs/models/) at --tokens tokens (batch x sequence) it times, forward and
backward (x @ W, dx, dW) in one compiled program:
  - layer: the seven projections of a layer (q, k, v, o, gate, up, down), the matmuls that
    `accounting.training_time` divides by the matmul rate;
  - head: the output projection [tokens, D] x [D, V] (bf16 in and out, as the chunked loss runs it);
  - f32 head backward: the one-pass loss's dx = dlogits W^T and dW = x^T dlogits, whose f32 logit
    gradients promote the bf16 side to f32 (TF32 tensor cores, XLA's default precision on the GPU):
    the matmuls `accounting.training_time` divides by the f32 rate (`hardware.f32_matmul_fraction`).
Each rate is FLOPs / the median of 5 batches of --reps calls queued back to back. The question
it answers: does one rate (`hardware.matmul_fraction`, from the square) price every model's
matmuls, or do small models' thin matmuls run slower (docs/benchmarks.md)?
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def seconds_per_call(fn, reps: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile + warm
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(reps)])
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def fwd_bwd_rate(shapes: list[tuple[int, int]], tokens: int, reps: int) -> float:
    """FLOP/s of x @ W forward and its two backward matmuls over `shapes` (in, out), bf16."""
    import jax
    import jax.numpy as jnp

    key = iter(jax.random.split(jax.random.key(0), 3 * len(shapes)))
    xs = [jax.random.normal(next(key), (tokens, i), jnp.bfloat16) for i, _ in shapes]
    ws = [jax.random.normal(next(key), s, jnp.bfloat16) * 0.02 for s in shapes]
    cts = [jax.random.normal(next(key), (tokens, o), jnp.bfloat16) for _, o in shapes]

    def one(x, w, ct):
        y, vjp = jax.vjp(lambda x, w: x @ w, x, w)
        return y, vjp(ct)  # y is returned, or XLA drops the forward matmul

    run = jax.jit(lambda xs, ws, cts: [one(x, w, ct) for x, w, ct in zip(xs, ws, cts)])
    return sum(6 * tokens * i * o for i, o in shapes) / seconds_per_call(lambda: run(xs, ws, cts), reps)


def head_f32_backward_rate(hidden: int, vocab: int, tokens: int, reps: int) -> float:
    """FLOP/s of the one-pass loss's output-head backward: f32 [tokens, V] logit gradients times
    the bf16 weight [D, V] and the bf16 input [tokens, D], promoted to f32 (4 tokens D V FLOPs)."""
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    dlogits = jax.random.normal(k1, (tokens, vocab), jnp.float32)
    w = jax.random.normal(k2, (hidden, vocab), jnp.bfloat16) * 0.02
    x = jax.random.normal(k3, (tokens, hidden), jnp.bfloat16)
    run = jax.jit(lambda g, w, x: (jnp.einsum("tv,dv->td", g, w), jnp.einsum("td,tv->dv", x, g)))
    return 4 * tokens * hidden * vocab / seconds_per_call(lambda: run(dlogits, w, x), reps)


def square_rate(n: int, reps: int) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 / seconds_per_call(lambda: mm(a, b), reps)


def layer_shapes(m) -> list[tuple[int, int]]:
    d, h = m.hidden_size, m.resolved_head_dim
    return [(d, m.num_heads * h), (d, m.num_kv_heads * h), (d, m.num_kv_heads * h), (m.num_heads * h, d),
            (d, m.mlp_dim), (d, m.mlp_dim), (m.mlp_dim, d)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="25m,125m,350m,1b,llama3.2_1b,llama2_7b,llama3_8b")
    p.add_argument("--tokens", type=int, default=16384, help="rows of every matmul (batch x sequence)")
    p.add_argument("--square", type=int, default=8192, help="n of the n^3 reference matmul")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    models = [s.strip() for s in args.models.split(",") if s.strip()]
    known = sorted(f.stem for f in (ROOT / "configs" / "models").glob("*.yaml"))
    unknown = [m for m in models if m not in known]
    if not models or unknown:
        p.error(f"--models: unknown {unknown or args.models!r}; presets: {', '.join(known)}")
    if args.tokens < 1 or args.square < 1 or args.reps < 1:
        p.error("--tokens, --square and --reps must be >= 1")

    import jax

    from scaling.config import load_config
    from scaling.hardware import detect

    hw = detect()
    peak = hw.bf16_flops if hw else None
    square = square_rate(args.square, args.reps)
    frac = (lambda r: f"{r / peak:.3f}") if peak else (lambda r: "n/a")  # noqa: E731
    print(f"# bf16 matmul rates, {jax.devices()[0].device_kind}, jax {jax.__version__}, {args.tokens} tokens\n")
    print(f"square {args.square}^3: {square / 1e12:,.1f} TFLOP/s ({frac(square)} of the datasheet)\n")
    print("| model | D | F | layer TFLOP/s | / square | head TFLOP/s | / square | layer of datasheet | f32 head bwd TFLOP/s |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in models:
        m = load_config(ROOT / "configs" / "models" / f"{name}.yaml").model
        layer = fwd_bwd_rate(layer_shapes(m), args.tokens, args.reps)
        head = fwd_bwd_rate([(m.hidden_size, m.vocab_size)], args.tokens, args.reps)
        head_f32 = head_f32_backward_rate(m.hidden_size, m.vocab_size, args.tokens, args.reps)
        rows.append({"model": name, "hidden": m.hidden_size, "mlp": m.mlp_dim, "layer": layer, "head": head,
                     "head_f32_bwd": head_f32})
        print(f"| {name} | {m.hidden_size} | {m.mlp_dim} | {layer / 1e12:,.1f} | {layer / square:.3f} | "
              f"{head / 1e12:,.1f} | {head / square:.3f} | {frac(layer)} | {head_f32 / 1e12:,.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                               "tokens": args.tokens, "square": square, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
