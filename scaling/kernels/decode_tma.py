"""Decode projections whose weights stream by TMA (Mosaic GPU, Hopper): the gate/up + SwiGLU.

Why (docs/decoding.md, "A TMA-fed GEMV"): on an H200 the Triton kernels of decode_gemv.py
plateau at 72-87% of the copy bandwidth for a batch-1 projection, while a kernel whose weight
tiles arrive by TMA into a shared-memory ring reached 90-100% at the large ones.

`gate_up_swiglu_tma(x8, wgu, eps=)`: h = silu(n(x) Wg) * (n(x) Wu) for up to 8 rows, n the
RMSNorm (its scale folded into wgu's rows by decode_gemv.fold_norm, as for the Triton kernel).
Per CTA, `block_f` features of both halves:
  - a producer warpgroup streams, per ring slot, the x tile [8, block_k] and the gate and up
    weight tiles [block_f, block_k] by TMA;
  - a consumer warpgroup issues acc_g += x Wgᵀ and acc_u += x Wuᵀ on the tensor cores with x as
    the A operand, padded to wgmma's 64 rows (a ring slot holds 64 rows, the TMA fills the first
    8; the others hold whatever shared memory held, and since the rows of a product are
    independent, they only reach output rows that are never stored);
  - the same x tiles give the row statistic rsqrt(mean(x²) + eps), applied to both accumulators
    before the SwiGLU; rows 0-7 of the result are written back by TMA.
In and out, activations are row-major [8, D] and [8, F]: rows past the batch are padding.

Interpret mode (CPU tests) replaces the wgmma by a dot of the same operands; the rest is the
GPU code. The reference is decode_gemv.gate_up_swiglu_reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

ROWS = 8  # activation rows the kernels carry (a TMA box of one 8-row tile)
WGMMA_M = 64  # the tensor cores' row block: x is padded to it inside shared memory
SMEM_BYTES = 232448  # dynamic shared memory per CTA on sm_90


@dataclasses.dataclass(frozen=True)
class TmaBlocks:
    block_f: int = 64  # features per CTA, of the gate and of the up half each (wgmma N)
    block_k: int = 256  # reduction tile per ring slot (few steps: each waits for its products)
    stages: int = 2  # ring depth


DEFAULT_BLOCKS = TmaBlocks()  # what the decoder runs (experiments/decode_variants.py --tma-blocks overrides it)


def smem_bytes(blocks: TmaBlocks, itemsize: int = 2) -> int:
    per_slot = (WGMMA_M + 2 * blocks.block_f) * blocks.block_k * itemsize  # x (padded), gate, up
    return blocks.stages * per_slot + WGMMA_M * blocks.block_f * itemsize  # + the output tile


def unsupported_reason(hidden: int, mlp_dim: int, blocks: TmaBlocks | None = None) -> str | None:
    """Why gate_up_swiglu_tma cannot take these shapes (None: it can)."""
    blocks = blocks or DEFAULT_BLOCKS
    if blocks.block_f % 8 or not 8 <= blocks.block_f <= 128:
        return f"block_f={blocks.block_f} must be a multiple of 8 in [8, 128] (wgmma N)"
    if blocks.block_k % 64:
        return f"block_k={blocks.block_k} must be a multiple of 64 (one swizzled tile)"
    if blocks.stages < 2:
        return f"stages={blocks.stages} must be >= 2"
    if mlp_dim % blocks.block_f:
        return f"mlp_dim {mlp_dim} is not a multiple of block_f {blocks.block_f}"
    if hidden % blocks.block_k:
        return f"hidden {hidden} is not a multiple of block_k {blocks.block_k}"
    if smem_bytes(blocks) > SMEM_BYTES:
        return f"the tiles need {smem_bytes(blocks)} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def _kernel(x_ref, w_ref, o_ref, x_ring, g_ring, u_ring, out_smem, x_full, g_full, u_full, free, *,
            blocks: TmaBlocks, d: int, f: int, eps: float, interpret: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bf, bk, stages = blocks.block_f, blocks.block_k, blocks.stages
    steps = d // bk
    f0 = lax.axis_index("f") * bf
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _consumer():
        def products(accs, a_ref, b_refs):
            """acc_i += a b_iᵀ for each i: the wgmmas issued together, one wait."""
            if interpret:  # the interpreter has no wgmma: dots of the same operands
                return tuple(acc + jnp.dot(a_ref[...], b[...].T, preferred_element_type=jnp.float32)
                             for acc, b in zip(accs, b_refs))

            def issue(acc_refs):
                for acc_ref, b in zip(acc_refs, b_refs):
                    plgpu.wgmma(acc_ref, a_ref, b.T)

            return pl.run_state(issue)(tuple(plgpu.ACC.init(a) for a in accs))

        def step(j, carry):
            acc_g, acc_u, ss = carry
            slot = lax.rem(j, stages)
            for bar in (x_full, g_full, u_full):
                plgpu.barrier_wait(bar.at[slot])
            x_slot = x_ring.at[slot]
            acc_g, acc_u = products((acc_g, acc_u), x_slot, (g_ring.at[slot], u_ring.at[slot]))
            xt = x_slot[...] if interpret else plgpu.load(x_slot, layout=plgpu.Layout.WGMMA)
            xt = xt.astype(jnp.float32)
            ss = ss + (xt * xt).sum(axis=1)
            plgpu.barrier_arrive(free.at[slot])
            return acc_g, acc_u, ss

        acc0 = jnp.zeros((WGMMA_M, bf), jnp.float32)
        ss0 = jnp.zeros((WGMMA_M,), jnp.float32)
        if not interpret:
            acc0 = plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)
            ss0 = plgpu.layout_cast(ss0, plgpu.Layout.WGMMA.reduce(1))
        acc_g, acc_u, ss = lax.fori_loop(0, steps, step, (acc0, acc0, ss0))
        r = lax.broadcast_in_dim(lax.rsqrt(ss / d + eps), acc_g.shape, [0])
        g, u = acc_g * r, acc_u * r
        h = g / (1.0 + jnp.exp(-g)) * u  # silu(g) * u
        out_smem[...] = h.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, ROWS)], o_ref.at[:, pl.ds(f0, bf)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        @pl.loop(0, steps)
        def _fetch(j):
            slot = lax.rem(j, stages)
            cols = pl.ds(j * bk, bk)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])
            plgpu.copy_gmem_to_smem(x_ref.at[:, cols], x_ring.at[slot, pl.ds(0, ROWS)], x_full.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(f0, bf), cols], g_ring.at[slot], g_full.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(f + f0, bf), cols], u_ring.at[slot], u_full.at[slot])

        @pl.loop(max(steps - stages, 0), steps)
        def _drain(j):  # observe the last releases: every barrier phase is waited on once
            plgpu.barrier_wait(free.at[lax.rem(j, stages)])


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret"))
def gate_up_swiglu_tma(x8, wgu, *, eps: float, blocks: TmaBlocks | None = None, interpret: bool = False):
    """silu(n(x) Wg) * (n(x) Wu): x8 [8, D] (rows past the batch are padding), wgu [2F, D] =
    decode_gemv.fold_norm([Wg | Wu], norm scale) (gate rows first). Returns [8, F] in x8's dtype.
    blocks: None = DEFAULT_BLOCKS."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    blocks = blocks or DEFAULT_BLOCKS
    d = x8.shape[1]
    two_f = wgu.shape[0]
    if x8.ndim != 2 or x8.shape[0] != ROWS:
        raise ValueError(f"x8 must be [{ROWS}, D] (the batch padded to {ROWS} rows), got {x8.shape}")
    if wgu.shape != (two_f, d) or two_f % 2:
        raise ValueError(f"wgu {wgu.shape} must be [2F, D={d}]")
    if x8.dtype != wgu.dtype or x8.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"x8 and wgu must share a 16-bit dtype, got {x8.dtype} and {wgu.dtype}")
    f = two_f // 2
    reason = unsupported_reason(d, f, blocks)
    if reason:
        raise ValueError(f"gate_up_swiglu_tma: {reason}")
    interpret = bool(interpret) or jax.default_backend() == "cpu"
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    bf, bk, stages = blocks.block_f, blocks.block_k, blocks.stages
    return plgpu.kernel(
        functools.partial(_kernel, blocks=blocks, d=d, f=f, eps=float(eps), interpret=interpret),
        out_type=jax.ShapeDtypeStruct((ROWS, f), x8.dtype),
        scratch_types=(
            plgpu.SMEM((stages, WGMMA_M, bk), x8.dtype, transforms=tiled),
            plgpu.SMEM((stages, bf, bk), wgu.dtype, transforms=tiled),
            plgpu.SMEM((stages, bf, bk), wgu.dtype, transforms=tiled),
            plgpu.SMEM((WGMMA_M, bf), x8.dtype, transforms=tiled),
            plgpu.Barrier(num_barriers=stages),  # x tile landed
            plgpu.Barrier(num_barriers=stages),  # gate tile landed
            plgpu.Barrier(num_barriers=stages),  # up tile landed
            plgpu.Barrier(num_barriers=stages),  # slot free again
        ),
        grid=(f // bf,),
        grid_names=("f",),
        num_threads=2,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x8, wgu)
