"""What does a grid-wide barrier cost inside one Pallas Triton kernel, against a kernel boundary?

    PYTHONPATH=.:experiments python3 experiments/bench_grid_barrier.py [--mb 8,32,128] [--phases 16]

The question behind it (docs/decoding.md, "Where the 1b's H200 step goes"): a batch-1 decode
step is ~6 memory-bound kernels per layer, and each kernel boundary costs a start and a tail.
A persistent kernel per layer would replace the boundaries by grid barriers; that only pays if
a barrier is cheaper than a boundary, and more so if each program can issue the next phase's
first loads before it waits.

Work per phase: stream `mb` MB of bf16 "weights" ([programs * rows, n]; `rows` rows per program
per phase, read as [rows, block] tiles) and write one f32 sum per program: a stand-in for a
weight read with almost no arithmetic. With rows=1 a program has one 4 KB load in flight and the
read is latency-bound (0.7-1.6 TB/s on an H200); more rows put more bytes in flight, as the
decoder's kernels do. Three ways to run `phases` phases, timed in interleaved rounds:
  kernels    one pallas_call per phase, in one jitted program (what the decoder does now);
  barrier    one pallas_call, the phases separated by a grid barrier (an atomic counter in
             global memory that every program increments and then spins on; every program is
             resident at once: one per SM);
  prefetch   the barrier kernel, but each program loads its first tile of the next phase
             before it waits (weights do not depend on the previous phase). Nothing forces the
             compiler to keep that load ahead of the spin loop (a load may move past an
             acquire); the timing says whether it did.
Prints microseconds per phase, and the bandwidth against the read bytes. Each result is checked
against jnp sums. GPU only (the spinning barrier would deadlock Pallas' interpret mode, which
runs programs one at a time); tests/test_gpu_lowering.py lowers the kernels for Hopper.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

SPIN_LIMIT = 1 << 22  # a barrier gives up after this many polls (a bug then shows as a wrong sum, not a hang)


def grid_barrier(count_ref, target, *, interpret: bool = False):
    """Wait until `target` arrivals have been counted: every program calls this once per phase
    with target = programs * (phase + 1) (the counter is never reset within a call). Interpret
    mode (CPU tests, one program) only arrives: its programs run one at a time, and its state
    discharge has no rule for a loop that polls a ref."""
    from jax.experimental.pallas import triton as plgpu

    if not interpret:
        plgpu.debug_barrier()  # every thread's stores of this phase are issued
    plgpu.atomic_add(count_ref, jnp.int32(0), jnp.int32(1))  # arrive (acquire-release, GPU scope)
    if interpret:
        return

    def cond(carry):
        seen, polls = carry
        return (seen < target) & (polls < SPIN_LIMIT)

    def poll(carry):
        _, polls = carry
        return plgpu.atomic_add(count_ref, jnp.int32(0), jnp.int32(0)), polls + 1

    lax.while_loop(cond, poll, (jnp.int32(0), jnp.int32(0)))
    plgpu.debug_barrier()


def _tile(w_ref, phase, pid, i, rows: int, block: int):
    return w_ref[phase, pl.ds(pid * rows, rows), pl.ds(i * block, block)]


def _rows_sum(w_ref, phase, pid, n: int, rows: int, block: int, first=None):
    """Sum of program `pid`'s `rows` rows of phase `phase`, in [rows, block] tiles (f32); `first` =
    its first tile, loaded already."""
    def body(i, acc):
        return acc + _tile(w_ref, phase, pid, i, rows, block).astype(jnp.float32)

    acc = jnp.zeros((rows, block), jnp.float32) if first is None else first.astype(jnp.float32)
    return jnp.sum(lax.fori_loop(0 if first is None else 1, n // block, body, acc))


def _phases_kernel(w_ref, _count_in, out_ref, count_ref, *, first_phase: int, phases: int, n: int, rows: int,
                   block: int, barrier: bool, prefetch: bool, interpret: bool):
    pid = pl.program_id(0)
    programs = pl.num_programs(0)
    first = _tile(w_ref, first_phase, pid, 0, rows, block) if prefetch else None
    for phase in range(phases):
        total = _rows_sum(w_ref, first_phase + phase, pid, n, rows, block, first)
        out_ref[phase, pid] = total
        if phase + 1 < phases:
            if prefetch:  # the next phase's first tile is in flight while this program waits
                first = _tile(w_ref, first_phase + phase + 1, pid, 0, rows, block)
            if barrier:
                grid_barrier(count_ref, programs * (phase + 1), interpret=interpret)


def run_phases(w, *, block: int, barrier: bool, prefetch: bool, first_phase: int = 0, phases: int | None = None,
               rows: int = 1, num_warps: int = 4):
    """Phases [first_phase, first_phase + phases) of w [P, programs * rows, n] bf16 -> per-program
    sums [phases, programs] f32, in one pallas_call."""
    from jax.experimental.pallas import triton as plgpu

    _, all_rows, n = w.shape
    if all_rows % rows:
        raise ValueError(f"w has {all_rows} rows per phase, not a multiple of rows={rows}")
    programs = all_rows // rows
    phases = w.shape[0] - first_phase if phases is None else phases
    interpret = jax.default_backend() == "cpu"
    if interpret and barrier and programs > 1:
        raise ValueError(f"a grid barrier over {programs} programs cannot run in interpret mode (one program at a time)")
    kernel = functools.partial(_phases_kernel, first_phase=first_phase, phases=phases, n=n, rows=rows, block=block,
                               barrier=barrier, prefetch=prefetch, interpret=interpret)
    out, _ = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[pl.BlockSpec(w.shape, lambda i: (0, 0, 0)), pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((phases, programs), lambda i: (0, 0)), pl.BlockSpec((1,), lambda i: (0,))],
        out_shape=[jax.ShapeDtypeStruct((phases, programs), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32)],
        input_output_aliases={1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="phases_barrier" if barrier else "phases",
    )(w, jnp.zeros((1,), jnp.int32))
    return out


def run_kernels(w, *, block: int, rows: int = 1, num_warps: int = 4):
    """The same sums, one pallas_call per phase (each reads its phase of the same w: no slicing
    copies; the one concatenate at the end moves phases x programs floats)."""
    return jnp.concatenate([run_phases(w, block=block, barrier=False, prefetch=False, first_phase=p, phases=1,
                                       rows=rows, num_warps=num_warps)
                            for p in range(w.shape[0])])


def main():
    from bench_attention import header, time_interleaved

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", default="8,32,128", help="MB read per phase (comma list)")
    p.add_argument("--phases", type=int, default=16)
    p.add_argument("--block", type=int, default=2048, help="elements per tile load")
    p.add_argument("--rows", default="1", help="rows each program reads at once (comma list: one table row each)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--programs", type=int, default=0, help="0 = one per SM")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    dev = jax.devices()[0]
    programs = args.programs or int(getattr(dev, "core_count", 0) or 132)
    print(header(), f"programs {programs}", flush=True)
    rows, seen = [], set()
    for r, mb in ((int(r), float(x)) for r in args.rows.split(",") for x in args.mb.split(",")):
        n = max(args.block, int(mb * 2**20 / 2 / programs / r) // args.block * args.block)
        if (r, n) in seen:  # a small --mb rounded up to the same one-tile rows
            continue
        seen.add((r, n))
        w = jax.random.normal(jax.random.key(0), (args.phases, programs * r, n), jnp.bfloat16)
        expect = np.asarray(jnp.sum(w.astype(jnp.float32).reshape(args.phases, programs, r * n), axis=-1))
        common = dict(block=args.block, rows=r, num_warps=args.warps)
        fns = {"kernels": jax.jit(functools.partial(run_kernels, **common)),
               "barrier": jax.jit(functools.partial(run_phases, barrier=True, prefetch=False, **common)),
               "prefetch": jax.jit(functools.partial(run_phases, barrier=True, prefetch=True, **common))}
        row = dict(mb_per_phase=w[0].size * 2 / 2**20, phases=args.phases, programs=programs, rows=r,
                   warps=args.warps)
        for name, fn in fns.items():
            err = float(np.max(np.abs(np.asarray(fn(w)) - expect)))
            row[f"err_{name}"] = err
        times = time_interleaved({name: functools.partial(fn, w) for name, fn in fns.items()}, reps=args.reps)
        for name, ts in times.items():
            sec = float(np.median(ts))
            row[f"us_per_phase_{name}"] = sec / args.phases * 1e6
            row[f"tbps_{name}"] = w.size * 2 / sec / 1e12
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| rows/program | MB/phase | phases | kernels µs/phase (TB/s) | barrier | prefetch | max err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[f'us_per_phase_{k}']:.2f} ({r[f'tbps_{k}']:.2f})" for k in ("kernels", "barrier", "prefetch")]
        err = max(r[f"err_{k}"] for k in ("kernels", "barrier", "prefetch"))
        print(f"| {r['rows']} | {r['mb_per_phase']:.1f} | {r['phases']} | " + " | ".join(cells) + f" | {err:.1e} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_grid_barrier.json"), "w") as fh:
            json.dump(dict(header=header(), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
