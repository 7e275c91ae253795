"""Decode projections whose weights stream by TMA (Mosaic GPU, Hopper): the gate/up + SwiGLU.

Why (docs/decoding.md, "A TMA-fed GEMV"): on an H200 the Triton kernels of decode_gemv.py
plateau at 72-87% of the copy bandwidth for a batch-1 projection, while a kernel whose weight
tiles arrive by TMA into a shared-memory ring reached 90-100% at the large ones.

`gate_up_swiglu_tma(x8, r8, wgu)`: h = silu(n(x) Wg) * (n(x) Wu) for up to 8 rows, n the
RMSNorm: its scale is folded into wgu's rows (decode_gemv.fold_norm, as for the Triton kernel)
and its row statistic r8 = rsqrt(mean(x²) + eps) comes in (`row_rsqrt`). Per CTA, `block_f`
features of both halves:
  - a producer warpgroup streams, per ring slot, the x tile [8, block_k] and the gate and up
    weight tiles [block_f, block_k] by TMA;
  - a consumer warpgroup issues acc_g += Wg_tile x_tileᵀ and acc_u += Wu_tile x_tileᵀ on the
    tensor cores (weights as the A operand, x as B with wgmma's N = 8), both, then one wait;
  - the epilogue scales the columns by r8, applies the SwiGLU, stores the [block_f, 8] result
    transposed into shared memory and writes it by TMA as [8, block_f] of h.
Activations: x8 [8, D] in, h8 [8, F] out, row-major; rows past the batch are padding, and the
down projection (decode_gemv.matmul_residual) reads the batch rows of h8 directly.

The statistic in the kernel (r8=None, norm_eps; what the decoder's layers="pallas_tma" runs since
the tenth session): a [8, block_k] tile has no register layout that reduces along its rows, so
the producer also copies each x tile, unswizzled, into a second small ring; the consumer loads
each of its 8 rows as a warpgroup-strided vector and adds its squares elementwise (no
cross-thread work per step), and after the last step reduces each row once. With it the decoder
needs no XLA kernel before this one: its residual stream stays padded to 8 rows for the whole
step (docs/decoding.md, "Tenth session").

Programmatic dependent launch (`pdl=True`, opt-in, not yet timed): at batch 1 a projection's
time is mostly bytes, but each kernel also pays a start and a tail (docs/decoding.md). With PDL
the kernel may start while the previous one is still running: its producer fills the ring with
weight tiles (which no earlier kernel writes), then waits at `griddepcontrol.wait` until the
previous kernel's writes are visible, and only then loads x and r. Once it has issued its last
load it signals `griddepcontrol.launch_dependents`, so a next kernel that waits the same way
can start on the SMs this grid frees. Mosaic GPU marks such a kernel `mosaic_gpu.uses_pdl`; the
launch with the programmatic-serialization attribute is the runtime's. A kernel that does not
wait is launched as usual, so correctness never depends on the neighbours.

Interpret mode (CPU tests) replaces the wgmma by a dot of the same operands and leaves out the
griddepcontrol instructions; the rest is the GPU code. The reference is decode_gemv.gate_up_swiglu_reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scaling.kernels.flash_attention_mgpu import interpret_params
from scaling.kernels.flash_attention_mgpu_bwd import SMEM_BYTES  # shared memory per CTA on sm_90

ROWS = 8  # activation rows the kernels carry (a TMA box of one 8-row tile)
REDUCTION_SCRATCH = 2048  # bytes: plgpu.CompilerParams().reduction_scratch_bytes in jax 0.11.2


@dataclasses.dataclass(frozen=True)
class TmaBlocks:
    block_f: int = 64  # features per CTA, of the gate and of the up half each (wgmma M)
    block_k: int = 256  # reduction tile per ring slot
    stages: int = 3  # ring depth


DEFAULT_BLOCKS = TmaBlocks()  # what the decoder runs (experiments/decode_variants.py --tma-blocks overrides it)
DEFAULT_PDL = False  # not yet measured on a GPU (experiments/bench_pdl.py; decode_variants.py's *_tma_pdl variants)


def smem_bytes(blocks: TmaBlocks, itemsize: int = 2, in_kernel_norm: bool = False) -> int:
    """in_kernel_norm: a second, plain x tile per slot for the statistic, and no r8."""
    x_copies = 2 if in_kernel_norm else 1
    per_slot = (x_copies * ROWS + 2 * blocks.block_f) * blocks.block_k * itemsize  # x, gate, up
    r = 0 if in_kernel_norm else ROWS * 4
    # + the output tile, and the cross-warp reduction scratch Mosaic reserves by default
    # (plgpu.CompilerParams.reduction_scratch_bytes; the statistic's row sums use it)
    return blocks.stages * per_slot + blocks.block_f * ROWS * itemsize + r + REDUCTION_SCRATCH


def unsupported_reason(hidden: int, mlp_dim: int, blocks: TmaBlocks | None = None,
                       in_kernel_norm: bool = False) -> str | None:
    """Why gate_up_swiglu_tma cannot take these shapes (None: it can)."""
    blocks = blocks or DEFAULT_BLOCKS
    if blocks.block_f not in (64, 128):
        return f"block_f={blocks.block_f} must be 64 or 128 (wgmma M)"
    if blocks.block_k % 64:
        return f"block_k={blocks.block_k} must be a multiple of 64 (one swizzled tile)"
    if blocks.stages < 2:
        return f"stages={blocks.stages} must be >= 2"
    if in_kernel_norm and blocks.block_k % 128:
        return f"block_k={blocks.block_k} must be a multiple of 128 for the in-kernel statistic (a row per warpgroup load)"
    if mlp_dim % blocks.block_f:
        return f"mlp_dim {mlp_dim} is not a multiple of block_f {blocks.block_f}"
    if hidden % blocks.block_k:
        return f"hidden {hidden} is not a multiple of block_k {blocks.block_k}"
    if (need := smem_bytes(blocks, in_kernel_norm=in_kernel_norm)) > SMEM_BYTES:
        return f"the tiles need {need} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def row_rsqrt(x8, eps: float):
    """rsqrt(mean(x²) + eps) per row, f32: the RMSNorm statistic the kernel's epilogue applies."""
    x = x8.astype(jnp.float32)
    return lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)


