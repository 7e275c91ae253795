"""A model's batch-1 GEMV chain as one persistent Mosaic GPU kernel with every phase spread evenly
over all SMs ("stream-K"): how close to the copy bandwidth can a decode step's weight bytes get?

    PYTHONPATH=.:experiments python3 experiments/bench_streamk_chain.py --models 1b --reps 20

Why (docs/decoding.md, "Fifteenth session"): bench_weight_stream.py's layer-looped chain
(`stream_layers`) gives each CTA whole 64-row tiles. The 1b's narrow phases then leave most SMs
idle: the output and down projections have 32 row tiles for 132 SMs, q/k/v 48. Its whole chain
streamed at 55% of the copy bandwidth on an H100 (47% as one launch per phase), below the
decoder's 72-74%.

Here each phase is a grid of units, one unit = one [64, block_k] weight tile (a row tile t and a
K step j), numbered g = t * steps + j. CTA c takes the contiguous units [c G / C, (c + 1) G / C)
of each phase's G units (stream-K: Osama et al., "Stream-K: Work-centric Parallel Decomposition
for Dense Matrix-Matrix Multiplication on the GPU", PPoPP 2023), so every SM streams the same
number of weight bytes ±1 tile in every phase. A row tile split between CTAs is summed in global
memory: each CTA adds its f32 partial by a TMA reduce-add (cp.reduce.async.bulk .add) into the
phase's output, which the kernel zeroes at its start.

Per CTA, as in bench_weight_stream.py:
- a producer warpgroup streams every phase's weight tiles through a TMA ring and never waits at
  a barrier (the weights depend on no activation);
- a consumer warpgroup, per phase: waits until every CTA has finished the phase before (a global
  semaphore), loads the K chunks of x its units need (f32, 1 KB each, from the previous phase's
  output), rounds them to bf16 into the wgmma layout (batch 1: x is column 0 of an [block_k, 8]
  operand, the other 7 columns zero), multiplies each weight tile (wgmma, N = 8), sums the 8
  columns of the [64, 8] accumulator (only column 0 is non-zero) and reduce-adds the 64 values.

The chain is bench_weight_stream's: per layer q/k/v, output, gate/up, down (x of each = the first
K values of the output before it), then the head; attention, norms, RoPE and the SwiGLU are left
out. It is checked against the same chain in XLA (f32 products of bf16 inputs, bf16 between
phases). Timed interleaved in one process with `stream_layers` (whole tiles per CTA) and the
copy bandwidth.

The global semaphores have no interpret mode: tests/test_bench_streamk_chain.py lowers the kernel
for sm_90 on the CPU and runs it in Pallas' GPU interpreter with one CTA (which then takes every
unit in order, so no barrier is needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scaling.kernels.flash_attention_mgpu import interpret_params
from scaling.kernels.flash_attention_mgpu_bwd import SMEM_BYTES  # shared memory per CTA on sm_90

from bench_weight_stream import repeated, tile_product, zero_acc  # (experiments/ is on the path)

ROWS = 8  # wgmma's N: batch 1 is column 0 of the activation operand
BLOCK_F = 64  # weight rows per unit (wgmma M)
ZERO = 256  # f32 values per zeroing store (a TMA box dimension is at most 256)
LAYER_PHASES = ("qkv", "out", "gate_up", "down")
PROFILE_EVENTS = 512  # profiled regions per warpgroup (the 1b's chain records ~330 per consumer)


@dataclasses.dataclass(frozen=True)
class Phase:
    """One GEMV of the chain: W [n, k] (stacked per layer unless it is the head), its output at
    `y_off` (+ layer * layer_stride) of the flat f32 output, its x at `x_off` (+ the same)."""

    name: str
    n: int
    k: int
    y_off: int
    x_off: int  # (q/k/v of layer 0 reads the kernel's input x instead)

    def units(self, block_k: int) -> int:
        return self.n // BLOCK_F * (self.k // block_k)


def plan_phases(shapes: dict[str, tuple[int, ...]]) -> tuple[list[Phase], Phase, int, int]:
    """The per-layer phases, the head, the layer stride and the flat output's length (padded to
    ZERO), from model_chain_shapes-style shapes."""
    off, layer = 0, []
    for name in LAYER_PHASES:
        _, n, k = shapes[name]
        layer.append((name, n, k, off))
        off += n
    stride = off
    phases = []
    for i, (name, n, k, y_off) in enumerate(layer):
        # x: the output before (the previous layer's down for q/k/v, at y_off - stride)
        x_off = layer[i - 1][3] if i else layer[-1][3] - stride
        phases.append(Phase(name, n, k, y_off, x_off))
    layers = shapes["qkv"][0]
    v, d = shapes["head"]
    head = Phase("head", v, d, layers * stride, (layers - 1) * stride + layer[-1][3])
    total = -(-(head.y_off + v) // ZERO) * ZERO
    return phases, head, stride, total


def owner(u, units: int, ctas: int):
    """The CTA whose stream-K share [c G / C, (c + 1) G / C) of G = `units` holds unit u."""
    return ((u + 1) * ctas + units - 1) // units - 1


def chunk_count(j, units: int, steps: int, ctas: int, block_k: int):
    """How many (CTA, row tile) pairs add to output chunk j (block_k outputs, block_k / 64 row
    tiles of `steps` units each) of a phase of `units` units: what barrier="chunks" waits for."""
    t0 = j * (block_k // BLOCK_F)
    return sum(owner((t0 + i + 1) * steps - 1, units, ctas) - owner((t0 + i) * steps, units, ctas) + 1
               for i in range(block_k // BLOCK_F))


def x_slots(phases: list[Phase], ctas: int, block_k: int) -> int:
    """x chunks a CTA holds at once: the K steps its units of one phase touch, at most."""
    return max(min(p.k // block_k, -(-p.units(block_k) // ctas) + 1) for p in phases)


def smem_bytes(slots: int, block_k: int, stages: int) -> int:
    return (slots * block_k * (ROWS * 2 + 4) + stages * BLOCK_F * block_k * 2 + (BLOCK_F + ZERO) * 4
            + 8 * (slots + 2 * stages))


def _body(x_ref, *refs, phases: tuple[Phase, ...], head: Phase, stride: int, total: int, layers: int, block_k: int,
          stages: int, ctas: int, sync: str, interpret: bool, stream_only: bool, unit_major: bool, lazy_x: bool,
          x_loads: str, prefetch: int):
    """The kernel: the weights (q/k/v, output, gate/up, down, head; or, with no layer phases, the
    one phase's W as the `head`, reading the kernel's x), the flat output, the scratch."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    names = (*LAYER_PHASES, "head") if phases else ("head",)
    weights = dict(zip(names, refs))
    (y_ref, x_smem, x_stage, w_ring, out_smem, zeros, x_full, w_full, free, y_full) = refs[len(names):]
    c = lax.axis_index("c")
    wg = lax.axis_index("wg")
    # sync "grid": semaphore 0: the output is zeroed; 1 + i: phase i of the chain is done (4 per
    # layer, then the head). sync "chunks": semaphore 0 the same; then one per block_k outputs
    # (flat offset // block_k + 1) counting the units summed into them
    n_sem = 2 + 4 * layers if sync == "grid" else 1 + total // block_k
    done = pl.get_global(plgpu.SemaphoreType.REGULAR((n_sem,))) if sync else None
    chunks = sync == "chunks"
    producer_steps, producer_units = {}, {}  # of the phase whose output each phase reads (chunks)
    if phases:
        producer_steps = {p.name: phases[i - 1].k // block_k for i, p in enumerate(phases)}
        producer_steps["qkv"] = phases[-1].k // block_k  # q/k/v reads the previous layer's down
        producer_steps["head"] = phases[-1].k // block_k
        producer_units = {p.name: phases[i - 1].units(block_k) for i, p in enumerate(phases)}
        producer_units["qkv"] = producer_units["head"] = phases[-1].units(block_k)

    def span(p: Phase):
        g = p.units(block_k)
        return c * g // ctas, (c + 1) * g // ctas

    # (named scopes: regions of the on-device profile, `profile_dir`; no code without it)
    def wait(index, zeroed=False):  # zeroed: semaphore 0, which every sync mode uses
        if sync == "grid" or (sync and zeroed):
            with jax.named_scope("zero_wait" if zeroed else "wait"):
                plgpu.semaphore_wait(done.at[index], ctas, decrement=False, memory_scope="gpu")

    def signal(index, zeroed=False):
        if sync == "grid" or (sync and zeroed):
            with jax.named_scope("signal"):
                plgpu.semaphore_signal(done.at[index], 1, memory_scope="gpu")

    def load_x(p: Phase, x_base, from_input, a, b):
        """x's chunks for units [a, b) into slots 0.. (chunk (a + i) mod steps in slot i), as
        bf16 column 0 of the wgmma operand. from_input: read the kernel's x instead (layer 0)."""
        steps = p.k // block_k
        n_x = jnp.minimum(b - a, steps)

        # chunks: each x chunk once every CTA that adds to its block_k outputs has counted itself
        # in (one count per CTA and row tile; every CTA has a unit in every phase)
        q_steps = producer_steps.get(p.name, 0)
        q_units = producer_units.get(p.name, 1)

        def expected(j):
            return chunk_count(j, q_units, q_steps, ctas, block_k)

        @pl.loop(0, n_x)
        def _issue(i):
            j = lax.rem(a + i, steps)
            if chunks:
                @pl.when(jnp.logical_not(from_input))
                def _():
                    plgpu.semaphore_wait(done.at[1 + x_base // block_k + j], expected(j), decrement=False,
                                         memory_scope="gpu")

            @pl.when(from_input)
            def _():
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(j * block_k, block_k)], x_stage.at[i], x_full.at[i])

            if x_loads == "tma":  # (x_loads "ld": round_x reads the chunk itself)
                @pl.when(jnp.logical_not(from_input))
                def _():
                    plgpu.copy_gmem_to_smem(y_ref.at[pl.ds(x_base + j * block_k, block_k)], x_stage.at[i],
                                            x_full.at[i])

        round_x = functools.partial(round_chunk, from_input=from_input, x_base=x_base, a=a, steps=steps)
        if not lazy_x:
            @pl.loop(0, n_x)
            def _round(i):
                round_x(i)
            plgpu.commit_smem()  # the generic-proxy stores, visible to wgmma
        return n_x, round_x

    def to_operand(i, v):
        """x chunk v [block_k] f32 -> bf16 column 0 of slot i's wgmma operand (the rest zero)."""
        if interpret:
            col = lax.broadcasted_iota(jnp.int32, (block_k, ROWS), 1)
            x_smem.at[i].T[...] = jnp.where(col == 0, v[:, None], 0.0).astype(x_smem.dtype)
        else:
            col = plgpu.broadcasted_iota(jnp.int32, (block_k, ROWS), 1, layout=plgpu.Layout.WGMMA)
            xb = jnp.where(col == 0, lax.broadcast_in_dim(v, (block_k, ROWS), [0]), 0.0)
            x_smem.at[i].T[...] = xb.astype(x_smem.dtype)

    def load_vector(ref, gmem=False):  # (Mosaic vectorises loads from shared memory only)
        return ref[...] if interpret else plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=not gmem)

    def round_chunk(i, *, from_input, x_base, a, steps):
        """Slot i's x chunk rounded into the operand: from its TMA copy once landed, or (x_loads
        "ld", not from the input) loaded from global memory by the warpgroup's own loads."""
        def from_stage():
            plgpu.barrier_wait(x_full.at[i])
            to_operand(i, load_vector(x_stage.at[i]))

        if x_loads == "tma":
            from_stage()
            return
        pl.when(from_input)(from_stage)

        @pl.when(jnp.logical_not(from_input))
        def _():
            j = lax.rem(a + i, steps)
            to_operand(i, load_vector(y_ref.at[pl.ds(x_base + j * block_k, block_k)], gmem=True))

    def consume(p: Phase, layer, r, from_input=False):
        """The CTA's units of phase p (layer `layer`); r: the ring's running count. Returns r."""
        steps = p.k // block_k
        a, b = span(p)
        if stream_only:  # take each tile and free its slot: the producer's streaming ceiling
            def take(g, r):
                plgpu.barrier_wait(w_full.at[lax.rem(r, stages)])
                plgpu.barrier_arrive(free.at[lax.rem(r, stages)])
                return r + 1

            return lax.fori_loop(a, b, take, r)
        x_base = p.x_off + (0 if p.name == "head" else layer * stride)
        with jax.named_scope("x"):
            n_x, round_x = load_x(p, jnp.maximum(x_base, 0), jnp.asarray(from_input), a, b)
        y_base = p.y_off + (0 if p.name == "head" else layer * stride)

        def segment(carry):
            g, r = carry
            t, j0 = g // steps, lax.rem(g, steps)
            n = jnp.minimum(steps - j0, b - g)

            def step(jj, acc):
                slot = lax.rem(r + jj, stages)
                xs = lax.rem(g + jj - a, steps)
                if lazy_x:  # the chunk's first use: round it now, so the first product need not wait for all
                    @pl.when(g + jj - a < n_x)
                    def _():
                        round_x(xs)
                        plgpu.commit_smem()
                plgpu.barrier_wait(w_full.at[slot])
                acc = tile_product(acc, w_ring.at[slot], x_smem.at[xs], interpret)
                plgpu.barrier_arrive(free.at[slot])
                return acc

            acc = lax.fori_loop(0, n, step, zero_acc(interpret))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out_smem's previous reduce has read it
            out_smem[...] = jnp.sum(acc, axis=1)  # column 0 (the others are 0 x W)
            plgpu.commit_smem()
            dst = y_ref.at[pl.ds(y_base + t * BLOCK_F, BLOCK_F)]
            if interpret:  # the interpreter has no TMA reduction: read, add, write (one CTA: no race)
                old = zeros.at[pl.ds(0, BLOCK_F)]
                plgpu.copy_gmem_to_smem(dst, old, y_full)
                plgpu.barrier_wait(y_full)
                out_smem[...] = out_smem[...] + old[...]
                plgpu.copy_smem_to_gmem(out_smem, dst)
            else:
                plgpu.copy_smem_to_gmem(out_smem, dst, reduction_op="add")
            return g + n, r + n

        with jax.named_scope("units"):
            _, r = lax.while_loop(lambda carry: carry[0] < b, segment, (a, r))
        with jax.named_scope("drain"):
            plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # written, before the phase is signalled
        if chunks and p.name != "head":  # count this CTA's units into each row tile's output chunk
            @pl.loop(a // steps, (b + steps - 1) // steps)
            def _count(t):  # (the increment must be a constant: one per row tile this CTA added to)
                plgpu.semaphore_signal(done.at[1 + (y_base + t * BLOCK_F) // block_k], 1, memory_scope="gpu")
        return r

    @pl.when(wg == 0)
    def _consumer():
        zeros[...] = jnp.zeros((ZERO,), jnp.float32) if interpret else plgpu.layout_cast(
            jnp.zeros((ZERO,), jnp.float32), plgpu.Layout.WG_STRIDED((ZERO,), vec_size=2))
        plgpu.commit_smem()

        @pl.loop(c, total // ZERO, step=ctas)
        def _zero(i):
            plgpu.copy_smem_to_gmem(zeros, y_ref.at[pl.ds(i * ZERO, ZERO)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        signal(0, zeroed=True)
        wait(0, zeroed=True)

        def layer(l, r):
            for i, p in enumerate(phases):
                if i == 0:
                    @pl.when(l > 0)
                    def _():
                        wait(4 * l)
                else:
                    wait(1 + 4 * l + i - 1)
                r = consume(p, l, r, from_input=l == 0 if i == 0 else False)  # layer 0 reads the input
                signal(1 + 4 * l + i)
            return r

        r = lax.fori_loop(0, layers, layer, jnp.int32(0)) if layers else jnp.int32(0)
        if layers:
            wait(4 * layers)
        consume(head, 0, r, from_input=not phases)

    @pl.when(wg == 1)
    def _producer():  # every phase's weight tiles in the consumer's order: they depend on no activation
        def src_of(p: Phase, layer, g):
            w = weights[p.name]
            if unit_major:  # unit g is one contiguous [64, block_k] tile
                return w.at[g] if p.name == "head" else w.at[layer, g]
            steps = p.k // block_k
            t, j = g // steps, lax.rem(g, steps)
            rows, cols = pl.ds(t * BLOCK_F, BLOCK_F), pl.ds(j * block_k, block_k)
            return w.at[rows, cols] if p.name == "head" else w.at[layer, rows, cols]

        def prefetch_unit(g, p: Phase, layer, nexts):
            """Unit g + `prefetch` into L2: of this phase, or past its end, of the next one
            (nexts: [(condition, phase, layer)], the first that holds)."""
            a, b = span(p)
            ahead = g + prefetch

            @pl.when(ahead < b)
            def _():
                plgpu.async_prefetch(src_of(p, layer, ahead))

            for cond, q, q_layer in nexts:
                qa, qb = span(q)

                @pl.when(jnp.logical_and(ahead >= b, jnp.logical_and(cond, qa + ahead - b < qb)))
                def _():
                    plgpu.async_prefetch(src_of(q, q_layer, qa + ahead - b))

        def stream(p: Phase, layer, r, nexts=()):
            a, b = span(p)

            def fetch(g, r):
                slot = lax.rem(r, stages)
                if prefetch and not interpret:  # (the interpreter has no L2)
                    prefetch_unit(g, p, layer, nexts)

                @pl.when(r >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])
                plgpu.copy_gmem_to_smem(src_of(p, layer, g), w_ring.at[slot], w_full.at[slot])
                return r + 1

            return lax.fori_loop(a, b, fetch, r)

        def layer(l, r):
            for i, p in enumerate(phases):
                if i + 1 < len(phases):
                    nexts = [(jnp.bool_(True), phases[i + 1], l)]
                else:  # down: the next layer's q/k/v, or the head after the last layer
                    nexts = [(l + 1 < layers, phases[0], l + 1), (l + 1 == layers, head, 0)]
                r = stream(p, l, r, nexts)
            return r

        r = lax.fori_loop(0, layers, layer, jnp.int32(0)) if layers else jnp.int32(0)
        r = stream(head, 0, r)

        @pl.loop(0, stages)
        def _drain(i):  # the last `stages` releases
            @pl.when(r - stages + i >= 0)
            def _():
                plgpu.barrier_wait(free.at[lax.rem(r - stages + i, stages)])


def unit_major(w, block_k: int):
    """W [..., N, K] as [..., G, 64, block_k]: unit g = t * (K / block_k) + j (row tile t, K step j)
    one contiguous tile, so each CTA's units of a phase are one contiguous stretch of memory."""
    *lead, n, k = w.shape
    t = w.reshape(*lead, n // BLOCK_F, BLOCK_F, k // block_k, block_k)
    t = jnp.swapaxes(t, -3, -2)
    return t.reshape(*lead, n // BLOCK_F * (k // block_k), BLOCK_F, block_k)


def stream_k_chain(x, wq, wo, wgu, wd, wh, *, ctas: int, block_k: int = 256, stages: int = 4, barrier: str | bool = True,
                   stream_only: bool = False, shapes: dict | None = None, lazy_x: bool = False,
                   x_loads: str = "tma", prefetch: int = 0, profile_dir: str = "", interpret: bool = False):
    """The chain of `layers` decoder layers' GEMVs and the head as one kernel of `ctas` resident
    CTAs, every phase spread evenly over all of them (module docstring). x: f32 [D] (batch 1);
    w* bf16 stacked per layer [L, N, K], wh [V, D]. Returns the flat f32 output: per layer q/k/v,
    output, gate/up and down (`plan_phases` gives the offsets), then the head's logits.
    barrier: True or "grid": every phase waits for all CTAs to finish the one before; "chunks":
    each x chunk is waited for alone, until every unit summed into its block_k outputs has been
    counted (a semaphore per chunk); False leaves out the waits (wrong outputs; the time is the
    streaming ceiling);
    stream_only: the consumer only takes each weight tile (no x, no products, no waits: the
    producer's ceiling). lazy_x: round each x chunk into the operand just before its first product
    rather than all of them before the first. x_loads: "tma" (each x chunk copied into shared
    memory by TMA, then rounded) or "ld" (read by the consumer warpgroup's own loads straight into
    registers, so it does not queue behind the weight tiles in the SM's TMA unit). prefetch: the
    producer also prefetches the weight tile this many units ahead into L2 (cp.async.bulk.prefetch),
    across phase ends, so HBM keeps streaming while a full ring waits at a barrier. profile_dir: record the consumer's regions (zero,
    wait, x, units, drain, signal) with Mosaic GPU's on-device profiler and write them there as
    a Perfetto trace (`barrier_breakdown` reads it). shapes: the logical {qkv: [L, N, K], ..., head: [V, D]} when the weights
    come in `unit_major` form. interpret: Pallas' GPU interpreter; needs barrier=False and
    computes right only with ctas=1."""
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (units ahead), got {prefetch}")
    if x_loads not in ("tma", "ld"):
        raise ValueError(f"x_loads must be 'tma' or 'ld', got {x_loads!r}")
    if interpret and barrier is not False:
        raise ValueError("stream_k_chain: interpret mode has no global semaphores; pass barrier=False (and ctas=1)")
    ws = dict(qkv=wq, out=wo, gate_up=wgu, down=wd, head=wh)
    units = shapes is not None
    shapes = shapes or {name: w.shape for name, w in ws.items()}
    if units:
        for name, w in ws.items():
            want = (*shapes[name][:-2], shapes[name][-2] // BLOCK_F * (shapes[name][-1] // block_k), BLOCK_F, block_k)
            if w.shape != want:
                raise ValueError(f"{name}: unit-major W must be {want} (unit_major of {shapes[name]}), got {w.shape}")
    layers, _, d = shapes["qkv"]
    phases, head, stride, total = plan_phases(shapes)
    sync = {True: "grid", False: "", "grid": "grid", "chunks": "chunks"}.get(barrier)
    if sync is None:
        raise ValueError(f"barrier must be True, False, 'grid' or 'chunks', got {barrier!r}")
    if sync == "chunks" and (any(q.y_off % block_k for q in phases) or stride % block_k):
        raise ValueError(f"barrier='chunks' needs every output to start at a multiple of block_k={block_k}")
    if sync == "chunks" and min(q.units(block_k) for q in phases) < ctas:
        raise ValueError(f"barrier='chunks' needs at least one unit per CTA in every phase (ctas={ctas})")
    if x.shape != (d,) or x.dtype != jnp.float32:
        raise ValueError(f"x must be float32 [{d}] (batch 1), got {x.dtype} {x.shape}")
    widths = dict(qkv=shapes["down"][1], out=shapes["qkv"][1], gate_up=shapes["out"][1], down=shapes["gate_up"][1],
                  head=shapes["down"][1])
    for p in (*phases, head):
        if p.n % BLOCK_F or p.k % block_k or p.k > widths[p.name]:
            raise ValueError(f"{p.name}: W {p.n}x{p.k} needs N a multiple of {BLOCK_F}, K of block_k={block_k}, "
                             f"and K <= the width of the output before it ({widths[p.name]})")
    return _launch(x, (wq, wo, wgu, wd, wh), phases, head, stride, total, layers, ctas=ctas, block_k=block_k,
                   stages=stages, sync="" if stream_only else sync, interpret=interpret, stream_only=stream_only,
                   unit_major=units, lazy_x=lazy_x, x_loads=x_loads, prefetch=prefetch, profile_dir=profile_dir)


def _launch(x, weights, phases, head, stride, total, layers, *, ctas, block_k, stages, profile_dir, **flags):
    """Shared-memory checks, scratch and the kernel call of stream_k_chain and stream_k_phase."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    slots = x_slots([*phases, head], ctas, block_k)
    if max(slots, stages) > 32:  # Mosaic GPU: at most 32 barriers per group
        raise ValueError(f"{slots} x chunks and {stages} ring slots: at most 32 each; a larger block_k or more CTAs")
    # the profiler keeps 4 i32 per region per warpgroup in shared memory
    if (need := smem_bytes(slots, block_k, stages) + (2 * 16 * PROFILE_EVENTS if profile_dir else 0)) > SMEM_BYTES:
        raise ValueError(f"{slots} x chunks and {stages} ring slots need {need} bytes of shared memory, more than "
                         f"{SMEM_BYTES}: fewer stages, a smaller block_k or more CTAs")
    dtype = weights[0].dtype
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (plgpu.SMEM((slots, ROWS, block_k), dtype, transforms=tiled),  # x, bf16 operand
               plgpu.SMEM((slots, block_k), jnp.float32),  # x as loaded
               plgpu.SMEM((stages, BLOCK_F, block_k), dtype, transforms=tiled),  # the weight ring
               plgpu.SMEM((BLOCK_F,), jnp.float32),  # a unit's partial sums, reduce-added by TMA
               plgpu.SMEM((ZERO,), jnp.float32),
               plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=stages),
               plgpu.Barrier(num_barriers=stages),
               plgpu.Barrier())  # (interpret mode's read-add-write of an output tile)
    return plgpu.kernel(
        functools.partial(_body, phases=tuple(phases), head=head, stride=stride, total=total, layers=layers,
                          block_k=block_k, stages=stages, ctas=ctas, **flags),
        out_type=jax.ShapeDtypeStruct((total,), jnp.float32),
        scratch_types=scratch, grid=(ctas,), grid_names=("c",), num_threads=2, thread_name="wg",
        interpret=interpret_params(flags["interpret"]),
        compiler_params=plgpu.CompilerParams(profile_space=PROFILE_EVENTS, profile_dir=profile_dir)
        if profile_dir else None,
    )(x, *weights)


def stream_k_phase(x, w, *, ctas: int, block_k: int = 256, stages: int = 4, n: int | None = None,
                   lazy_x: bool = False, x_loads: str = "tma", interpret: bool = False):
    """One GEMV y = x[:K] Wᵀ as its own kernel, spread over `ctas` CTAs like one phase of
    stream_k_chain (what a decoder of one stream-K launch per projection would run). x: f32
    [>= K]; w bf16 [N, K], or unit-major [G, 64, block_k] with n=N given. Returns f32 [>= N]: y,
    then zeros up to a multiple of 256 (no slice, so the next launch reads it as it is)."""
    if w.ndim == 3:
        if n is None or n % BLOCK_F or w.shape[1:] != (BLOCK_F, block_k) or w.shape[0] % (n // BLOCK_F):
            raise ValueError(f"a unit-major w {w.shape} needs n (N) and block_k={block_k} that match it")
        k = w.shape[0] // (n // BLOCK_F) * block_k
    else:
        n, k = w.shape
    if x.ndim != 1 or x.shape[0] < k or x.dtype != jnp.float32:
        raise ValueError(f"x must be float32 [>= K={k}], got {x.dtype} {x.shape}")
    if n % BLOCK_F or k % block_k:
        raise ValueError(f"W {n}x{k} needs N a multiple of {BLOCK_F} and K of block_k={block_k}")
    phase = Phase("head", n, k, 0, 0)
    total = -(-n // ZERO) * ZERO
    y = _launch(x, (w,), (), phase, 0, total, 0, ctas=ctas, block_k=block_k, stages=stages, profile_dir="",
                sync="" if interpret else "grid", interpret=interpret, stream_only=False, unit_major=w.ndim == 3,
                lazy_x=lazy_x, x_loads=x_loads, prefetch=0)
    return y


def chain_by_phase(x, *flat, shapes: dict, **kw):
    """The chain as one stream_k_phase launch per phase: flat = every layer's unit-major q/k/v,
    output, gate/up and down in order, then the head's; shapes as model_chain_shapes. Returns the
    logits (padded, stream_k_phase)."""
    *layer_ws, head_w = flat
    h = x
    for i, w in enumerate(layer_ws):
        h = stream_k_phase(h, w, n=shapes[LAYER_PHASES[i % 4]][1], **kw)
    return stream_k_phase(h, head_w, n=shapes["head"][0], **kw)


def reference_chain(x, wq, wo, wgu, wd, wh, precision=lax.Precision.HIGHEST):
    """The same chain in XLA: f32 products of bf16 inputs, x rounded to bf16 before each phase.
    Returns the flat output in stream_k_chain's layout (without its padding). precision=None:
    bf16 GEMVs with f32 results, as a decoder would run them (the timing calibration)."""
    def mm(x, w):
        xb = x[: w.shape[1]].astype(jnp.bfloat16)
        if precision is None:
            return jnp.einsum("k,nk->n", xb, w, preferred_element_type=jnp.float32)
        return jnp.einsum("k,nk->n", xb.astype(jnp.float32), w.astype(jnp.float32),
                          precision=precision)  # (GPU f32 dots default to TF32)

    outs, h = [], x
    for l in range(wq.shape[0]):
        for w in (wq, wo, wgu, wd):
            h = mm(h, w[l])
            outs.append(h)
    outs.append(mm(h, wh))
    return jnp.concatenate(outs)


# the variants measure_model times: name suffix -> stream_k_chain keywords
MODES = {"": {}, " lazy x": dict(lazy_x=True), " lazy x, ld": dict(lazy_x=True, x_loads="ld"),
         " lazy x, prefetch 4": dict(lazy_x=True, prefetch=4), " lazy x, prefetch 8": dict(lazy_x=True, prefetch=8),
         " chunk waits": dict(barrier="chunks"), " without the barrier": dict(barrier=False),
         " stream only": dict(stream_only=True)}
ROW_MODES = ("", " without the barrier")  # with row-major weights


def measure_model(model: str, reps: int, bw: float, ctas: int, configs: list[tuple[int, int]],
                  whole_tiles: bool = True, repeat: int = 10) -> list[dict]:
    """The model's chain by stream_k_chain for each (block_k, stages): weights row-major and
    unit-major, each with and without the barrier, unit-major streaming only; and (whole_tiles)
    bench_weight_stream's stream_layers; interleaved in one process."""
    import numpy as np

    import bench_weight_stream as bws
    from bench_attention import time_interleaved

    shapes = bws.model_chain_shapes(model)
    keys = iter(jax.random.split(jax.random.key(0), len(shapes) + 1))
    ws = {name: (jax.random.normal(next(keys), s, jnp.float32) / s[-1] ** 0.5).astype(jnp.bfloat16)
          for name, s in shapes.items()}
    args = [ws[n] for n in ("qkv", "out", "gate_up", "down", "head")]
    x = jax.random.normal(next(keys), (shapes["qkv"][-1],), jnp.float32)
    nbytes = sum(int(np.prod(s)) * 2 for s in shapes.values())
    want = np.asarray(jax.jit(reference_chain)(x, *args))
    # the first phase in float64 on the host, to tell the kernel's error from the reference's
    xb = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    want64 = np.asarray(args[0][0].astype(jnp.float32), np.float64) @ xb
    v = shapes["head"][0]
    calls, rows = {}, []
    rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))  # noqa: E731
    first = shapes["qkv"][1]
    for block_k, stages in configs:
        by_units = [unit_major(w, block_k) for w in args]
        for layout, wargs, extra in (("rows", args, {}), ("units", by_units, dict(shapes=shapes))):
            for mode, kw in MODES.items():
                if layout == "rows" and mode not in ROW_MODES:
                    continue
                name = f"stream-K {layout} bk{block_k} s{stages}{mode}"
                barrier = kw.get("barrier", True) and not kw.get("stream_only")
                fn = jax.jit(functools.partial(stream_k_chain, ctas=ctas, block_k=block_k, stages=stages, **kw,
                                               **extra))
                t0 = time.perf_counter()
                got = np.asarray(fn(x, *wargs))[: want.size]
                compile_s = time.perf_counter() - t0
                if barrier:
                    rows.append(dict(model=model, variant=name, block_k=block_k, stages=stages, ctas=ctas,
                                     layout=layout, compile_s=compile_s,
                                     rel_err_first_phase=rel(got[:first], want[:first]),
                                     rel_err_first_phase_f64=rel(got[:first], want64),
                                     xla_first_phase_rel_err_f64=rel(want[:first], want64),
                                     rel_err_logits=rel(got[-v:], want[-v:])))
                    print(f"{name}: compiled and ran in {compile_s:.1f} s; rel. error first phase "
                          f"{rows[-1]['rel_err_first_phase']:.1e} (float64: {rows[-1]['rel_err_first_phase_f64']:.1e}; "
                          f"XLA's {rows[-1]['xla_first_phase_rel_err_f64']:.1e}), logits {rows[-1]['rel_err_logits']:.1e}", flush=True)
                rep = repeated(fn, repeat)
                rep(x, *wargs).block_until_ready()
                calls[name] = lambda fn=rep, wargs=wargs: fn(x, *wargs)
    # the same units as separate kernels: one stream-K launch per phase (inside XLA's command
    # buffer), unit-major per-layer weights prepared outside the timing
    block_k, stages = configs[0]
    per_layer = [unit_major(w[l], block_k) for l in range(shapes["qkv"][0])
                 for w in args[:4]]
    head_units = unit_major(args[4], block_k)
    by_phase = functools.partial(chain_by_phase, shapes=shapes, ctas=ctas, block_k=block_k, stages=stages,
                                 lazy_x=True)
    sep = jax.jit(by_phase)
    got = np.asarray(sep(x, *per_layer, head_units))
    name = f"stream-K units bk{block_k} s{stages} lazy x, one launch per phase"
    rows.append(dict(model=model, variant=name, block_k=block_k, stages=stages, ctas=ctas, layout="units",
                     rel_err_first_phase=float("nan"), rel_err_logits=rel(got[:v], want[-v:])))
    print(f"{name}: rel. error of the logits {rows[-1]['rel_err_logits']:.1e}", flush=True)
    rep = repeated(by_phase, repeat)
    rep(x, *per_layer, head_units).block_until_ready()
    calls[name] = lambda: rep(x, *per_layer, head_units)
    # calibration: XLA reading the same bytes, as a sum per matrix (5 reductions) and as the chain
    # of 65 bf16 GEMVs, one launch each
    xla_sum = repeated(lambda x, *w: x[:1] + sum(jnp.sum(a, dtype=jnp.float32) for a in w), repeat)
    xla_chain = repeated(lambda x, *w: reference_chain(x, *w, precision=None), repeat)
    fns = {"XLA: sum of every weight (5 reductions)": xla_sum,
           "XLA: the chain, one GEMV launch per phase": xla_chain}
    if whole_tiles:
        def old(x, *w):
            x8 = jnp.zeros((bws.ROWS, x.shape[0]), jnp.bfloat16).at[0].set(x.astype(jnp.bfloat16))
            return bws.stream_layers(x8, *w, ctas=ctas, stages=3)[-1][0].astype(jnp.float32)
        fns["stream_layers (whole tiles per CTA)"] = repeated(old, repeat)
    for name, fn in fns.items():
        fn(x, *args).block_until_ready()
        calls[name] = lambda fn=fn: fn(x, *args)
    times = time_interleaved(calls, warmup=2, reps=reps)
    out = []
    for name, ts in times.items():
        ts = np.asarray(ts) / repeat
        ms = float(np.median(ts)) * 1e3
        base = next((r for r in rows if r["variant"] == name), {})
        out.append(dict(base, model=model, variant=name, ms=ms, q1_ms=float(np.quantile(ts, 0.25)) * 1e3,
                        q3_ms=float(np.quantile(ts, 0.75)) * 1e3, pct_copy_bw=100 * nbytes / (ms * 1e-3) / bw,
                        MB=nbytes / 1e6))
    return out


def regions(trace: dict) -> dict[int, list[tuple[str, float, float]]]:
    """Per profiled warpgroup (the trace's tid): its regions in order, (name, start µs, end µs)."""
    out: dict[int, list] = {}
    open_: dict[int, list] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "B":
            open_.setdefault(e["tid"], []).append((e["name"], e["ts"]))
        else:
            name, start = open_[e["tid"]].pop()
            out.setdefault(e["tid"], []).append((name, start, e["ts"]))
    for seq in out.values():
        seq.sort(key=lambda r: r[1])
    return out


def barrier_breakdown(trace: dict) -> dict[str, float]:
    """Where a grid barrier's time goes, medians over the phases (µs), from a profiled chain:
    - drain: a CTA's wait for its last reduce-adds to be written (median CTA);
    - skew: from the median CTA's signal to the last CTA's (a signal's time: its start, when the
      CTA's writes are done; the atomic may land before the signalling thread sees it return);
    - release: from the last signal to the median CTA leaving its wait;
    - x: the median CTA's x loads (and, without lazy_x, their rounding);
    - gap: from the last CTA's signal to the median CTA's first product (release + x + the rest).
    Every CTA's consumer has the same sequence of regions: one `wait` before every phase but the
    first, and `units`, `drain` and `signal` in every phase."""
    import numpy as np

    seqs = {tid: seq for tid, seq in regions(trace).items() if any(n == "units" for n, _, _ in seq)}  # consumers

    def table(name):  # [CTA, occurrence] -> (start, end)
        rows = [[(a, b) for n, a, b in seq if n == name] for seq in seqs.values()]
        k = min(map(len, rows))
        return np.asarray([r[:k] for r in rows])  # [C, k, 2]

    drain, signal, wait, x, units = (table(n) for n in ("drain", "signal", "wait", "x", "units"))
    k = min(wait.shape[1], signal.shape[1] - 1, x.shape[1] - 1, units.shape[1] - 1)
    # phase p + 1 waits for the signals of phase p; the first `signal` is the zeroing's
    sig = signal[:, 1:k + 1, 0]  # each phase's signal, [C, k]
    last = sig.max(axis=0)
    med = lambda a: float(np.median(a))  # noqa: E731
    return dict(
        phases=k,
        drain_us=med(np.median(drain[:, :k, 1] - drain[:, :k, 0], axis=0)),
        skew_us=med(last - np.median(sig, axis=0)),
        release_us=med(np.median(wait[:, :k, 1], axis=0) - last),
        x_us=med(np.median(x[:, 1:k + 1, 1] - x[:, 1:k + 1, 0], axis=0)),
        gap_us=med(np.median(units[:, 1:k + 1, 0], axis=0) - last),
        units_us=med(np.median(units[:, :k, 1] - units[:, :k, 0], axis=0)),
    )


def profile_chain(model: str, ctas: int, block_k: int, stages: int, out_dir: str) -> list[dict]:
    """One profiled run of the grid-barrier chain each way (lazy_x off and on; x by TMA or by
    loads): barrier_breakdown."""
    import bench_weight_stream as bws

    shapes = bws.model_chain_shapes(model)
    keys = iter(jax.random.split(jax.random.key(0), len(shapes) + 1))
    ws = [unit_major((jax.random.normal(next(keys), s, jnp.float32) / s[-1] ** 0.5).astype(jnp.bfloat16), block_k)
          for s in shapes.values()]
    x = jax.random.normal(next(keys), (shapes["qkv"][-1],), jnp.float32)
    rows = []
    for lazy, loads in ((False, "tma"), (True, "tma"), (True, "ld")):
        d = Path(out_dir) / f"{model}_bk{block_k}_s{stages}{'_lazy_x' if lazy else ''}_{loads}"
        d.mkdir(parents=True, exist_ok=True)
        fn = jax.jit(functools.partial(stream_k_chain, ctas=ctas, block_k=block_k, stages=stages, lazy_x=lazy,
                                       x_loads=loads, shapes=shapes, profile_dir=str(d)))
        fn(x, *ws).block_until_ready()
        jax.effects_barrier()
        trace = json.loads(sorted(d.glob("*-trace.json"))[-1].read_text())
        rows.append(dict(model=model, lazy_x=lazy, x_loads=loads, block_k=block_k, stages=stages,
                         **barrier_breakdown(trace)))
        print("profile", json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | kernel | ms per chain (quartiles) | % of copy BW | rel. error vs XLA: first phase / logits |",
             "|---|---|---|---|---|"]
    for r in rows:
        err = (f"{r['rel_err_first_phase']:.1e} / {r['rel_err_logits']:.1e}" if "rel_err_logits" in r else "")
        lines.append(f"| {r['model']} | {r['variant']} | {r['ms']:.3f} ({r['q1_ms']:.3f}-{r['q3_ms']:.3f}) | "
                     f"{r['pct_copy_bw']:.1f}% | {err} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b")
    p.add_argument("--configs", default="256,4", help="'block_k,stages;...' of the stream-K kernel")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=10, help="chains back to back per timed call (`repeated`)")
    p.add_argument("--ctas", type=int, default=0, help="persistent CTAs (0: the SM count)")
    p.add_argument("--no-whole-tiles", action="store_true", help="leave out bench_weight_stream's stream_layers")
    p.add_argument("--out", default=None, help="write the rows as JSON and the table as markdown here (a prefix)")
    p.add_argument("--profile", default="", help="a directory: instead of timing, profile one chain of the first "
                   "config with Mosaic GPU's on-device profiler, with and without lazy_x (barrier_breakdown)")
    args = p.parse_args(argv)

    if args.profile:
        block_k, stages = map(int, args.configs.split(";")[0].split(","))
        for model in args.models.split(","):
            profile_chain(model, args.ctas or jax.devices()[0].core_count, block_k, stages, args.profile)
        return

    from bench_attention import header
    from bench_decode import measure_bandwidth

    bw = max(measure_bandwidth(1 << 30).values())
    print(header(), f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    configs = [tuple(map(int, c.split(","))) for c in args.configs.split(";")]
    rows = []
    for model in args.models.split(","):
        rows += measure_model(model, args.reps, bw, args.ctas or jax.devices()[0].core_count, configs,
                              whole_tiles=not args.no_whole_tiles, repeat=args.repeat)
    for r in rows:
        r["copy_TBps"], r["device"] = bw / 1e12, jax.devices()[0].device_kind
        print("row", json.dumps(r), flush=True)
    md = table(rows)
    print(md)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(rows, indent=1))
        Path(f"{args.out}.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
