"""Achieved bandwidth of the collectives the accounting prices, over every visible device.

    PYTHONPATH=. python3 experiments/bench_collectives.py                 # GPUs
    PYTHONPATH=. XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python3 experiments/bench_collectives.py --sizes-mib 1 --iters 2   # CPU smoke run

For each array size (bf16, the bytes per device `accounting.Collective.bytes` counts: the
gathered array, the array before a reduce-scatter, the all-reduced array) it times an
all-gather, a reduce-scatter and an all-reduce under `jax.shard_map`, and reports the per-device
bandwidth W the accounting's ring formula would need to give that time
(`accounting.collective_seconds`: (n-1)/n of the array per device, twice for an all-reduce),
beside the hardware table's `ring_bandwidth`. Each time is one of --iters calls queued back to
back (the host's dispatch hidden behind the device's work), the median of 5 such batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="16,128,1024", help="comma list of array sizes in MiB (bf16)")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    if any(s <= 0 for s in sizes) or args.iters < 1:
        p.error("--sizes-mib must be positive and --iters >= 1")

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
    print("| collective | array MiB | ms | W (GB/s) the ring formula needs | W / table |\n|---|---:|---:|---:|---:|")

    ops = {
        # (per-device input rows, body, bytes per device the accounting counts)
        "all-gather": (lambda rows: rows // n, lambda x: jax.lax.all_gather(x, "x", tiled=True)),
        "reduce-scatter": (lambda rows: rows, lambda x: jax.lax.psum_scatter(x, "x", tiled=True)),
        "all-reduce": (lambda rows: rows, lambda x: jax.lax.psum(x, "x")),
    }
    for mib in sizes:
        cols = 4096
        rows = max(n, int(mib * 2**20 / 2 / cols) // n * n)
        nbytes = rows * cols * 2
        for kind, (local_rows, body) in ops.items():
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
            w = acc.collective_seconds(kind, nbytes, n, 1.0) / t  # bytes/s at which the formula gives t
            ratio = f"{w / hw.ring_bandwidth:.2f}" if hw else "n/a"
            print(f"| {kind} | {nbytes / 2**20:,.0f} | {t * 1e3:.4g} | {w / 1e9:.4g} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
