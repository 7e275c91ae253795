"""What does one round of a group's partial exchange cost: through global memory behind a
semaphore (as the megakernel's grouped plan does it), behind a grid barrier, or through
distributed shared memory behind a cluster barrier?

The megakernel's long-cache plan splits each KV head's positions over a group of CTAs, which then
exchange their partials: each writes its partial to global memory, signals its group's
semaphore (a release at gpu scope), waits for the others, and copies the group's partials back.
That round costs ~2.3 us per layer on the H200 (docs/decoding.md, twenty-seventh session). On
Hopper, CTAs of one cluster (up to 8, portably) can read each other's shared memory instead, and
wait for each other on a cluster barrier. This measures one round each way, on an otherwise idle
GPU (a lower bound for the kernel, whose exchange runs while the memory system is full):

  grid     every CTA writes its partial (TMA), signals one semaphore, waits for all CTAs' signals,
           then copies its cluster's 8 partials back (one TMA copy);
  group    the same with one semaphore per cluster of 8 (the grouped plan's exchange);
  cluster  every CTA stores its partial into its own shared memory, fences at cluster scope,
           arrives on the cluster barrier, waits, and reads its 7 peers' partials (and its own)
           through `plgpu.cluster_ref`;
  tagged   every thread stores its words of the partial straight from registers, each word's
           lowest bit set to the round's parity, and polls its words of the cluster's 8 partials
           with volatile loads until all show it (experiments/tagged_exchange.py): no fence,
           no semaphore, no copy (twenty-eighth session).

Measured on an H200 (docs/benchmarks.md, twenty-seventh session): with one CTA per SM, the 16
clusters of 8 are not all resident at once, so `grid` never finishes there (it runs with
`--pad-kib 16`, where several CTAs share an SM); it is left out of the default modes. `tagged`
is no faster than `group` (twenty-eighth session: 2.9 against 2.4 µs a round at 160 KiB, 1.56
against 1.63 at 16 KiB).

Each kernel runs `rounds` rounds (two buffers, alternating) on 16 clusters of 8 CTAs (128, one
per SM: every CTA also reserves `--pad-kib` of shared memory, as the megakernel's ring does).
Round i's partial of member m is (i + 1) (m + 1) everywhere, so every CTA's sum over rounds is
known exactly: the check catches a partial read before it was written. Time per round: the
difference between two round counts over their difference.

    PYTHONPATH=.:experiments python3 experiments/bench_group_exchange.py [--rounds 200,800]

GPU only (global semaphores and clusters have no interpret mode); tests lower it for Hopper on
the CPU. Prints and writes $OUT/bench_group_exchange.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tagged_exchange import tagged_load, tagged_store

MODES = ("grid", "group", "cluster", "tagged")
MEMBERS = 8  # CTAs per cluster (Hopper's portable maximum)


def expected_sum(rounds: int, members: int = MEMBERS) -> float:
    """Every element of a CTA's sum over rounds: sum_i sum_m (i + 1)(m + 1)."""
    return rounds * (rounds + 1) / 2 * members * (members + 1) / 2


