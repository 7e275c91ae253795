"""delta = rowsum(dO ∘ O) for the flash-attention backward, as one Pallas (Triton) kernel.

The backward's softmax correction (FlashAttention-2, Algorithm 2, line 4): for each query row i
and head h, delta[b, h, i] = sum_d dO[b, i, h, d] O[b, i, h, d], in f32, laid out [B, H, T] as
the Mosaic backward kernels read it.

Why a kernel of our own: XLA's fused reduction of the two [B, T, H, D] tensors over their
128-wide minor dim ran at about a fifth of the H200's copy bandwidth (0.35-0.40 ms for
B·T = 16k, H = 32, D = 128, `docs/benchmarks.md`, issue 5), which is 8-10% of the whole
backward. The work is a pure stream: each program reads a [block_t, block_h, D] tile of both
inputs and writes [block_h, block_t] results transposed into the [B, H, T] layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

DEFAULT_BLOCK_T = 16
DEFAULT_BLOCK_H = 8
NUM_WARPS = 4


def reference(o, do):
    """The same in plain jnp (f32): [B, T, H, D] x2 -> [B, H, T]."""
    return jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))


def unsupported_reason(shape, block_t: int = DEFAULT_BLOCK_T, block_h: int = DEFAULT_BLOCK_H) -> str | None:
    """Why the kernel cannot take o/do of this [B, T, H, D] shape (None: it can). Triton tiles
    are powers of two and this kernel has no masked tails."""
    if len(shape) != 4:
        return f"o and do must be 4-D [B, T, H, D], got {tuple(shape)}"
    _, t, h, d = shape
    for name, n in (("block_t", block_t), ("block_h", block_h), ("head_dim", d)):
        if n < 1 or n & (n - 1):
            return f"{name}={n} must be a power of two"
    if t % block_t or h % block_h:
        return f"T={t} and H={h} must be multiples of block_t={block_t} and block_h={block_h}"
    return None


def _kernel(o_ref, do_ref, out_ref):
    prod = o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32)  # [bt, bh, D]
    out_ref[...] = jnp.sum(prod, axis=-1).T  # [bh, bt]: the [B, H, T] layout


@functools.partial(jax.jit, static_argnames=("block_t", "block_h", "interpret"))
def output_row_dot(o, do, *, block_t: int = DEFAULT_BLOCK_T, block_h: int = DEFAULT_BLOCK_H,
                   interpret: bool = False):
    """rowsum(dO ∘ O) as [B, H, T] f32 from o, do [B, T, H, D] (any float dtype, alike).
    On a CPU backend the kernel runs in interpret mode. Raises ValueError for shapes the kernel does not take (`unsupported_reason`)."""
    if o.shape != do.shape or o.dtype != do.dtype:
        raise ValueError(f"o and do must match: {o.shape} {o.dtype} vs {do.shape} {do.dtype}")
    # Narrow the blocks to the shape where it is smaller (a tiny test shape), never past it.
    if o.ndim == 4:
        block_t = min(block_t, o.shape[1])
        block_h = min(block_h, o.shape[2])
    if (reason := unsupported_reason(o.shape, block_t, block_h)) is not None:
        raise ValueError(f"row_dot.output_row_dot: {reason}")
    b, t, h, d = o.shape
    interpret = bool(interpret) or jax.default_backend() == "cpu"
    tile = pl.BlockSpec((None, block_t, block_h, d), lambda i, j, k: (i, j, k, 0))
    return pl.pallas_call(
        _kernel,
        grid=(b, t // block_t, h // block_h),
        in_specs=[tile, tile],
        out_specs=pl.BlockSpec((None, block_h, block_t), lambda i, j, k: (i, k, j)),
        out_shape=jax.ShapeDtypeStruct((b, h, t), jnp.float32),
        compiler_params=None if interpret else _triton_params(),
        interpret=interpret,
        name="attention_output_row_dot",
    )(o, do)


def _triton_params():
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
