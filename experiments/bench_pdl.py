"""Does programmatic dependent launch (PDL) shorten a chain of Mosaic GPU decode kernels?

    PYTHONPATH=.:experiments python3 experiments/bench_pdl.py [--shapes 2048,8192;4096,11008] [--reps 20]

The question behind it (docs/decoding.md, "Where the 1b's H200 step goes now"): at batch 1 each
of a layer's kernels pays a start and a tail on top of its bytes, and a grid barrier inside one
kernel turned out no cheaper than a kernel boundary. PDL is the other way to overlap a kernel's
tail with the next one's start: the next kernel is launched early, loads what does not depend on
its predecessor (the weights), and waits at `griddepcontrol.wait` only before reading the
activations. Mosaic GPU kernels can do this in jax 0.11.2 (`plgpu.griddepcontrol_wait`; the
kernel is marked `mosaic_gpu.uses_pdl`); whether XLA's runtime then really launches them early,
also inside its command buffers, is what this measures.

The chain: `layers` calls of decode_tma.gate_up_swiglu_tma as the decoder runs it (the norm
statistic taken in the kernel), each on its own weight [2F, D] (F = D so each output feeds the
next; bf16, batch 1 padded to 8 rows), inside one jitted loop, with
pdl=False and pdl=True, timed interleaved (bench_attention.time_interleaved). Each XLA setting
runs in its own process (`XLA_FLAGS` is read at start): as is, and with
`--xla_gpu_enable_pdl=true`. Reported: µs per kernel, its share of the copy bandwidth measured in
the same process, and pdl=False / pdl=True. The two outputs are checked equal bit for bit (the
same arithmetic; only the launch differs) and the first layer against XLA before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPS = 1e-5  # the RMSNorm epsilon of the chain's in-kernel statistic
# no_cmdbuf: XLA launches every kernel on the stream itself instead of replaying a CUDA graph
# (the Mosaic runtime then launches with the PDL attribute through cuLaunchKernelEx)
XLA_SETTINGS = {"default": "", "xla_pdl": "--xla_gpu_enable_pdl=true", "no_cmdbuf": "--xla_gpu_enable_command_buffer="}


def chain_fn(layers_per_pass: int, passes: int, pdl: bool):
    """x8 -> `passes` times through the layers; each layer h = gate_up(x, r, W_l), F = D."""
    import jax
    from jax import lax

    from scaling.kernels import decode_tma

    @jax.jit
    def run(x8, ws):
        def one_pass(_, x):
            for w in ws[:layers_per_pass]:  # the decoder's form: the norm statistic taken in the kernel
                x = decode_tma.gate_up_swiglu_tma(x, None, w, pdl=pdl, norm_eps=EPS)
            return x

        return lax.fori_loop(0, passes, one_pass, x8)

    return run


def reference_chain(x8, ws):
    """The same chain in XLA (f32 products, bf16 between layers, as the kernel rounds)."""
    import jax.numpy as jnp
    from jax import lax

    for w in ws:
        f = w.shape[0] // 2
        x = x8.astype(jnp.float32)
        r = lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + EPS)
        acc = jnp.einsum("bk,nk->bn", x, w.astype(jnp.float32)) * r
        g, u = acc[:, :f], acc[:, f:]
        x8 = (g / (1.0 + jnp.exp(-g)) * u).astype(x8.dtype)
    return x8


def measure(d: int, layers: int, passes: int, reps: int, warmup: int = 2) -> dict:
    """One shape in this process: both pdl settings, checked, then timed interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_attention import ratio_stats, time_interleaved

    keys = jax.random.split(jax.random.key(0), layers + 1)
    # the norm keeps the activations at scale 1 into every layer; rows 1-7 are the zero padding
    ws = [(jax.random.normal(k, (2 * d, d), jnp.float32) / d**0.5).astype(jnp.bfloat16) for k in keys[1:]]
    x8 = jnp.zeros((8, d), jnp.bfloat16).at[0].set(jax.random.normal(keys[0], (d,), jnp.bfloat16))
    fns = {pdl: chain_fn(layers, passes, pdl) for pdl in (False, True)}
    outs = {pdl: np.asarray(fn(x8, ws), np.float32) for pdl, fn in fns.items()}
    row = dict(D=d, F=d, layers=layers, passes=passes, MB_per_kernel=2 * d * d * 2 / 1e6)
    row["pdl_equals_no_pdl"] = bool(np.array_equal(outs[False], outs[True]))
    # The reference over the first layer: the chain is chaotic (one bf16 ulp on one input element
    # moves the 16-layer D=2048 output by 54% in XLA alone), so a longer comparison says nothing.
    one = np.asarray(chain_fn(1, 1, False)(x8, ws[:1]), np.float32)[0]
    want = np.asarray(reference_chain(x8, ws[:1]), np.float32)[0]
    row["rel_err_vs_xla_first_layer"] = float(np.linalg.norm(one - want) / max(np.linalg.norm(want), 1e-30))
    times = time_interleaved({pdl: (lambda fn=fn: fn(x8, ws)) for pdl, fn in fns.items()}, warmup=warmup, reps=reps)
    kernels = layers * passes
    for pdl in (False, True):
        us = float(np.median(times[pdl])) / kernels * 1e6
        row[f"us_per_kernel_pdl_{pdl}"] = us
    row["no_pdl_over_pdl"], row["q1"], row["q3"] = ratio_stats(times[False], times[True])
    return row


