"""Flash-decoding: one query token per row attending over a KV cache, as a Pallas kernel.

Reads in this order: the tile sizes (`DecodeBlockSizes`); the plan of a call (how the cache
length is split); the kernel, with comments tying it to flash-decoding (Dao, Haziza, Massa,
Sizov 2023, "Flash-Decoding for long-context inference"); the `pallas_call`; the combine of
the partial softmaxes; the public `decode_attention`; the pure-jnp reference
`decode_attention_reference`.

Layout (one layer of the cache, as scaling.decode stores it):
    q        [B, N, H]       the new token's queries, RoPE applied
    k, v     [B, S, K, H]    the cache; S = max_len, K KV heads, G = N // K
    lengths  [B] int32       row b attends to cache positions [0, lengths[b])

Decoding has one query per row, so the parallelism of FlashAttention's query tiles is gone;
flash-decoding gets it back by splitting the cache length S into `splits` chunks that run
as separate programs, each writing an unnormalised partial output with its running max and
sum, which a small second step combines (the same rescaling as the online softmax).

Grid: (B, K, splits). A program owns one row, one KV head and one chunk of S. Its q tile is
the G query heads of that KV head, zero-padded to 16 rows (the smallest tensor-core M), so
every K/V tile it loads serves the whole group: GQA costs no extra cache reads. The loop
over the chunk stops at the row's length, so a program reads only the filled part of the
cache; a chunk wholly past the length reads nothing.

Numerics: logits, the softmax and the accumulators are f32; masked logits are a large
finite negative number (not -inf) so an empty chunk's max never makes inf - inf.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_ROWS = 16  # smallest M of a Triton tensor-core dot: the q tile's G rows are padded to it


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Tiles and launch parameters of the decode kernel.

    Attributes:
      block_s: cache positions per K/V tile loaded in the inner loop (the N of q kᵀ).
      min_programs: the split count is raised until B * K * splits reaches this many
        programs (about two waves of the H100's 132 SMs), so a batch-1 call still fills the GPU.
      max_splits: the most chunks one row's cache is cut into (bounds the combine's work).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the inner loop (K/V tiles prefetched ahead).
    """

    block_s: int = 64
    min_programs: int = 264
    max_splits: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class _Plan:
    splits: int
    chunk: int  # cache positions per split, a multiple of block_s