def _kernel(*refs, blocks: TmaBlocks, d: int, f: int, interpret: bool, pdl: bool, norm_eps: float | None):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if norm_eps is None:  # r8 comes in
        (x_ref, r_ref, w_ref, o_ref, x_ring, g_ring, u_ring, r_smem, out_smem,
         x_full, g_full, u_full, free, r_full) = refs
    else:  # the statistic from plain copies of the x tiles (xp_ring)
        (x_ref, w_ref, o_ref, x_ring, g_ring, u_ring, xp_ring, out_smem,
         x_full, g_full, u_full, free, xp_full) = refs
    bf, bk, stages = blocks.block_f, blocks.block_k, blocks.stages
    steps = d // bk
    f0 = lax.axis_index("f") * bf
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _consumer():
        def products(accs, a_refs, b_ref):
            """acc_i += a_i bᵀ for each i: the wgmmas issued together, one wait."""
            if interpret:  # the interpreter has no wgmma: dots of the same operands
                return tuple(acc + jnp.dot(a[...], b_ref[...].T, preferred_element_type=jnp.float32)
                             for acc, a in zip(accs, a_refs))

            def issue(acc_refs):
                for acc_ref, a in zip(acc_refs, a_refs):
                    plgpu.wgmma(acc_ref, a, b_ref.T)

            return pl.run_state(issue)(tuple(plgpu.ACC.init(a) for a in accs))

        def squares(ss, slot):
            """ss += x² of the slot's plain x tile: one [block_k] array per row (a [8, block_k]
            tile has no register layout that reduces along its rows; each row's sum is one full
            reduction at the end). Every thread adds only its own elements here."""
            plgpu.barrier_wait(xp_full.at[slot])
            if interpret:
                return ss + jnp.square(xp_ring.at[slot][...].astype(jnp.float32))
            strided = plgpu.Layout.WG_STRIDED((bk,), vec_size=bk // 128)
            return tuple(acc + jnp.square(plgpu.load(xp_ring.at[slot, b], (), layout=strided).astype(jnp.float32))
                         for b, acc in enumerate(ss))

        def step(j, carry):
            accs, ss = carry
            slot = lax.rem(j, stages)
            for bar in (x_full, g_full, u_full):
                plgpu.barrier_wait(bar.at[slot])
            accs = products(accs, (g_ring.at[slot], u_ring.at[slot]), x_ring.at[slot])
            if norm_eps is not None:
                ss = squares(ss, slot)
            plgpu.barrier_arrive(free.at[slot])
            return accs, ss

        acc0 = jnp.zeros((bf, ROWS), jnp.float32)
        if not interpret:
            acc0 = plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)
        ss0 = ()
        if norm_eps is not None and interpret:
            ss0 = jnp.zeros((ROWS, bk), jnp.float32)
        elif norm_eps is not None:
            ss0 = tuple(plgpu.layout_cast(jnp.zeros((bk,), jnp.float32), plgpu.Layout.WG_STRIDED((bk,), vec_size=bk // 128))
                        for _ in range(ROWS))
        (acc_g, acc_u), ss = lax.fori_loop(0, steps, step, ((acc0, acc0), ss0))
        if norm_eps is None:
            plgpu.barrier_wait(r_full)
            r = r_smem[...] if interpret else plgpu.load(r_smem, layout=plgpu.Layout.WGMMA.reduce(0))
        elif interpret:
            r = lax.rsqrt(ss.sum(axis=1) / d + norm_eps)
        else:  # r[b] from row b's sum, placed in the layout that broadcasts over acc's columns
            row = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
            r = jnp.zeros((ROWS,), jnp.float32)
            for b, acc in enumerate(ss):
                r = jnp.where(row == b, lax.rsqrt(jnp.sum(acc) / d + norm_eps), r)
        r = lax.broadcast_in_dim(r, acc_g.shape, [1])  # column b is row b of x
        g, u = acc_g * r, acc_u * r
        h = g / (1.0 + jnp.exp(-g)) * u  # silu(g) * u
        out_smem.T[...] = h.astype(out_smem.dtype)  # [block_f, 8] stored as rows of x's layout
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[:, pl.ds(f0, bf)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        def load_x(j, slot):
            cols = pl.ds(j * bk, bk)
            plgpu.copy_gmem_to_smem(x_ref.at[:, cols], x_ring.at[slot], x_full.at[slot])
            if norm_eps is not None:  # a second, plain copy for the statistic
                plgpu.copy_gmem_to_smem(x_ref.at[:, cols], xp_ring.at[slot], xp_full.at[slot])

        def load_w(j, slot):
            cols = pl.ds(j * bk, bk)
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(f0, bf), cols], g_ring.at[slot], g_full.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(f + f0, bf), cols], u_ring.at[slot], u_full.at[slot])

        first = 0
        if pdl:  # the weights do not depend on the previous kernel: fill the ring with them first,
            first = min(stages, steps)  # then wait for that kernel's writes (x, r) to be visible
            for j in range(first):
                load_w(j, j)
            plgpu.griddepcontrol_wait()
            for j in range(first):
                load_x(j, j)
        if norm_eps is None:
            plgpu.copy_gmem_to_smem(r_ref, r_smem, r_full)

        @pl.loop(first, steps)
        def _fetch(j):
            slot = lax.rem(j, stages)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])
            load_x(j, slot)
            load_w(j, slot)

        if pdl:  # every load is issued: the next kernel may start on the SMs this grid frees
            plgpu.griddepcontrol_launch_dependents()

        @pl.loop(max(steps - stages, 0), steps)
        def _drain(j):  # observe the last releases: every barrier phase is waited on once
            plgpu.barrier_wait(free.at[lax.rem(j, stages)])


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "pdl", "norm_eps"))
def gate_up_swiglu_tma(x8, r8, wgu, *, blocks: TmaBlocks | None = None, interpret=False, pdl: bool | None = None,
                       norm_eps: float | None = None):
    """silu(n(x) Wg) * (n(x) Wu): x8 [8, D] (rows past the batch are padding), r8 [8] f32 =
    row_rsqrt(x8, eps), wgu [2F, D] = decode_gemv.fold_norm([Wg | Wu], norm scale) (gate rows
    first). Returns h8 [8, F] in x8's dtype. r8=None with norm_eps: the kernel takes the
    statistic itself, from a second, plain copy of each x tile (no XLA kernel before it; module
    docstring). blocks: None = DEFAULT_BLOCKS. interpret: True, or
    `plgpu.InterpretGPUParams` (e.g. `detect_races=True`); always interpreted on a CPU.
    pdl: programmatic dependent launch (module docstring); None = DEFAULT_PDL. Ignored when
    interpreted. It reads wgu before the previous kernel has finished: only for weights that no
    kernel of the same program writes (the decoder's are prepared once, outside the step)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    blocks = blocks or DEFAULT_BLOCKS
    d = x8.shape[1]
    two_f = wgu.shape[0]
    if x8.ndim != 2 or x8.shape[0] != ROWS:
        raise ValueError(f"x8 must be [{ROWS}, D] (the batch padded to {ROWS} rows), got {x8.shape}")
    if (r8 is None) == (norm_eps is None):
        raise ValueError("give exactly one of r8 (the statistic, row_rsqrt) and norm_eps (taken in the kernel)")
    if r8 is not None and (r8.shape != (ROWS,) or r8.dtype != jnp.float32):
        raise ValueError(f"r8 must be float32 [{ROWS}] (row_rsqrt), got {r8.dtype} {r8.shape}")
    if wgu.shape != (two_f, d) or two_f % 2:
        raise ValueError(f"wgu {wgu.shape} must be [2F, D={d}]")
    if x8.dtype != wgu.dtype or x8.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"x8 and wgu must share a 16-bit dtype, got {x8.dtype} and {wgu.dtype}")
    f = two_f // 2
    reason = unsupported_reason(d, f, blocks, in_kernel_norm=norm_eps is not None)
    if reason:
        raise ValueError(f"gate_up_swiglu_tma: {reason}")
    params = interpret_params(interpret or jax.default_backend() == "cpu")
    interpret = params is not None
    pdl = DEFAULT_PDL if pdl is None else bool(pdl)
    pdl = pdl and not interpret  # the interpreter has no griddepcontrol
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    bf, bk, stages = blocks.block_f, blocks.block_k, blocks.stages
    rings = (
        plgpu.SMEM((stages, ROWS, bk), x8.dtype, transforms=tiled),
        plgpu.SMEM((stages, bf, bk), wgu.dtype, transforms=tiled),
        plgpu.SMEM((stages, bf, bk), wgu.dtype, transforms=tiled),
    )
    barriers = (
        plgpu.Barrier(num_barriers=stages),  # x tile landed
        plgpu.Barrier(num_barriers=stages),  # gate tile landed
        plgpu.Barrier(num_barriers=stages),  # up tile landed
        plgpu.Barrier(num_barriers=stages),  # slot free again
    )
    out_tile = plgpu.SMEM((ROWS, bf), x8.dtype)
    if norm_eps is None:
        scratch = (*rings, plgpu.SMEM((ROWS,), jnp.float32), out_tile, *barriers, plgpu.Barrier())  # + r, r landed
        operands = (x8, r8, wgu)
    else:  # + the plain x tiles and their barriers
        scratch = (*rings, plgpu.SMEM((stages, ROWS, bk), x8.dtype), out_tile, *barriers,
                   plgpu.Barrier(num_barriers=stages))
        operands = (x8, wgu)
    return plgpu.kernel(
        functools.partial(_kernel, blocks=blocks, d=d, f=f, interpret=interpret, pdl=pdl,
                          norm_eps=None if norm_eps is None else float(norm_eps)),
        out_type=jax.ShapeDtypeStruct((ROWS, f), x8.dtype),
        scratch_types=scratch,
        grid=(f // bf,),
        grid_names=("f",),
        num_threads=2,
        thread_name="wg",
        interpret=params,
    )(*operands)
