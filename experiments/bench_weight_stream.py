"""Does a persistent kernel keep the weight stream going across dependent phases (Mosaic GPU)?

    PYTHONPATH=.:experiments python3 experiments/bench_weight_stream.py [--shapes "8192,512,16;8192,2048,16"]

The question behind it (docs/decoding.md, "Fourteenth session"): at batch 1 the decoder's step is
a chain of dependent projections, and every kernel boundary costs a start and a tail during which
no weights stream. The ninth session's grid barrier (Pallas Triton) was no cheaper than a
boundary, but its kernel streamed weights at 0.5-2.6 TB/s and waited at the barrier before
loading anything. Here the weights stream by TMA from a producer warpgroup that never waits at
a barrier: weights do not depend on the activations, so its ring keeps filling while the
consumer waits for the previous phase. If that hides the barrier, a decode step written as one
persistent kernel ("megakernel") could reach the bandwidth the separate kernels cannot.

The chain: `phases` projections y_l = x_l W_lᵀ with W_l [N, K] bf16, x_0 [8, K] (batch 1 padded
to 8 rows), x_(l+1) = the first K columns of y_l. One CTA per 64 output rows (N / 64 CTAs, all
resident), each streaming its rows of every W_l through a `stages`-slot ring.
- `persistent`: one kernel for all phases. Between phases each CTA writes its [8, 64] tile of y_l
  by TMA, waits for the store, signals a global semaphore, and waits until all CTAs have signalled
  before loading x_(l+1).
- `separate`: the same kernel with one phase, launched once per phase (what the decoder does:
  the boundaries are kernel boundaries inside XLA's command buffer).
Both run the same arithmetic in the same order, so their outputs must be equal bit for bit; the
first phase is also checked against XLA. Timed interleaved (bench_attention.time_interleaved);
reported: µs per phase, the weight bytes' share of the copy bandwidth measured in the same
process, and separate / persistent.

`--models 1b` does the same for a preset's whole batch-1 GEMV chain (q/k/v, output, gate/up and
down per layer, then the head; attention, norms, RoPE and the SwiGLU left out): `stream_layers`,
one kernel that loops over the layers (an unrolled kernel of the 1b's 65 phases took 4 min 18 s
to compile on the GPU machine), against one launch per phase.

The global semaphores have no interpret mode. tests/test_bench_weight_stream.py lowers both
kernels for sm_90 on the CPU, and runs them in Pallas' GPU interpreter where no barrier is needed:
one phase, and the layer chain with one CTA (which then computes every tile in order).
"""

from __future__ import annotations

import argparse
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

ROWS = 8  # activation rows (a TMA box of one 8-row tile)
BLOCK_F = 64  # output rows per CTA (wgmma M)


def _body(x_ref, w_ref, y_ref, x_smem, w_ring, out_smem, x_full, w_full, free, *, phases: int, k: int,
          block_k: int, stages: int, ctas: int, barrier: bool, interpret: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    steps = k // block_k
    total = phases * steps
    f0 = lax.axis_index("f") * BLOCK_F
    wg = lax.axis_index("wg")
    sync = barrier and phases > 1
    # zeroed per call (an XLA memset before the kernel, so only where there is something to wait for)
    done = pl.get_global(plgpu.SemaphoreType.REGULAR((phases - 1,))) if sync else None

    @pl.when(wg == 0)
    def _consumer():
        def load_x(src):  # x_l in block_k-column chunks, each to its own slot and barrier
            for j in range(steps):
                plgpu.copy_gmem_to_smem(src.at[:, pl.ds(j * block_k, block_k)], x_smem.at[j], x_full.at[j])

        @pl.loop(0, phases)
        def _phase(p):
            @pl.when(p == 0)
            def _():
                load_x(x_ref)

            if phases > 1:  # (one phase: y may be narrower than x, and is never read)
                @pl.when(p > 0)
                def _():  # every CTA's tile of y_(p-1) is written: then x_p = its first K columns
                    if sync:
                        plgpu.semaphore_wait(done.at[p - 1], ctas, decrement=False, memory_scope="gpu")
                    load_x(y_ref.at[p - 1])

            acc = _tile_product(steps, p * steps, stages, w_ring, x_smem, w_full, free, x_full=x_full,
                                interpret=interpret)
            _store_tile(acc, out_smem, y_ref.at[p, :, pl.ds(f0, BLOCK_F)])

            if sync:
                @pl.when(p + 1 < phases)
                def _():
                    plgpu.semaphore_signal(done.at[p], 1, memory_scope="gpu")

    @pl.when(wg == 1)
    def _producer():  # the weights of every phase, back to back: they depend on no activation
        @pl.loop(0, total)
        def _fetch(g):
            slot = lax.rem(g, stages)

            @pl.when(g >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])
            p, j = g // steps, lax.rem(g, steps)
            plgpu.copy_gmem_to_smem(w_ref.at[p, pl.ds(f0, BLOCK_F), pl.ds(j * block_k, block_k)], w_ring.at[slot],
                                    w_full.at[slot])

        @pl.loop(max(total - stages, 0), total)
        def _drain(g):
            plgpu.barrier_wait(free.at[lax.rem(g, stages)])


