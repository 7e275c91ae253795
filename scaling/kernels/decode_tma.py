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
down projection (decode_gemv.matmul_residual) reads the batch rows of h8 directly. The decoder
(layers="pallas_tma") pads x and takes the statistic in XLA (docs/decoding.md, "The TMA gate/up
in the decoder").

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


@dataclasses.dataclass(frozen=True)
class TmaBlocks:
    block_f: int = 64  # features per CTA, of the gate and of the up half each (wgmma M)
    block_k: int = 256  # reduction tile per ring slot
    stages: int = 3  # ring depth


DEFAULT_BLOCKS = TmaBlocks()  # what the decoder runs (experiments/decode_variants.py --tma-blocks overrides it)
DEFAULT_PDL = False  # not yet measured on a GPU (experiments/bench_pdl.py; decode_variants.py's *_tma_pdl variants)


def smem_bytes(blocks: TmaBlocks, itemsize: int = 2) -> int:
    per_slot = (ROWS + 2 * blocks.block_f) * blocks.block_k * itemsize  # x, gate, up
    return blocks.stages * per_slot + blocks.block_f * ROWS * itemsize + ROWS * 4  # + the output tile, r


def unsupported_reason(hidden: int, mlp_dim: int, blocks: TmaBlocks | None = None) -> str | None:
    """Why gate_up_swiglu_tma cannot take these shapes (None: it can)."""
    blocks = blocks or DEFAULT_BLOCKS
    if blocks.block_f not in (64, 128):
        return f"block_f={blocks.block_f} must be 64 or 128 (wgmma M)"
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


def row_rsqrt(x8, eps: float):
    """rsqrt(mean(x²) + eps) per row, f32: the RMSNorm statistic the kernel's epilogue applies."""
    x = x8.astype(jnp.float32)
    return lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)


def _kernel(x_ref, r_ref, w_ref, o_ref, x_ring, g_ring, u_ring, r_smem, out_smem, x_full, g_full, u_full, free,
            r_full, *, blocks: TmaBlocks, d: int, f: int, interpret: bool, pdl: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

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

        def step(j, carry):
            slot = lax.rem(j, stages)
            for bar in (x_full, g_full, u_full):
                plgpu.barrier_wait(bar.at[slot])
            carry = products(carry, (g_ring.at[slot], u_ring.at[slot]), x_ring.at[slot])
            plgpu.barrier_arrive(free.at[slot])
            return carry

        acc0 = jnp.zeros((bf, ROWS), jnp.float32)
        if not interpret:
            acc0 = plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)
        acc_g, acc_u = lax.fori_loop(0, steps, step, (acc0, acc0))
        plgpu.barrier_wait(r_full)
        r = r_smem[...] if interpret else plgpu.load(r_smem, layout=plgpu.Layout.WGMMA.reduce(0))
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
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(j * bk, bk)], x_ring.at[slot], x_full.at[slot])

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


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "pdl"))
def gate_up_swiglu_tma(x8, r8, wgu, *, blocks: TmaBlocks | None = None, interpret=False, pdl: bool | None = None):
    """silu(n(x) Wg) * (n(x) Wu): x8 [8, D] (rows past the batch are padding), r8 [8] f32 =
    row_rsqrt(x8, eps), wgu [2F, D] = decode_gemv.fold_norm([Wg | Wu], norm scale) (gate rows
    first). Returns h8 [8, F] in x8's dtype. blocks: None = DEFAULT_BLOCKS. interpret: True, or
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
    if r8.shape != (ROWS,) or r8.dtype != jnp.float32:
        raise ValueError(f"r8 must be float32 [{ROWS}] (row_rsqrt), got {r8.dtype} {r8.shape}")
    if wgu.shape != (two_f, d) or two_f % 2:
        raise ValueError(f"wgu {wgu.shape} must be [2F, D={d}]")
    if x8.dtype != wgu.dtype or x8.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"x8 and wgu must share a 16-bit dtype, got {x8.dtype} and {wgu.dtype}")
    f = two_f // 2
    reason = unsupported_reason(d, f, blocks)
    if reason:
        raise ValueError(f"gate_up_swiglu_tma: {reason}")
    params = interpret_params(interpret or jax.default_backend() == "cpu")
    interpret = params is not None
    pdl = DEFAULT_PDL if pdl is None else bool(pdl)
    pdl = pdl and not interpret  # the interpreter has no griddepcontrol
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    bf, bk, stages = blocks.block_f, blocks.block_k, blocks.stages
    return plgpu.kernel(
        functools.partial(_kernel, blocks=blocks, d=d, f=f, interpret=interpret, pdl=pdl),
        out_type=jax.ShapeDtypeStruct((ROWS, f), x8.dtype),
        scratch_types=(
            plgpu.SMEM((stages, ROWS, bk), x8.dtype, transforms=tiled),
            plgpu.SMEM((stages, bf, bk), wgu.dtype, transforms=tiled),
            plgpu.SMEM((stages, bf, bk), wgu.dtype, transforms=tiled),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.SMEM((ROWS, bf), x8.dtype),
            plgpu.Barrier(num_barriers=stages),  # x tile landed
            plgpu.Barrier(num_barriers=stages),  # gate tile landed
            plgpu.Barrier(num_barriers=stages),  # up tile landed
            plgpu.Barrier(num_barriers=stages),  # slot free again
            plgpu.Barrier(),  # r landed
        ),
        grid=(f // bf,),
        grid_names=("f",),
        num_threads=2,
        thread_name="wg",
        interpret=params,
    )(x8, r8, wgu)