def exchange(mode: str, rounds: int, *, clusters: int = 16, floats: int = 512, pad_kib: int = 160):
    """The kernel of one mode: returns f(dummy) -> [clusters * MEMBERS, floats / 256, 256] f32, each
    CTA's sum over rounds of its cluster's partials."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ctas = clusters * MEMBERS
    if rounds % 2:
        raise ValueError(f"rounds must be even (two buffers, alternating), got {rounds}")
    if floats % 256:
        raise ValueError(f"floats must be a multiple of 256 (a TMA box's longest side), got {floats}")
    rows = floats // 256  # (a partial as rows of 256 f32: TMA boxes take at most 256 per dimension)
    L = plgpu.Layout.WG_STRIDED((256,), vec_size=2)
    Lt = plgpu.Layout.WG_STRIDED((rows, 256), vec_size=4)  # (tagged: a partial as one array)

    def _fence(ctx):  # (every thread's stores, then a fence at cluster scope)
        mgpu.utils.warpgroup_barrier()
        mgpu.utils.inline_ptx("fence.acq_rel.cluster;", result_types=[], has_side_effects=True)

    # (the barrier's remote arrive is a release at CTA scope only: the stores are ordered first)
    cluster_fence = plgpu.inline_mgpu()(_fence)

    def body(dummy_ref, out_ref, xchg_ref, own, gather, pad, bars, cbar, *mine):  # mine: (cluster) [2 rows] of [256]
        g, x = lax.axis_index("g"), lax.axis_index("x")
        me = g * MEMBERS + x
        done = None if mode == "cluster" else pl.get_global(plgpu.SemaphoreType.REGULAR((clusters,)))
        ones = plgpu.layout_cast(jnp.ones((256,), jnp.float32), L)
        if mode == "tagged":  # zeros into both of its slots, seen by the cluster before round 0
            ones_t = plgpu.layout_cast(jnp.ones((rows, 256), jnp.float32), Lt)
            for par in range(2):
                tagged_store(xchg_ref.at[g, par, x], ones_t * 0.0, 0, Lt)
            plgpu.semaphore_signal(done.at[g], 1, memory_scope="gpu")
            plgpu.semaphore_wait(done.at[g], MEMBERS, decrement=False, memory_scope="gpu")

        def one_round(i, acc, par):  # (par static: a peer's buffer at a static offset)
            if mode == "tagged":  # (a buffer's rounds alternate parity: 1, 0, 1, ...; zeros are "round -1")
                parity = lax.rem(i // 2 + 1, 2)
                v = ones_t * ((i + 1) * (x + 1)).astype(jnp.float32)
                tagged_store(xchg_ref.at[g, par, x], v, parity, Lt)
                parts = tagged_load(xchg_ref.at[g, par], parity, Lt, (rows, 256), MEMBERS)
                return (acc[0] + functools.reduce(operator.add, parts),)
            v = ones * ((i + 1) * (x + 1)).astype(jnp.float32)
            acc = list(acc)
            if mode == "cluster":
                for r in range(rows):
                    mine[par * rows + r][...] = v
                cluster_fence()
                plgpu.barrier_arrive(cbar)
                plgpu.barrier_wait(cbar)
                for k in range(MEMBERS):
                    for r in range(rows):
                        acc[r] = acc[r] + plgpu.load(plgpu.cluster_ref(mine[par * rows + r], {"x": k}), layout=L)
                return tuple(acc)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (the previous round's copy has read `own`)
            for r in range(rows):
                own.at[0, r][...] = v
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(own.at[0], xchg_ref.at[g, par, x])
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)
            sem = done.at[0] if mode == "grid" else done.at[g]
            plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
            plgpu.semaphore_wait(sem, (ctas if mode == "grid" else MEMBERS) * (i + 1), decrement=False,
                                 memory_scope="gpu")
            plgpu.copy_gmem_to_smem(xchg_ref.at[g, par], gather, bars.at[0])
            plgpu.barrier_wait(bars.at[0])
            for k in range(MEMBERS):
                for r in range(rows):
                    acc[r] = acc[r] + plgpu.load(gather.at[k, r], layout=L)
            plgpu.commit_smem()  # (every thread has read `gather` before the next copy lands)
            return tuple(acc)

        acc0 = (ones_t * 0.0,) if mode == "tagged" else tuple(ones * 0.0 for _ in range(rows))
        acc = lax.fori_loop(0, rounds // 2, lambda j, acc: one_round(2 * j + 1, one_round(2 * j, acc, 0), 1), acc0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if mode == "tagged":
            own.at[0][...] = acc[0]
        for r in range(rows if mode != "tagged" else 0):
            own.at[0, r][...] = acc[r]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(own.at[0], out_ref.at[me])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((2, rows, 256), jnp.float32), plgpu.SMEM((MEMBERS, rows, 256), jnp.float32),
               plgpu.SMEM((pad_kib * 256,), jnp.float32), plgpu.Barrier(num_barriers=1),
               plgpu.ClusterBarrier(collective_axes=("x",))]
    # (separate 1-D buffers: a peer's view of a slice of a larger one does not lower)
    scratch += [plgpu.SMEM((256,), jnp.float32) for _ in range(2 * rows if mode == "cluster" else 0)]
    kernel = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((ctas, rows, 256), jnp.float32),
                        jax.ShapeDtypeStruct((clusters, 2, MEMBERS, rows, 256), jnp.float32)),
        scratch_types=scratch, grid=(clusters,), grid_names=("g",), cluster=(MEMBERS,), cluster_names=("x",))
    return jax.jit(lambda dummy: kernel(dummy)[0])


def time_mode(mode: str, rounds: int, reps: int, **kw) -> tuple[float, bool]:
    """Median seconds per call, and whether every CTA's sum is exact."""
    fn = exchange(mode, rounds, **kw)
    dummy = jnp.zeros((8,), jnp.float32)
    out = fn(dummy).block_until_ready()
    exact = bool(jnp.all(out == expected_sum(rounds)))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(dummy).block_until_ready()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2], exact


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", default="200,800", help="two round counts (time per round: their difference)")
    ap.add_argument("--modes", default="group,tagged,cluster", help=f"of {MODES} (grid: hangs where the clusters are not "
                    "all resident at once, as with one CTA per SM on the H200)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--floats", type=int, default=512, help="a partial's f32 values (the 1b's: 512 + 16)")
    ap.add_argument("--pad-kib", type=int, default=160, help="shared memory every CTA reserves besides")
    args = ap.parse_args(argv)
    r1, r2 = (int(r) for r in args.rounds.split(","))
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(args), "modes": {}}
    print(result["device"], jax.__version__, flush=True)
    if unknown := set(args.modes.split(",")) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; allowed {list(MODES)}")
    for mode in args.modes.split(","):
        try:
            t1, ok1 = time_mode(mode, r1, args.reps, floats=args.floats, pad_kib=args.pad_kib)
            t2, ok2 = time_mode(mode, r2, args.reps, floats=args.floats, pad_kib=args.pad_kib)
            row = {"us_per_round": (t2 - t1) / (r2 - r1) * 1e6, "exact": ok1 and ok2, "s": [t1, t2]}
        except Exception as e:  # noqa: BLE001  (a failure is recorded, and the next mode runs)
            row = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        result["modes"][mode] = row
        print(mode, row, flush=True)
    if out := os.environ.get("OUT"):
        Path(out, "bench_group_exchange.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