@functools.partial(jax.jit, static_argnames=("block_k", "stages", "barrier", "interpret"))
def stream_phases(x, w, *, block_k: int = 256, stages: int = 4, barrier: bool = True, interpret: bool = False):
    """y [phases, 8, N]: y_0 = x[:, :K] W_0ᵀ, y_l = y_(l-1)[:, :K] W_lᵀ, for w [phases, N, K] and x [8, >= K].

    barrier=False leaves out the wait between phases: the outputs are then wrong (a phase may
    read its x before it is written), but the time is the kernel's streaming ceiling. interpret:
    Pallas' GPU interpreter (one phase, or barrier=False: it has no global semaphores)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    phases, n, k = w.shape
    if x.shape[0] != ROWS or x.shape[1] < k or (phases > 1 and n < k):
        raise ValueError(f"x must be [{ROWS}, >= K={k}] and, to chain phases, N={n} >= K; got x {x.shape}")
    if n % BLOCK_F or k % block_k or block_k % 64:
        raise ValueError(f"N={n} must be a multiple of {BLOCK_F}, K={k} of block_k={block_k}, block_k of 64")
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    steps = k // block_k
    scratch = (
        plgpu.SMEM((steps, ROWS, block_k), x.dtype, transforms=tiled),  # x_l, in chunks
        plgpu.SMEM((stages, BLOCK_F, block_k), w.dtype, transforms=tiled),  # the weight ring
        plgpu.SMEM((ROWS, BLOCK_F), x.dtype),
        plgpu.Barrier(num_barriers=steps),  # x chunk landed
        plgpu.Barrier(num_barriers=stages),  # weight tile landed
        plgpu.Barrier(num_barriers=stages),  # slot free
    )
    ctas = n // BLOCK_F
    return plgpu.kernel(
        functools.partial(_body, phases=phases, k=k, block_k=block_k, stages=stages, ctas=ctas, barrier=barrier,
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct((phases, ROWS, n), x.dtype),
        scratch_types=scratch,
        grid=(ctas,),
        grid_names=("f",),
        num_threads=2,
        thread_name="wg",
        interpret=interpret_params(interpret),
    )(x, w)


def _tile_product(steps: int, first_step, stages: int, w_ring, x_smem, w_full, free, x_full=None,
                  interpret: bool = False):
    """acc [64, 8] = (the CTA's weight tile) xᵀ over `steps` ring slots from global step
    `first_step` on: wait for each weight tile (and x chunk, with x_full), one wgmma (a dot of the
    same operands in interpret mode, which has no wgmma), free the slot."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def step(j, acc):
        slot = lax.rem(first_step + j, stages)
        if x_full is not None:
            plgpu.barrier_wait(x_full.at[j])
        plgpu.barrier_wait(w_full.at[slot])
        acc = tile_product(acc, w_ring.at[slot], x_smem.at[j], interpret)
        plgpu.barrier_arrive(free.at[slot])
        return acc

    return lax.fori_loop(0, steps, step, zero_acc(interpret))


def zero_acc(interpret: bool):
    """A zero [64, 8] f32 accumulator, in the wgmma layout on the GPU."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    acc0 = jnp.zeros((BLOCK_F, ROWS), jnp.float32)
    return acc0 if interpret else plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)


def tile_product(acc, w_tile, x_tile, interpret: bool):
    """acc + w_tile x_tileᵀ for a [64, block_k] weight tile and an [8, block_k] x tile in shared
    memory: one wgmma (a dot of the same operands in interpret mode, which has no wgmma)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpret:
        return acc + jnp.dot(w_tile[...], x_tile[...].T, preferred_element_type=jnp.float32)

    def issue(acc_ref):
        plgpu.wgmma(acc_ref, w_tile, x_tile.T)

    return pl.run_state(issue)(plgpu.ACC.init(acc))


def _store_tile(acc, out_smem, dst):
    """The [64, 8] accumulator as [8, 64] rows of y, by TMA, waited until written (not only read
    out of shared memory): another CTA may read it next."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    out_smem.T[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)


# The phases of one layer in the layer-looped chain: (name, which output feeds x).
LAYER_PHASES = ("qkv", "out", "gate_up", "down")


def _layers_body(x_ref, wq, wo, wgu, wd, wh, yq, yo, ygu, yd, yh, x_smem, w_ring, out_smem, x_full, w_full, free, *,
                 layers: int, block_k: int, stages: int, ctas: int, sync: bool, interpret: bool):
    """A preset's batch-1 GEMV chain as one kernel, looping over layers (an unrolled 65-phase
    kernel took 4 min 18 s to compile on the GPU machine). Per layer: q/k/v (x = the previous
    layer's down output, or the input), output (x = q/k/v's first D columns), gate/up (x = the
    output projection's), down (x = gate/up's first F columns); then the head. CTA c takes the
    64-row tiles c, c + ctas, ... of each phase; narrow phases leave CTAs idle (no K splits)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c = lax.axis_index("f")
    wg = lax.axis_index("wg")
    done = pl.get_global(plgpu.SemaphoreType.REGULAR((4 * layers,))) if sync else None
    weights = dict(qkv=wq, out=wo, gate_up=wgu, down=wd)
    outputs = dict(qkv=yq, out=yo, gate_up=ygu, down=yd)

    def tiles(w):
        return w.shape[-2] // BLOCK_F

    def max_items(w):
        return -(-tiles(w) // ctas)

    def steps_of(w):
        return w.shape[-1] // block_k

    def phase_consumer(g, n_tiles, steps, wait_for, load_x, dst):
        """One phase for this CTA: wait for the phase before, load x, its tiles; returns g."""
        if sync and wait_for is not None:
            wait_for()

        @pl.when(c < n_tiles)
        def _():
            load_x()
            for j in range(steps):
                plgpu.barrier_wait(x_full.at[j])

        def item(i, g):
            t = c + i * ctas

            @pl.when(t < n_tiles)
            def _():
                acc = _tile_product(steps, g, stages, w_ring, x_smem, w_full, free, interpret=interpret)
                _store_tile(acc, out_smem, dst(t))

            return g + jnp.where(t < n_tiles, steps, 0)

        return lax.fori_loop(0, -(-n_tiles // ctas), item, g)

    def x_loader(src, steps):
        def load():
            for j in range(steps):
                plgpu.copy_gmem_to_smem(src.at[:, pl.ds(j * block_k, block_k)], x_smem.at[j], x_full.at[j])
        return load

    def wait(index):
        return lambda: plgpu.semaphore_wait(done.at[index], ctas, decrement=False, memory_scope="gpu")

    def signal(index):
        if sync:
            plgpu.semaphore_signal(done.at[index], 1, memory_scope="gpu")

    @pl.when(wg == 0)
    def _consumer():
        def layer(l, g):
            for k, name in enumerate(LAYER_PHASES):
                w, y = weights[name], outputs[name]
                steps = steps_of(w)
                if k == 0:  # x: the input, or the previous layer's down output
                    def load(l=l, steps=steps):
                        @pl.when(l == 0)
                        def _():
                            x_loader(x_ref, steps)()

                        @pl.when(l > 0)
                        def _():
                            x_loader(yd.at[jnp.maximum(l - 1, 0)], steps)()

                    def wait_prev(l=l):
                        @pl.when(l > 0)
                        def _():
                            wait(4 * l - 1)()
                else:
                    load = x_loader(outputs[LAYER_PHASES[k - 1]].at[l], steps)
                    wait_prev = wait(4 * l + k - 1)
                g = phase_consumer(g, tiles(w), steps, wait_prev, load,
                                   lambda t, y=y, l=l: y.at[l, :, pl.ds(t * BLOCK_F, BLOCK_F)])
                signal(4 * l + k)
            return g

        g = lax.fori_loop(0, layers, layer, jnp.int32(0))
        phase_consumer(g, tiles(wh), steps_of(wh), wait(4 * layers - 1),
                       x_loader(yd.at[layers - 1], steps_of(wh)), lambda t: yh.at[:, pl.ds(t * BLOCK_F, BLOCK_F)])

    @pl.when(wg == 1)
    def _producer():  # every phase's weight tiles, back to back: they depend on no activation
        def stream(g, n_tiles, steps, src):
            def item(i, g):
                t = c + i * ctas

                @pl.when(t < n_tiles)
                def _():
                    @pl.loop(0, steps)
                    def _fetch(j):
                        slot = lax.rem(g + j, stages)

                        @pl.when(g + j >= stages)
                        def _():
                            plgpu.barrier_wait(free.at[slot])
                        plgpu.copy_gmem_to_smem(src(t, j), w_ring.at[slot], w_full.at[slot])

                return g + jnp.where(t < n_tiles, steps, 0)

            return lax.fori_loop(0, -(-n_tiles // ctas), item, g)

        def tile_src(w, l):
            return lambda t, j: w.at[l, pl.ds(t * BLOCK_F, BLOCK_F), pl.ds(j * block_k, block_k)]

        def layer(l, g):
            for name in LAYER_PHASES:
                w = weights[name]
                g = stream(g, tiles(w), steps_of(w), tile_src(w, l))
            return g

        g = lax.fori_loop(0, layers, layer, jnp.int32(0))
        g = stream(g, tiles(wh), steps_of(wh),
                   lambda t, j: wh.at[pl.ds(t * BLOCK_F, BLOCK_F), pl.ds(j * block_k, block_k)])

        @pl.loop(0, stages)
        def _drain(i):  # the last `stages` releases (fewer if the CTA streamed fewer tiles)
            @pl.when(g - stages + i >= 0)
            def _():
                plgpu.barrier_wait(free.at[lax.rem(g - stages + i, stages)])


def chain_smem_bytes(max_k: int, block_k: int, stages: int) -> int:
    """Shared memory of stream_layers: all of x (bf16, 8 rows), the weight ring, the output tile
    and the barriers (8 bytes each)."""
    return ROWS * max_k * 2 + stages * BLOCK_F * block_k * 2 + ROWS * BLOCK_F * 2 + 8 * (max_k // block_k + 2 * stages)


def stream_layers(x, wq, wo, wgu, wd, wh, *, ctas: int, block_k: int = 256, stages: int = 3, barrier: bool = True,
                  interpret: bool = False):
    """The GEMV chain of `layers` decoder layers and the head as one kernel of `ctas` resident CTAs
    (`_layers_body`); w* stacked per layer [L, N, K] (wh [V, D]). Returns (yq, yo, ygu, yd, yh).
    interpret (Pallas' GPU interpreter, CPU tests) needs barrier=False (it has no global
    semaphores) and runs the CTAs one after another, so only ctas=1 computes the chain right."""
    if interpret and barrier:
        raise ValueError("stream_layers: interpret mode has no global semaphores; pass barrier=False (and ctas=1)")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    layers, _, d = wq.shape
    shapes = dict(qkv=wq.shape[1:], out=wo.shape[1:], gate_up=wgu.shape[1:], down=wd.shape[1:], head=wh.shape)
    widths = dict(qkv=x.shape[1], out=wq.shape[1], gate_up=wo.shape[1], down=wgu.shape[1], head=wd.shape[1])
    for name, (n, k) in shapes.items():
        if n % BLOCK_F or k % block_k or k > widths[name] or (name == "qkv" and k > wd.shape[1]):
            raise ValueError(f"{name}: W {n}x{k} needs N a multiple of {BLOCK_F}, K of block_k={block_k}, and K "
                             f"<= the width of the output before it ({widths[name]})")
    max_k = max(k for _, k in shapes.values())
    if (need := chain_smem_bytes(max_k, block_k, stages)) > SMEM_BYTES:
        raise ValueError(f"x (K up to {max_k}) and {stages} ring slots need {need} bytes of shared memory, more "
                         f"than {SMEM_BYTES}: fewer stages or a smaller block_k")
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (plgpu.SMEM((max_k // block_k, ROWS, block_k), x.dtype, transforms=tiled),
               plgpu.SMEM((stages, BLOCK_F, block_k), x.dtype, transforms=tiled),
               plgpu.SMEM((ROWS, BLOCK_F), x.dtype),
               plgpu.Barrier(num_barriers=max_k // block_k), plgpu.Barrier(num_barriers=stages),
               plgpu.Barrier(num_barriers=stages))
    out = tuple(jax.ShapeDtypeStruct((layers, ROWS, w.shape[1]), x.dtype) for w in (wq, wo, wgu, wd))
    return plgpu.kernel(
        functools.partial(_layers_body, layers=layers, block_k=block_k, stages=stages, ctas=ctas, sync=barrier,
                          interpret=interpret),
        out_type=(*out, jax.ShapeDtypeStruct((ROWS, wh.shape[0]), x.dtype)),
        scratch_types=scratch, grid=(ctas,), grid_names=("f",), num_threads=2, thread_name="wg",
        interpret=interpret_params(interpret),
    )(x, wq, wo, wgu, wd, wh)


def model_chain_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """A preset's batch-1 decode GEMVs (attention, norms, RoPE and the SwiGLU left out), stacked
    per layer: q/k/v, output, gate/up (both halves as one matrix), down; and the head."""
    from bench_decode import preset

    m = preset(model)
    d, f, hd, n = m.hidden_size, m.mlp_dim, m.resolved_head_dim, m.num_layers
    return dict(qkv=(n, (m.num_heads + 2 * m.num_kv_heads) * hd, d), out=(n, d, d), gate_up=(n, 2 * f, d),
                down=(n, d, f), head=(m.vocab_size, d))


def measure_model_chain(model: str, reps: int, bw: float, ctas: int, block_k: int, stages: int,
                        repeat: int = 10) -> dict:
    """The model's GEMV chain as one persistent kernel, without the barrier, and one launch per
    phase (stream_phases, per-layer weight copies so no slice runs in between)."""
    import numpy as np

    from bench_attention import time_interleaved

    shapes = model_chain_shapes(model)
    max_k = max(s[-1] for s in shapes.values())
    while stages > 2 and chain_smem_bytes(max_k, block_k, stages) > SMEM_BYTES:
        stages -= 1  # all of x stays in shared memory: the 1b's down (K = 8192) leaves room for 3 slots
    keys = iter(jax.random.split(jax.random.key(0), len(shapes) + 1))
    ws = {name: (jax.random.normal(next(keys), s, jnp.float32) / s[-1] ** 0.5).astype(jnp.bfloat16)
          for name, s in shapes.items()}
    d = shapes["qkv"][-1]
    x = jnp.zeros((ROWS, d), jnp.bfloat16).at[0].set(jax.random.normal(next(keys), (d,), jnp.bfloat16))
    per_layer = {name: [w[l][None] for l in range(w.shape[0])] for name, w in ws.items() if name != "head"}
    args = [ws[n] for n in ("qkv", "out", "gate_up", "down", "head")]
    kw = dict(block_k=block_k, stages=stages)
    persistent = jax.jit(lambda x, *w: stream_layers(x, *w, ctas=ctas, **kw)[-1])
    unsynced = jax.jit(lambda x, *w: stream_layers(x, *w, ctas=ctas, barrier=False, **kw)[-1])

    @jax.jit
    def separate(x, per_layer, head):
        for l in range(len(per_layer["qkv"])):
            for name in LAYER_PHASES:
                x = stream_phases(x, per_layer[name][l], **kw)[0]
        return stream_phases(x, head[None], **kw)[0]

    t0 = time.perf_counter()
    out_p = np.asarray(persistent(x, *args), np.float32)
    print(f"{model}: the persistent chain compiled and ran in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    out_s = np.asarray(separate(x, per_layer, ws["head"]), np.float32)
    print(f"{model}: one launch per phase compiled and ran in {time.perf_counter() - t0:.1f} s", flush=True)
    rp, ru, rs = repeated(persistent, repeat), repeated(unsynced, repeat), repeated(separate, repeat)
    for f, a in ((rp, args), (ru, args), (rs, (per_layer, ws["head"]))):
        f(x, *a).block_until_ready()
    times = time_interleaved({"persistent": lambda: rp(x, *args), "separate": lambda: rs(x, per_layer, ws["head"]),
                              "no_barrier": lambda: ru(x, *args)}, warmup=2, reps=reps)
    times = {name: [t / repeat for t in ts] for name, ts in times.items()}
    nbytes = sum(int(np.prod(s)) * 2 for s in shapes.values())
    row = dict(model=model, phases=4 * shapes["qkv"][0] + 1, ctas=ctas, block_k=block_k, stages=stages,
               MB=nbytes / 1e6, persistent_equals_separate=bool(np.array_equal(out_p, out_s)))
    for name, ts in times.items():
        ms = float(np.median(ts)) * 1e3
        row[f"ms_{name}"] = ms
        row[f"pct_bw_{name}"] = 100 * nbytes / (ms * 1e-3) / bw
    return row


def chain_persistent(x, w_stacked, **kw):
    return stream_phases(x, w_stacked, **kw)[-1]


def chain_separate(x, ws, **kw):
    for w in ws:  # each [1, N, K]: one phase per launch
        x = stream_phases(x, w, **kw)[0]
    return x


def reference_first_phase(x, w0):
    """y_0 in XLA: f32 products of the bf16 inputs, rounded to bf16 as the kernel stores."""
    k = w0.shape[1]
    return jnp.einsum("bk,nk->bn", x[:, :k].astype(jnp.float32), w0.astype(jnp.float32)).astype(x.dtype)


def repeated(fn, times: int):
    """fn(x, *w) `times` times back to back in one jitted call, each run's x depending on the run
    before (a zero-weighted add of the sum of its whole output: one element would let XLA slice
    an XLA-only fn down to the part that element needs), so XLA neither merges, overlaps nor
    trims them. Returns the last x. The cost of a call outside its kernels (0.2-0.3 ms on a ~1 ms chain,
    docs/decoding.md, "Fifteenth session") is then paid once per `times` runs, as a decode loop
    pays it."""
    if times < 1:
        raise ValueError(f"repeat must be >= 1, got {times}")

    @jax.jit
    def run(x, *w):
        def body(i, x):
            return x + (jnp.sum(fn(x, *w), dtype=jnp.float32) * 0).astype(x.dtype)
        return lax.fori_loop(0, times, body, x)
    return run


def measure(n: int, k: int, phases: int, reps: int, block_k: int, stages: int, bw: float,
            repeat: int = 10) -> dict:
    import numpy as np

    from bench_attention import ratio_stats, time_interleaved

    keys = jax.random.split(jax.random.key(0), phases + 1)
    # 1/sqrt(K) keeps the chained activations at scale ~1; rows 1-7 are the batch padding (zeros)
    ws = [(jax.random.normal(key, (1, n, k), jnp.float32) / k**0.5).astype(jnp.bfloat16) for key in keys[1:]]
    stacked = jnp.concatenate(ws)
    x = jnp.zeros((ROWS, k), jnp.bfloat16).at[0].set(jax.random.normal(keys[0], (k,), jnp.bfloat16))
    kw = dict(block_k=block_k, stages=stages)
    persistent = jax.jit(functools.partial(chain_persistent, **kw))
    unsynced = jax.jit(functools.partial(chain_persistent, barrier=False, **kw))
    separate = jax.jit(functools.partial(chain_separate, **kw))
    out_p, out_s = (np.asarray(f(x, a), np.float32) for f, a in ((persistent, stacked), (separate, ws)))
    first = np.asarray(stream_phases(x, ws[0], **kw)[0], np.float32)[0]
    want = np.asarray(reference_first_phase(x, ws[0][0]), np.float32)[0]
    row = dict(N=n, K=k, phases=phases, ctas=n // BLOCK_F, block_k=block_k, stages=stages,
               MB_per_phase=n * k * 2 / 1e6, persistent_equals_separate=bool(np.array_equal(out_p, out_s)),
               rel_err_first_phase=float(np.linalg.norm(first - want) / max(np.linalg.norm(want), 1e-30)),
               nonzero_output=bool(np.abs(out_p[0]).max() > 0))
    # each timed call runs the chain `repeat` times (the per-call cost outside the kernel, 0.2-0.3
    # ms measured in the fifteenth session, is then paid once per `repeat` chains)
    rp, rs, ru = (repeated(f, repeat) for f in (persistent, separate, unsynced))
    for f, a in ((rp, stacked), (rs, ws), (ru, stacked)):
        f(x, a).block_until_ready()
    times = time_interleaved({"persistent": lambda: rp(x, stacked), "separate": lambda: rs(x, ws),
                              "no_barrier": lambda: ru(x, stacked)}, warmup=2, reps=reps)
    times = {name: [t / repeat for t in ts] for name, ts in times.items()}
    for name in ("persistent", "separate", "no_barrier"):
        us = float(np.median(times[name])) / phases * 1e6
        row[f"us_per_phase_{name}"] = us
        row[f"pct_bw_{name}"] = 100 * n * k * 2 / (us * 1e-6) / bw
    row["separate_over_persistent"], row["q1"], row["q3"] = ratio_stats(times["separate"], times["persistent"])
    return row


def single_launches(n: int, k: int, reps: int, bw: float, chain: int = 20) -> list[str]:
    """One phase per launch, for scale: this kernel against the decoder's TMA head kernel
    (decode_tma.norm_matmul_tma, the same ring with one weight half) and XLA's product, each
    `chain` times in one jitted call, a scalar dependency (a tiny XLA kernel) between them."""
    import numpy as np

    from bench_attention import time_interleaved
    from scaling.kernels import decode_tma

    w = (jax.random.normal(jax.random.key(1), (1, n, k), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    x = jnp.zeros((ROWS, k), jnp.bfloat16).at[0].set(1.0)

    def chained(f):
        @jax.jit
        def run(x, w):
            acc = jnp.float32(0)
            for _ in range(chain):
                acc = acc + f(x, w).astype(jnp.float32)[0, 0]
                x = x + (acc * 0).astype(x.dtype)  # each launch waits for the one before
            return acc
        return run

    fns = {"stream_phases (this kernel, one phase)": chained(lambda x, w: stream_phases(x, w)[0]),
           "decode_tma.norm_matmul_tma": chained(lambda x, w: decode_tma.norm_matmul_tma(x, w[0], eps=1e-5)),
           "XLA einsum": chained(lambda x, w: jnp.einsum("bk,nk->bn", x, w[0]))}
    times = time_interleaved({name: (lambda f=f: f(x, w)) for name, f in fns.items()}, warmup=2, reps=reps)
    out = []
    for name, ts in times.items():
        us = float(np.median(ts)) / chain * 1e6
        out.append(f"| {n} | {k} | {n * k * 2 / 1e6:.1f} | {name} | {us:.2f} | {100 * n * k * 2 / (us * 1e-6) / bw:.0f}% |")
    return out


def table(rows: list[dict]) -> str:
    lines = ["| N | K | phases | CTAs | stages | MB per phase | µs per phase, separate | persistent | persistent "
             "without the barrier | separate / persistent (quartiles) | % of copy BW separate / persistent / "
             "without the barrier | outputs equal | first phase vs XLA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['N']} | {r['K']} | {r['phases']} | {r['ctas']} | {r['stages']} | {r['MB_per_phase']:.1f} | "
            f"{r['us_per_phase_separate']:.2f} | {r['us_per_phase_persistent']:.2f} | "
            f"{r['us_per_phase_no_barrier']:.2f} | {r['separate_over_persistent']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) | "
            f"{r['pct_bw_separate']:.0f}% / {r['pct_bw_persistent']:.0f}% / {r['pct_bw_no_barrier']:.0f}% | "
            f"{r['persistent_equals_separate']} | "
            f"{r['rel_err_first_phase']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8192,512,32;8192,1024,32;8192,2048,16;4096,2048,16",
                   help="'N,K,phases[,stages];...' (N / 64 CTAs, all resident: N <= 64 x the SM count)")
    p.add_argument("--block-k", type=int, default=256)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=10, help="chains back to back per timed call (`repeated`)")
    p.add_argument("--single", default="", help="'N,K;...': also time one launch per phase of this kernel, "
                   "the decoder's TMA head kernel and XLA (single_launches)")
    p.add_argument("--models", default="", help="'1b,llama2_7b': also time each preset's whole batch-1 GEMV "
                   "chain (model_chain_shapes) as one persistent kernel and as one launch per phase")
    p.add_argument("--ctas", type=int, default=0, help="persistent CTAs for --models (0: the SM count)")
    p.add_argument("--out", default=None, help="write the rows as JSON and the table as markdown here (a prefix)")
    args = p.parse_args(argv)

    from bench_attention import header
    from bench_decode import measure_bandwidth

    bw = max(measure_bandwidth(1 << 30).values())
    print(header(), f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for spec in filter(None, args.shapes.split(";")):
        n, k, phases, *st = map(int, spec.split(","))
        if n // BLOCK_F > jax.devices()[0].core_count:
            raise SystemExit(f"--shapes: N={n} needs {n // BLOCK_F} resident CTAs, more than the "
                             f"{jax.devices()[0].core_count} SMs")
        row = measure(n, k, phases, args.reps, args.block_k, st[0] if st else args.stages, bw, args.repeat)
        row["copy_TBps"], row["device"] = bw / 1e12, jax.devices()[0].device_kind
        print("row", json.dumps(row), flush=True)
        rows.append(row)
    md = table(rows)
    if args.models:
        md += ("\n\n| model | phases | MB | CTAs | ms per step: one launch per phase | one persistent kernel | "
               "without the barrier | % of copy BW | outputs equal |\n|---|---|---|---|---|---|---|---|---|\n")
        for model in args.models.split(","):
            r = measure_model_chain(model, args.reps, bw, args.ctas or jax.devices()[0].core_count,
                                    args.block_k, args.stages, args.repeat)
            print("model", json.dumps(r), flush=True)
            md += (f"| {model} | {r['phases']} | {r['MB']:.0f} | {r['ctas']} | {r['ms_separate']:.3f} | "
                   f"{r['ms_persistent']:.3f} | {r['ms_no_barrier']:.3f} | {r['pct_bw_separate']:.0f}% / "
                   f"{r['pct_bw_persistent']:.0f}% / {r['pct_bw_no_barrier']:.0f}% | {r['persistent_equals_separate']} |\n")
    if args.single:
        md += ("\n\n| N | K | MB | one launch per phase | µs | % of copy BW |\n|---|---|---|---|---|---|\n"
               + "\n".join(line for spec in args.single.split(";")
                           for line in single_launches(*map(int, spec.split(",")), args.reps, bw)))
    print(md)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(rows, indent=1))
        Path(f"{args.out}.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
