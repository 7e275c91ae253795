"""Achieved bandwidth of the collectives the accounting prices, over every visible device.

    PYTHONPATH=. python3 experiments/bench_collectives.py                 # GPUs
    PYTHONPATH=. XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python3 experiments/bench_collectives.py --sizes-mib 1 --iters 2   # CPU smoke run

For each array size (bf16, the bytes per device `accounting.Collective.bytes` counts: the
gathered array, the array before a reduce-scatter, the all-reduced array) it times an
all-gather, a reduce-scatter and an all-reduce under `jax.shard_map`, and reports the per-device
bandwidth W the accounting's ring formula would need to give that time
(`accounting.collective_seconds`: (n-1)/n of the array per device, twice for an all-reduce),
beside the hardware table's `ring_bandwidth`. Two times per row:
  - wall: one of --iters calls queued back to back, the median of 5 such batches. Below ~64 MiB
    this is the host's multi-device dispatch (~0.13 ms a call on 2 H200s, whatever the kind),
    not the collective;
  - kernel: the mean duration of the collective's kernels in a profiler trace of one more batch
    (`scaling.profile_summary`), what a collective costs inside a compiled step, where no host
    dispatch sits between ops. "W" is solved from this one where there is a trace (GPUs).
--json writes the rows for fitting a latency + bandwidth model (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="16,128,1024", help="comma list of array sizes in MiB (bf16)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--kinds", default="all-gather,reduce-scatter,all-reduce,all-to-all",
                   help="comma list of: all-gather, reduce-scatter, all-reduce, all-to-all")
    p.add_argument("--no-trace", action="store_true", help="wall times only (no profiler trace)")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    if any(s <= 0 for s in sizes) or args.iters < 1:
        p.error("--sizes-mib must be positive and --iters >= 1")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    allowed = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
    if not kinds or any(k not in allowed for k in kinds):
        p.error(f"--kinds: {args.kinds!r}; allowed: {', '.join(allowed)}")

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from scaling import accounting as acc
    from scaling.hardware import detect

    n = jax.device_count()
    if n < 2:
        print(f"error: needs 2 or more devices, found {n}", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((n,), ("x",))
    hw = detect()
    table = f"{hw.ring_bandwidth / 1e9:,.0f} GB/s ({hw.name})" if hw else "n/a"
    print(f"# collectives over {n} x {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"hardware table ring_bandwidth: {table}\n")
    print("| collective | array MiB | wall ms | kernel ms | W (GB/s) the ring formula needs | W / table |\n"
          "|---|---:|---:|---:|---:|---:|")

    ops = {
        # (per-device input rows, body, bytes per device the accounting counts)
        "all-gather": (lambda rows: rows // n, lambda x: jax.lax.all_gather(x, "x", tiled=True)),
        "reduce-scatter": (lambda rows: rows, lambda x: jax.lax.psum_scatter(x, "x", tiled=True)),
        "all-reduce": (lambda rows: rows, lambda x: jax.lax.psum(x, "x")),
        "all-to-all": (lambda rows: rows, lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True)),
    }
    records = []
    for mib in sizes:
        cols = 4096
        rows = max(n * n, int(mib * 2**20 / 2 / cols) // (n * n) * n * n)
        nbytes = rows * cols * 2
        for kind in kinds:
            local_rows, body = ops[kind]
            x = jax.device_put(jnp.ones((local_rows(rows) * n, cols), jnp.bfloat16), NamedSharding(mesh, P("x")))
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
            jax.block_until_ready(f(x))  # compile + warm
            times = []
            for _ in range(5):  # --iters calls queued back to back, one wait: no host gap between them
                t0 = time.perf_counter()
                outs = [f(x) for _ in range(args.iters)]
                jax.block_until_ready(outs)
                times.append((time.perf_counter() - t0) / args.iters)
                del outs
            t = statistics.median(times)
            k = None if args.no_trace else kernel_seconds(f, x, args.iters, n)
            w = acc.collective_seconds(kind, nbytes, n, 1.0) / (k or t)  # bytes/s at which the formula gives it
            ratio = f"{w / hw.ring_bandwidth:.2f}" if hw else "n/a"
            kms = f"{k * 1e3:.4g}" if k else "-"
            print(f"| {kind} | {nbytes / 2**20:,.4g} | {t * 1e3:.4g} | {kms} | {w / 1e9:.4g} | {ratio} |", flush=True)
            records.append({"kind": kind, "bytes": nbytes, "devices": n, "wall_s": t, "kernel_s": k,
                            "ring_bandwidth": w})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "devices": n, "jax": jax.__version__,
                       "iters": args.iters, "rows": records}, fh, indent=1)
    return 0


def kernel_seconds(f, x, iters: int, n: int) -> float | None:
    """Mean duration of the collective's kernels (NCCL on GPUs) over one traced batch of `iters`
    queued calls, or None where the trace has no device kernels (the CPU: no device process)."""
    import tempfile

    import jax

    from scaling import profile_summary as ps

    with tempfile.TemporaryDirectory() as d:
        jax.block_until_ready(f(x))
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready([f(x) for _ in range(iters)])
        trace, _ = ps.load_trace(d)
    try:
        s = ps.summarize(trace)
    except ps.ProfileError:
        return None
    c = s["categories"][ps.COLLECTIVE]
    if s["mode"] != "device" or not c["count"]:
        return None
    return c["us"] / c["count"] * 1e-6  # per kernel: count is calls x devices


if __name__ == "__main__":
    sys.exit(main())