def child(args) -> None:
    import jax

    from bench_attention import header
    from bench_decode import measure_bandwidth

    bw = max(measure_bandwidth(1 << 30).values())
    print(header(), f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for spec in args.shapes.split(";"):
        d, layers = map(int, spec.split(","))
        row = measure(d, layers, args.passes, args.reps)
        row["setting"], row["copy_TBps"], row["device"] = args.setting, bw / 1e12, jax.devices()[0].device_kind
        for pdl in (False, True):
            row[f"pct_bw_pdl_{pdl}"] = 100 * row["MB_per_kernel"] * 1e6 / (row[f"us_per_kernel_pdl_{pdl}"] * 1e-6) / bw
        print("row", json.dumps(row), flush=True)


def table(rows: list[dict]) -> str:
    lines = ["| XLA flags | D = F | MB per kernel | µs per kernel, pdl off | pdl on | off / on (quartiles) | "
             "% of copy BW off / on | pdl output == no-pdl output |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['D']} | {r['MB_per_kernel']:.1f} | {r['us_per_kernel_pdl_False']:.2f} | "
            f"{r['us_per_kernel_pdl_True']:.2f} | {r['no_pdl_over_pdl']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) | "
            f"{r['pct_bw_pdl_False']:.0f}% / {r['pct_bw_pdl_True']:.0f}% | {r['pdl_equals_no_pdl']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2048,16;4096,8", help="'D,layers;...' (F = D; the 1b's and 7b's hidden)")
    p.add_argument("--passes", type=int, default=20, help="passes over the layers per timed call")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--settings", default=",".join(XLA_SETTINGS), help=f"of {list(XLA_SETTINGS)}")
    p.add_argument("--out", default=None, help="write the rows as JSON and the table as markdown here (a prefix)")
    p.add_argument("--setting", default=None, help=argparse.SUPPRESS)  # set in the child processes
    args = p.parse_args(argv)
    if args.setting is not None:
        return child(args)
    rows = []
    for setting in args.settings.split(","):
        if setting not in XLA_SETTINGS:
            raise SystemExit(f"--settings: unknown {setting!r}; allowed {list(XLA_SETTINGS)}")
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(x for x in (env.get("XLA_FLAGS", ""), XLA_SETTINGS[setting]) if x)
        cmd = [sys.executable, __file__, "--setting", setting, "--shapes", args.shapes, "--passes", str(args.passes),
               "--reps", str(args.reps)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        print(proc.stdout, proc.stderr[-3000:] if proc.returncode else "", flush=True)
        rows += [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("row ")]
    md = table(rows)
    print(md)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(rows, indent=1))
        Path(f"{args.out}.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
