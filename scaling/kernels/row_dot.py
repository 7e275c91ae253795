"""delta = rowsum(dO ∘ O) for the attention backward, as a Pallas (Triton) kernel.

FlashAttention-2's backward (Dao, 2023, Algorithm 2, line 4) needs D_i = dO_i · O_i per query row
and head, laid out [B, H, T] so the Mosaic kernels can fetch a row tile of it by TMA. XLA's
fused reduce-and-transpose of the [B, T, H, D] inputs ran at ~1 TB/s on an H100 (0.3 ms at
B·T = 16k, H = 32, D = 128, for 268 MB read; docs/attention.md, thirteenth session). The
work is a pure stream: each program reads up to 128 query rows of one head of both inputs,
reduces over D in f32, and writes the rows' results, contiguous in the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

ROW_TILES = (128, 64, 32, 16)  # query rows per program, the largest dividing T


def _block_t(t: int) -> int:
    return next(r for r in ROW_TILES if t % r == 0)


def supported(shape) -> bool:
    """The kernel needs whole row tiles and a power-of-two head dim (Triton block shapes)."""
    _, t, _, d = shape
    return t % ROW_TILES[-1] == 0 and d >= 16 and d & (d - 1) == 0


def _kernel(o_ref, do_ref, out_ref):
    # One head's [block_t, D] tile of each input: a 2-D tile (each row one contiguous D-run),
    # reduced over D in f32; the block_t results are contiguous in the [B, H, T] output.
    prod = o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32)
    out_ref[...] = jnp.sum(prod, axis=-1)


@functools.partial(jax.jit, static_argnames=("interpret",))
def output_row_dot_pallas(o, do, *, interpret: bool = False):
    """delta [B, H, T] f32 = sum over D of o * do, from o, do [B, T, H, D]."""
    if o.shape != do.shape or o.ndim != 4:
        raise ValueError(f"output_row_dot_pallas: o and do must be the same [B, T, H, D] shape, got "
                         f"{o.shape} and {do.shape}")
    if not supported(o.shape):
        raise ValueError(f"output_row_dot_pallas: needs T % {ROW_TILES[-1]} == 0 and a power-of-two head dim "
                         f">= 16, got shape {o.shape}")
    b, t, h, d = o.shape
    bt = _block_t(t)
    # Heads vary fastest, so programs launched together read whole rows of the input.
    in_spec = pl.BlockSpec((None, bt, None, d), lambda j, i, k: (k, i, j, 0))
    return pl.pallas_call(
        _kernel,
        grid=(h, t // bt, b),
        in_specs=[in_spec, in_spec],
        out_specs=pl.BlockSpec((None, None, bt), lambda j, i, k: (k, j, i)),
        out_shape=jax.ShapeDtypeStruct((b, h, t), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(o, do)