def _plan(batch: int, kv_heads: int, max_len: int, blocks: DecodeBlockSizes) -> _Plan:
    if max_len % blocks.block_s:
        raise ValueError(f"{max_len=} must be a multiple of block_s={blocks.block_s}")
    n_blocks = max_len // blocks.block_s
    want = min(blocks.max_splits, n_blocks, max(1, -(-blocks.min_programs // (batch * kv_heads))))
    # The smallest divisor of n_blocks that is >= want, so every chunk is whole tiles.
    splits = next(d for d in range(want, n_blocks + 1) if n_blocks % d == 0)
    return _Plan(splits=splits, chunk=max_len // splits)


# ----------------------------------------------------------------------------------------------
# The kernel.


def _dot(a, b, contract: tuple[int, int]):
    """a, b 2-D; contract one dim of each; f32 result. f32 inputs use full f32 (not tf32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_s: int, chunk: int, sm_scale: float):
    """One (row b, KV head, chunk) program: online softmax over the chunk's filled tiles.

    Refs: len_ref [1]; q_ref [G16, H]; k_ref, v_ref [chunk, H] (this row, head and chunk);
    outputs o_ref [G16, H] (unnormalised), m_ref, l_ref [G16] (running max and sum).
    """
    split = pl.program_id(2)
    length = len_ref[0]
    start = split * chunk
    n_valid = jnp.clip(length - start, 0, chunk)
    n_tiles = (n_valid + block_s - 1) // block_s  # tiles past the row's length are never read

    q = q_ref[...]
    rows = q.shape[0]
    qs = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)

    def body(i, carry):
        m_prev, l_prev, acc = carry
        k = k_ref[pl.ds(i * block_s, block_s), :]  # [block_s, H]
        v = v_ref[pl.ds(i * block_s, block_s), :]
        s = _dot(qs, k, (1, 1))  # q kᵀ: [G16, block_s] f32
        pos = start + i * block_s + lax.broadcasted_iota(jnp.int32, (rows, block_s), 1)
        s = jnp.where(pos < length, s, MASK_VALUE)
        # Online softmax (FlashAttention-2, Algorithm 1, lines 8-10).
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, (1, 0))
        return m_new, l_new, acc

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, n_tiles, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _partials(q_bkgh, k_bskh, v_bskh, lengths_b, *, plan: _Plan, blocks: DecodeBlockSizes, sm_scale, interpret):
    b, kh, g16, h = q_bkgh.shape
    grid = (b, kh, plan.splits)
    kernel = functools.partial(_decode_kernel, block_s=blocks.block_s, chunk=plan.chunk, sm_scale=sm_scale)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    out_shape = (
        jax.ShapeDtypeStruct((b, kh, plan.splits, g16, h), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, plan.splits, g16), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, plan.splits, g16), jnp.float32),
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (i,)),
            pl.BlockSpec((None, None, g16, h), lambda i, j, s: (i, j, 0, 0)),
            pl.BlockSpec((None, plan.chunk, None, h), lambda i, j, s: (i, s, j, 0)),
            pl.BlockSpec((None, plan.chunk, None, h), lambda i, j, s: (i, s, j, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, g16, h), lambda i, j, s: (i, j, s, 0, 0)),
            pl.BlockSpec((None, None, None, g16), lambda i, j, s: (i, j, s, 0)),
            pl.BlockSpec((None, None, None, g16), lambda i, j, s: (i, j, s, 0)),
        ],
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name="decode_attention",
    )(lengths_b, q_bkgh, k_bskh, v_bskh)


def _combine(o_bkpgh, m_bkpg, l_bkpg):
    """Merge the splits' partial softmaxes: rescale each by exp(m_i - max m), then normalise."""
    m_max = jnp.max(m_bkpg, axis=2, keepdims=True)
    w = jnp.exp(m_bkpg - m_max)  # empty splits: exp(MASK - m) = 0
    l_tot = jnp.sum(w * l_bkpg, axis=2)  # [B, K, G]
    o = jnp.sum(w[..., None] * o_bkpgh, axis=2)  # [B, K, G, H]
    return o / jnp.maximum(l_tot, 1e-30)[..., None]


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def decode_attention(q_bnh, k_bskh, v_bskh, lengths_b, *, blocks: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False):
    """softmax(q kᵀ / sqrt(H)) v over cache positions [0, lengths[b]) of each row: [B, N, H].

    q [B, N, H]; k, v [B, S, K, H] with N % K == 0; lengths [B] int32 in [1, S].
    On a CPU backend the kernel runs in Pallas interpret mode.
    """
    b, n, h = q_bnh.shape
    bk, s, kh, hk = k_bskh.shape
    if (bk, hk) != (b, h) or v_bskh.shape != k_bskh.shape:
        raise ValueError(f"shapes disagree: q {q_bnh.shape}, k {k_bskh.shape}, v {v_bskh.shape}")
    if n % kh:
        raise ValueError(f"query heads {n=} must be a multiple of KV heads {kh=}")
    if h < 16 or h & (h - 1):
        raise ValueError(f"head_dim {h=} must be a power of two >= 16 (Triton tiles)")
    g = n // kh
    if g > MIN_ROWS:
        raise ValueError(f"group size {g=} (query heads per KV head) above {MIN_ROWS} is not supported")
    interpret = bool(interpret) or jax.default_backend() == "cpu"
    plan = _plan(b, kh, s, blocks)
    q_bkgh = q_bnh.reshape(b, kh, g, h)
    q_bkgh = jnp.pad(q_bkgh, ((0, 0), (0, 0), (0, MIN_ROWS - g), (0, 0))).astype(k_bskh.dtype)
    o, m, l = _partials(q_bkgh, k_bskh, v_bskh, lengths_b.astype(jnp.int32), plan=plan, blocks=blocks,
                        sm_scale=1.0 / math.sqrt(h), interpret=interpret)
    out = _combine(o, m, l)[:, :, :g]  # [B, K, G, H]
    return out.reshape(b, n, h).astype(q_bnh.dtype)


@functools.cache
def prime_lowering() -> None:
    """Lower one tiny call, once per process.

    The first lowering of a pallas_call imports modules that register a JAX config option,
    which changes the tracing context: a jitted caller compiled before that would miss the
    compilation cache once afterwards. Callers that compile around the kernel (the decoder)
    call this first.
    """
    q = jax.ShapeDtypeStruct((1, 1, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 64, 1, 16), jnp.float32)
    decode_attention.lower(q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32))


# ----------------------------------------------------------------------------------------------
# Reference.


def decode_attention_reference(q_bnh, k_bskh, v_bskh, lengths_b):
    """Pure jnp: reads the whole cache and masks positions >= length. f32 softmax."""
    b, n, h = q_bnh.shape
    kh = k_bskh.shape[2]
    g = n // kh
    q_bkgh = q_bnh.reshape(b, kh, g, h)
    logits = jnp.einsum("bkgh,bskh->bkgs", q_bkgh, k_bskh, preferred_element_type=jnp.float32) / math.sqrt(h)
    valid_bs = jnp.arange(k_bskh.shape[1])[None, :] < lengths_b[:, None]
    logits = jnp.where(valid_bs[:, None, None, :], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgs,bskh->bkgh", probs.astype(v_bskh.dtype), v_bskh, preferred_element_type=jnp.float32)
    return out.reshape(b, n, h).astype(q_bnh.dtype)
