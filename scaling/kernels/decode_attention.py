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
sum, which a small second step combines (the same rescaling as the online softmax). With
`tickets` (decode_attention_grouped) the last split program of each row and KV head does the
combine instead (`_decode_combine_kernel`; measured slightly slower, opt-in).

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


def _is_pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def _check_blocks(blocks) -> None:
    """Refuse tile settings the kernels cannot run (before a ZeroDivisionError or a Triton error)."""
    if not isinstance(blocks, DecodeBlockSizes):
        raise TypeError(f"blocks must be a DecodeBlockSizes, got {type(blocks).__name__}")
    if not _is_pow2(blocks.block_s) or blocks.block_s < MIN_ROWS:
        raise ValueError(f"blocks.block_s={blocks.block_s!r} must be a power of two >= {MIN_ROWS} (a Triton dot's N)")
    for name in ("min_programs", "max_splits", "num_stages"):
        value = getattr(blocks, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"blocks.{name}={value!r} must be an int >= 1")
    if not _is_pow2(blocks.num_warps):
        raise ValueError(f"blocks.num_warps={blocks.num_warps!r} must be a power of two")


def _check_cache(k_bskh, v_bskh) -> None:
    """k and v caches: the same shape [B, S, K, H] and the same floating dtype."""
    for name, x in (("k", k_bskh), ("v", v_bskh)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} cache must be 4-D [B, S, K, H], got shape {getattr(x, 'shape', None)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}.dtype={x.dtype} must be a floating type (bfloat16, float16 or float32)")
    if k_bskh.shape != v_bskh.shape:
        raise ValueError(f"k and v caches must have the same shape, got {k_bskh.shape} and {v_bskh.shape}")
    if k_bskh.dtype != v_bskh.dtype:
        raise TypeError(f"k and v caches must have the same dtype, got {k_bskh.dtype} and {v_bskh.dtype}")


def _check_lengths(lengths_b, batch: int, name: str = "lengths"):
    """An int array [B] (one per row); returns it as int32. (Its values are traced under jit, so
    they cannot be checked here: see decode_attention for what values outside [1, S] do.)"""
    lengths_b = jnp.asarray(lengths_b)
    if lengths_b.shape != (batch,):
        raise ValueError(f"{name} must have shape [B]=({batch},) (one per row), got {lengths_b.shape}")
    if not jnp.issubdtype(lengths_b.dtype, jnp.integer):
        raise TypeError(f"{name}.dtype={lengths_b.dtype} must be an integer type (int32)")
    return lengths_b.astype(jnp.int32)


def _plan(batch: int, kv_heads: int, max_len: int, blocks: DecodeBlockSizes) -> _Plan:
    if max_len % blocks.block_s:
        raise ValueError(f"{max_len=} (the cache length S) must be a multiple of block_s={blocks.block_s}")
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


def _chunk_softmax(len_ref, q_ref, k_ref, v_ref, *, block_s: int, chunk: int, sm_scale: float):
    """This program's chunk: online softmax over its filled tiles -> (m, l, acc) in f32."""
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
    return lax.fori_loop(0, n_tiles, body, init)


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_s: int, chunk: int, sm_scale: float):
    """One (row b, KV head, chunk) program: online softmax over the chunk's filled tiles.

    Refs: len_ref [1]; q_ref [G16, H]; k_ref, v_ref [chunk, H] (this row, head and chunk);
    outputs o_ref [G16, H] (unnormalised), m_ref, l_ref [G16] (running max and sum).
    """
    m, l, acc = _chunk_softmax(len_ref, q_ref, k_ref, v_ref, block_s=block_s, chunk=chunk, sm_scale=sm_scale)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _decode_combine_kernel(len_ref, q_ref, k_ref, v_ref, _tickets_in, o_ref, m_ref, l_ref, out_ref, tickets_ref, *,
                           block_s: int, chunk: int, sm_scale: float, splits: int, g: int, interpret: bool):
    """_decode_kernel plus the combine, done by the last of the (row, KV head)'s split programs
    to finish ("last block reduces", as CUTLASS's split-K semaphore does), which saves the
    combine's own kernel per layer.

    Refs: as _decode_kernel, but o_ref [splits, G16, H] and m_ref, l_ref [splits, G16] hold all
    splits of this (row, KV head); out_ref [G, H] the normalised result; tickets_ref [1] int32,
    this (row, KV head)'s counter (aliased to the _tickets_in input). Each call adds `splits` to
    every counter, so the program that draws a ticket t with (t + 1) % splits == 0 is the
    last of its call, with no reset between calls.

    Ordering on the GPU: every thread's partial stores, a CTA barrier, then the ticket's atomic
    add (acquire-release, GPU scope) publishes them; the last program reads the others'
    partials with volatile loads (past L1, which is not coherent across SMs)."""
    split = pl.program_id(2)
    m, l, acc = _chunk_softmax(len_ref, q_ref, k_ref, v_ref, block_s=block_s, chunk=chunk, sm_scale=sm_scale)
    o_ref[split] = acc
    m_ref[split] = m
    l_ref[split] = l
    from jax.experimental.pallas import triton as plgpu

    if interpret:  # programs run one after another: plain loads see every store
        load = lambda ref: ref[...]
    else:
        plgpu.debug_barrier()
        # volatile: past L1 (jax 0.11.2's Pallas rejects cache_modifier=".cg": it looks the
        # string up without its dot)
        load = lambda ref: plgpu.load(ref, volatile=True)
    ticket = plgpu.atomic_add(tickets_ref, jnp.int32(0), jnp.int32(1))

    @pl.when(lax.rem(ticket + 1, splits) == 0)
    def _combine():
        if not interpret:
            plgpu.debug_barrier()  # the acquire (one thread's) before every thread's loads

        def merge(sp, carry):  # the online softmax's rescaling, one split at a time
            m_run, l_run, acc_run = carry
            m_s = load(m_ref.at[sp, pl.ds(0, g)])
            m_new = jnp.maximum(m_run, m_s)
            a_run, a_s = jnp.exp(m_run - m_new), jnp.exp(m_s - m_new)  # empty splits: exp(MASK - m) = 0
            l_new = a_run * l_run + a_s * load(l_ref.at[sp, pl.ds(0, g)])
            acc_new = acc_run * a_run[:, None] + load(o_ref.at[sp, pl.ds(0, g), :]) * a_s[:, None]
            return m_new, l_new, acc_new

        h = out_ref.shape[-1]
        init = (jnp.full((g,), MASK_VALUE, jnp.float32), jnp.zeros((g,), jnp.float32), jnp.zeros((g, h), jnp.float32))
        _, l_tot, acc_tot = lax.fori_loop(0, splits, merge, init)
        out_ref[...] = (acc_tot / jnp.maximum(l_tot, 1e-30)[:, None]).astype(out_ref.dtype)


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


def _partials_combined(q_bkgh, k_bskh, v_bskh, lengths_b, tickets_bk1, *, g: int, plan: _Plan,
                       blocks: DecodeBlockSizes, sm_scale, out_dtype, interpret):
    """_partials with the combine in the kernel: (out [B, K, G, H] in out_dtype, tickets)."""
    b, kh, g16, h = q_bkgh.shape
    sp = plan.splits
    kernel = functools.partial(_decode_combine_kernel, block_s=blocks.block_s, chunk=plan.chunk, sm_scale=sm_scale,
                               splits=sp, g=g, interpret=interpret)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    out_shape = (
        jax.ShapeDtypeStruct((b, kh, sp, g16, h), jnp.float32),  # partials: scratch the last program reads
        jax.ShapeDtypeStruct((b, kh, sp, g16), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, sp, g16), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, g, h), out_dtype),
        jax.ShapeDtypeStruct((b, kh, 1), jnp.int32),
    )
    _, _, _, out, tickets = pl.pallas_call(
        kernel,
        grid=(b, kh, sp),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (i,)),
            pl.BlockSpec((None, None, g16, h), lambda i, j, s: (i, j, 0, 0)),
            pl.BlockSpec((None, plan.chunk, None, h), lambda i, j, s: (i, s, j, 0)),
            pl.BlockSpec((None, plan.chunk, None, h), lambda i, j, s: (i, s, j, 0)),
            pl.BlockSpec((None, None, 1), lambda i, j, s: (i, j, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, sp, g16, h), lambda i, j, s: (i, j, 0, 0, 0)),
            pl.BlockSpec((None, None, sp, g16), lambda i, j, s: (i, j, 0, 0)),
            pl.BlockSpec((None, None, sp, g16), lambda i, j, s: (i, j, 0, 0)),
            pl.BlockSpec((None, None, g, h), lambda i, j, s: (i, j, 0, 0)),
            pl.BlockSpec((None, None, 1), lambda i, j, s: (i, j, 0)),
        ],
        out_shape=out_shape,
        input_output_aliases={4: 4},
        compiler_params=compiler_params,
        interpret=interpret,
        name="decode_attention_combined",
    )(lengths_b, q_bkgh, k_bskh, v_bskh, tickets_bk1)
    return out, tickets


def combine_in_kernel_reason(num_heads: int, kv_heads: int) -> str | None:
    """Why decode_attention_grouped cannot combine in the kernel (None when it can)."""
    g = num_heads // kv_heads
    if g & (g - 1):
        return f"group size {g} (query heads per KV head) is not a power of two (a Triton tile's rows)"
    return None


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

    q [B, N, H]; k, v [B, S, K, H] with N % K == 0, S a multiple of blocks.block_s; lengths
    [B] int32, normally in [1, S]. (Traced values cannot be checked: a length above S reads the
    whole cache, and a row with length <= 0 sees no position and returns zeros, as
    `decode_attention_reference` does.) On a CPU backend the kernel runs in Pallas interpret mode.
    """
    _check_blocks(blocks)
    _check_cache(k_bskh, v_bskh)
    if getattr(q_bnh, "ndim", None) != 3:
        raise ValueError(f"q must be 3-D [B, N, H], got shape {getattr(q_bnh, 'shape', None)}")
    if not jnp.issubdtype(q_bnh.dtype, jnp.floating):
        raise TypeError(f"q.dtype={q_bnh.dtype} must be a floating type")
    b, n, h = q_bnh.shape
    bk, s, kh, hk = k_bskh.shape
    if (bk, hk) != (b, h):
        raise ValueError(f"shapes disagree: q {q_bnh.shape}, k {k_bskh.shape}, v {v_bskh.shape}")
    lengths_b = _check_lengths(lengths_b, b)
    if n % kh:
        raise ValueError(f"query heads {n=} must be a multiple of KV heads {kh=}")
    if h < 16 or h & (h - 1):
        raise ValueError(f"head_dim {h=} must be a power of two >= 16 (Triton tiles)")
    g = n // kh
    if g > MIN_ROWS:
        raise ValueError(f"group size {g=} (query heads per KV head) above {MIN_ROWS} is not supported")
    q_bkgh = q_bnh.reshape(b, kh, g, h)
    q_bkgh = jnp.pad(q_bkgh, ((0, 0), (0, 0), (0, MIN_ROWS - g), (0, 0))).astype(k_bskh.dtype)
    return _grouped(q_bkgh, k_bskh, v_bskh, lengths_b, g, blocks, interpret).astype(q_bnh.dtype)


def _grouped(q_bkgh, k_bskh, v_bskh, lengths_b, g: int, blocks: DecodeBlockSizes, interpret: bool):
    b, kh, _, h = q_bkgh.shape
    interpret = bool(interpret) or jax.default_backend() == "cpu"
    plan = _plan(b, kh, k_bskh.shape[1], blocks)
    o, m, l = _partials(q_bkgh, k_bskh, v_bskh, lengths_b.astype(jnp.int32), plan=plan, blocks=blocks,
                        sm_scale=1.0 / math.sqrt(h), interpret=interpret)
    out = _combine(o, m, l)[:, :, :g]  # [B, K, G, H]
    return out.reshape(b, kh * g, h)


@functools.partial(jax.jit, static_argnames=("num_heads", "blocks", "interpret"), donate_argnames=("tickets",))
def decode_attention_grouped(q_bkgh, k_bskh, v_bskh, lengths_b, *, num_heads: int,
                             blocks: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False, tickets=None):
    """decode_attention with q already in the kernel's layout: [B, K, 16, H], the G = N / K query
    heads of each KV head in rows [0, G) (what decode_gemv.qkv_rope(q_layout="groups") writes;
    rows [G, 16) are never read into the result, so they may hold anything). Saves the pad
    kernel of decode_attention. Returns [B, N, H] in q's dtype.

    tickets: int32 [B, K, 1] counters (zeros to start; pass the returned ones to the next call)
    to combine the splits inside the kernel (`_decode_combine_kernel`) instead of in a separate
    XLA kernel; then returns (out, tickets). G must be a power of two (`combine_in_kernel_reason`)."""
    _check_blocks(blocks)
    _check_cache(k_bskh, v_bskh)
    if getattr(q_bkgh, "ndim", None) != 4:
        raise ValueError(f"q must be 4-D [B, K, {MIN_ROWS}, H], got shape {getattr(q_bkgh, 'shape', None)}")
    b, kh, rows, h = q_bkgh.shape
    lengths_b = _check_lengths(lengths_b, b)
    if rows != MIN_ROWS or num_heads % kh or num_heads // kh > MIN_ROWS:
        raise ValueError(f"q {q_bkgh.shape} must be [B, K, {MIN_ROWS}, H] with num_heads={num_heads} a multiple of K "
                         f"and at most {MIN_ROWS} per KV head")
    if k_bskh.shape[0] != b or k_bskh.shape[2:] != (kh, h) or v_bskh.shape != k_bskh.shape:
        raise ValueError(f"shapes disagree: q {q_bkgh.shape}, k {k_bskh.shape}, v {v_bskh.shape}")
    g = num_heads // kh
    if tickets is None:
        return _grouped(q_bkgh.astype(k_bskh.dtype), k_bskh, v_bskh, lengths_b, g, blocks,
                        interpret).astype(q_bkgh.dtype)
    if tickets.shape != (b, kh, 1) or tickets.dtype != jnp.int32:
        raise ValueError(f"tickets {tickets.shape} {tickets.dtype} must be int32 [{b}, {kh}, 1]")
    why = combine_in_kernel_reason(num_heads, kh)
    if why:
        raise ValueError(f"cannot combine in the kernel: {why}")
    interpret = bool(interpret) or jax.default_backend() == "cpu"
    plan = _plan(b, kh, k_bskh.shape[1], blocks)
    out, tickets = _partials_combined(q_bkgh.astype(k_bskh.dtype), k_bskh, v_bskh, lengths_b.astype(jnp.int32), tickets,
                                      g=g, plan=plan, blocks=blocks, sm_scale=1.0 / math.sqrt(h),
                                      out_dtype=q_bkgh.dtype, interpret=interpret)
    return out.reshape(b, kh * g, h), tickets


# ----------------------------------------------------------------------------------------------
# The fused step: RoPE, the cache write and the attention in one kernel.
#
# In a decode step the unfused path runs, per layer, one XLA fusion for q's RoPE and its
# padding to 16 rows, one scatter per cache (k with its RoPE, v), then the kernel: four
# launches of ~1.5-2.5 us around ~3 us of attention (profile in docs/decoding.md). Here one
# program (row b, KV head j, split s) reads the raw q/k/v projections, rotates q and the new
# k itself, and the program whose chunk holds the row's position writes the new k/v there.
# The new token's own score enters the online softmax as split 0's initial state, so no
# program reads a cache slot that another one may be writing in the same launch.
#
# q·kᵀ and p·v are broadcast-multiply-reduce on the CUDA cores instead of tensor-core dots:
# a GQA group has G (often 1-8) rows, below the 16 a Triton dot needs, and a decode step is
# bandwidth-bound (G multiply-adds per loaded cache element), so no padding is needed.


def _fused_kernel(pos_ref, cos_ref, sin_ref, q_ref, knew_ref, vnew_ref, k_ref, v_ref,
                  o_ref, m_ref, l_ref, ko_ref, vo_ref, *, block_s: int, chunk: int, sm_scale: float):
    """Refs: pos [1]; cos, sin [H/2] f32; q [G, H]; knew, vnew [1, H]; k, v [chunk, H] (input
    cache blocks); outputs o [G, H], m, l [G]; ko, vo [chunk, H] (the same cache blocks)."""
    split = pl.program_id(2)
    pos = pos_ref[0]  # the new token's position: it attends to the cache [0, pos) and itself
    start = split * chunk
    half = q_ref.shape[1] // 2
    cos, sin = cos_ref[...], sin_ref[...]

    def rotate(x1, x2):  # RoPE on the half-split layout (layers.apply_rope), f32
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def f32(x):
        return x.astype(jnp.float32)

    dt = k_ref.dtype
    q1, q2 = rotate(f32(q_ref[:, :half]), f32(q_ref[:, half:]))
    # Round to the cache dtype as the unfused path does, then fold in the softmax scale.
    q1 = f32(q1.astype(dt)) * sm_scale
    q2 = f32(q2.astype(dt)) * sm_scale
    k1, k2 = rotate(f32(knew_ref[:, :half]), f32(knew_ref[:, half:]))  # [1, H/2]
    k1, k2 = k1.astype(dt), k2.astype(dt)
    vnew = vnew_ref[...].astype(dt)  # [1, H]

    @pl.when((pos >= start) & (pos < start + chunk))
    def _write():
        ko_ref[pl.ds(pos - start, 1), :half] = k1
        ko_ref[pl.ds(pos - start, 1), half:] = k2
        vo_ref[pl.ds(pos - start, 1), :] = vnew

    # Split 0 starts from the new token alone (m = its score, l = 1, acc = its v); the
    # others start empty. Cache reads stop before pos, so none sees a half-written slot.
    s_new = jnp.sum(q1 * f32(k1), axis=1) + jnp.sum(q2 * f32(k2), axis=1)  # [G]
    # (Arithmetic, not jnp.where on a scalar predicate: the Triton lowering mixes i1 and f32 there.)
    first = 1.0 - jnp.minimum(split, 1).astype(jnp.float32)  # 1.0 in split 0, else 0.0
    m0 = s_new * first + MASK_VALUE * (1.0 - first)
    l0 = first + jnp.zeros_like(s_new)
    acc0 = first * f32(vnew) + jnp.zeros((q1.shape[0], vnew.shape[1]), jnp.float32)

    n_valid = jnp.clip(pos - start, 0, chunk)
    n_tiles = (n_valid + block_s - 1) // block_s

    def body(i, carry):
        m_prev, l_prev, acc = carry
        rows = pl.ds(i * block_s, block_s)
        kc1, kc2 = f32(k_ref[rows, :half]), f32(k_ref[rows, half:])  # [block_s, H/2]
        vc = f32(v_ref[rows, :])  # [block_s, H]
        s = jnp.sum(q1[:, None, :] * kc1[None], axis=2) + jnp.sum(q2[:, None, :] * kc2[None], axis=2)  # [G, bs]
        t = start + i * block_s + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(t < pos, s, MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        p = f32(p.astype(dt))  # p·v at the cache dtype's precision, as the tensor-core path
        acc = acc * alpha[:, None] + jnp.sum(p[:, :, None] * vc[None], axis=1)
        return m_new, l_new, acc

    m, l, acc = lax.fori_loop(0, n_tiles, body, (m0, l0, acc0))
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def fused_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Triton blocks need power-of-two dims: the group size G and the head dim (>= 16)."""
    g = num_heads // num_kv_heads
    return num_heads % num_kv_heads == 0 and g & (g - 1) == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


@functools.partial(jax.jit, static_argnames=("num_heads", "blocks", "interpret"), donate_argnames=("k_bskh", "v_bskh"))
def decode_attention_fused(qkv_bmh, pos_b, cos_bf, sin_bf, k_bskh, v_bskh, *, num_heads: int,
                           blocks: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False):
    """One decode step's attention from the raw projections, writing the new K/V in place.

    qkv [B, N + 2K, H]: q, k, v heads of the new token before RoPE (the fused projection's
    output); pos [B] int32: its position (row b attends to cache [0, pos] incl. itself);
    cos, sin [B, H/2] f32: RoPE at pos; k, v [B, S, K, H] caches (donated, updated in place).
    Returns (out [B, N, H], k, v), equal to rotating q and k, writing k/v at pos and calling
    `decode_attention` with lengths pos + 1.
    """
    _check_blocks(blocks)
    _check_cache(k_bskh, v_bskh)
    if getattr(qkv_bmh, "ndim", None) != 3:
        raise ValueError(f"qkv must be 3-D [B, N + 2K, H], got shape {getattr(qkv_bmh, 'shape', None)}")
    b, m, h = qkv_bmh.shape
    bk, s, kh, hk = k_bskh.shape
    n = num_heads
    if m != n + 2 * kh or (bk, hk) != (b, h):
        raise ValueError(f"shapes disagree: qkv {qkv_bmh.shape} (want [B, {n} + 2 * {kh}, H]), k {k_bskh.shape}, v {v_bskh.shape}")
    pos_b = _check_lengths(pos_b, b, "pos")
    if not fused_supported(n, kh, h):
        raise ValueError(f"fused decode needs a power-of-two group size and head_dim >= 16: heads {n}, kv {kh}, head_dim {h}")
    if cos_bf.shape != (b, h // 2) or sin_bf.shape != (b, h // 2):
        raise ValueError(f"cos/sin must be [B, H/2] = {(b, h // 2)}, got {cos_bf.shape}, {sin_bf.shape}")
    g = n // kh
    plan = _plan(b, kh, s, blocks)
    kernel = functools.partial(_fused_kernel, block_s=blocks.block_s, chunk=plan.chunk, sm_scale=1.0 / math.sqrt(h))
    specs = [
        pl.BlockSpec((1,), lambda i, j, c: (i,)),
        pl.BlockSpec((None, h // 2), lambda i, j, c: (i, 0)),
        pl.BlockSpec((None, h // 2), lambda i, j, c: (i, 0)),
        pl.BlockSpec((None, g, h), lambda i, j, c: (i, j, 0)),  # q heads [jG, jG + G)
        pl.BlockSpec((None, 1, h), lambda i, j, c: (i, n + j, 0)),  # k head j
        pl.BlockSpec((None, 1, h), lambda i, j, c: (i, n + kh + j, 0)),  # v head j
    ]
    args = (pos_b.astype(jnp.int32), cos_bf.astype(jnp.float32), sin_bf.astype(jnp.float32), qkv_bmh, qkv_bmh, qkv_bmh)
    o, m_, l_, k_out, v_out = _cache_writing_call(kernel, specs, args, k_bskh, v_bskh, rows=g, plan=plan,
                                                  blocks=blocks, interpret=interpret, name="decode_attention_fused")
    out = _combine(o, m_, l_)  # [B, K, G, H]
    return out.reshape(b, n, h).astype(qkv_bmh.dtype), k_out, v_out


def _cache_writing_call(kernel, specs, args, k_bskh, v_bskh, *, rows: int, plan: _Plan, blocks: DecodeBlockSizes,
                        interpret: bool, name: str):
    """The pallas_call of a kernel that also writes the new K/V rows: grid (B, K, splits); its
    inputs `args` (with `specs`), then the two caches, aliased to its last two outputs; outputs
    the partials o [B, K, splits, rows, H], m, l [B, K, splits, rows], and the caches."""
    b, _, kh, h = k_bskh.shape
    interpret = bool(interpret) or jax.default_backend() == "cpu"
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    cache_spec = pl.BlockSpec((None, plan.chunk, None, h), lambda i, j, c: (i, c, j, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, kh, plan.splits),
        in_specs=[*specs, cache_spec, cache_spec],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, h), lambda i, j, c: (i, j, c, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, j, c: (i, j, c, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, j, c: (i, j, c, 0)),
            cache_spec,
            cache_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, plan.splits, rows, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, plan.splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, plan.splits, rows), jnp.float32),
            jax.ShapeDtypeStruct(k_bskh.shape, k_bskh.dtype),
            jax.ShapeDtypeStruct(v_bskh.shape, v_bskh.dtype),
        ],
        input_output_aliases={len(specs): 3, len(specs) + 1: 4},
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(*args, k_bskh, v_bskh)


# ----------------------------------------------------------------------------------------------
# Rotated q/k/v in, the cache write and the attention on the tensor cores.
#
# For a projection kernel that already applied RoPE (decode_tma.qkv_rope_tma): the fused kernel's
# scheme (the new token's k/v written by the program whose chunk holds pos, its score as split 0's
# initial state, cache reads stopping before pos) with `_chunk_softmax`'s tensor-core dots. A
# program's q tile is the 16 rows of the projection output from its group's first head on: its G
# heads, then whatever heads follow, whose rows are computed and dropped (no padding copy).


def _rotated_kernel(pos_ref, q_ref, knew_ref, vnew_ref, k_ref, v_ref, o_ref, m_ref, l_ref, ko_ref, vo_ref, *,
                    block_s: int, chunk: int, sm_scale: float, g: int):
    """Refs: pos [1]; q [N + 2K, H] (this row's projection output: q tile read from it); knew,
    vnew [1, H]; k, v [chunk, H]; outputs o [G16, H], m, l [G16]; ko, vo [chunk, H] (aliased)."""
    split = pl.program_id(2)
    pos = pos_ref[0]
    start = split * chunk
    q = q_ref[pl.ds(pl.program_id(1) * g, MIN_ROWS), :]  # [16, H]: the group's G heads first
    qs = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
    dt = k_ref.dtype
    knew, vnew = knew_ref[...].astype(dt), vnew_ref[...].astype(dt)  # [1, H]

    @pl.when((pos >= start) & (pos < start + chunk))
    def _write():
        ko_ref[pl.ds(pos - start, 1), :] = knew
        vo_ref[pl.ds(pos - start, 1), :] = vnew

    # Split 0 starts from the new token alone; the others start empty (see _fused_kernel).
    s_new = jnp.sum(qs.astype(jnp.float32) * knew.astype(jnp.float32), axis=1)  # [16]
    first = 1.0 - jnp.minimum(split, 1).astype(jnp.float32)
    m0 = s_new * first + MASK_VALUE * (1.0 - first)
    l0 = first + jnp.zeros_like(s_new)
    acc0 = first * vnew.astype(jnp.float32) + jnp.zeros(q.shape, jnp.float32)

    n_valid = jnp.clip(pos - start, 0, chunk)
    n_tiles = (n_valid + block_s - 1) // block_s

    def body(i, carry):
        m_prev, l_prev, acc = carry
        k = k_ref[pl.ds(i * block_s, block_s), :]
        v = v_ref[pl.ds(i * block_s, block_s), :]
        sc = _dot(qs, k, (1, 1))  # [16, block_s]
        t = start + i * block_s + lax.broadcasted_iota(jnp.int32, sc.shape, 1)
        sc = jnp.where(t < pos, sc, MASK_VALUE)
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(sc - m_new[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, (1, 0))
        return m_new, l_new, acc

    m, l, acc = lax.fori_loop(0, n_tiles, body, (m0, l0, acc0))
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def rotated_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why decode_attention_rotated cannot take these heads (None: it can)."""
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MIN_ROWS:
        return f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}, at most {MIN_ROWS} per group"
    g = num_heads // num_kv_heads
    if (num_kv_heads - 1) * g + MIN_ROWS > num_heads + 2 * num_kv_heads:
        return f"the last group's {MIN_ROWS}-row q tile would run past the projection's {num_heads + 2 * num_kv_heads} heads"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} must be a power of two >= 16 (Triton tiles)"
    return None


@functools.partial(jax.jit, static_argnames=("num_heads", "blocks", "interpret"), donate_argnames=("k_bskh", "v_bskh"))
def decode_attention_rotated(qkv_bmh, pos_b, k_bskh, v_bskh, *, num_heads: int,
                             blocks: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False):
    """One decode step's attention from q/k/v with RoPE already applied, writing the new K/V.

    qkv [B, N + 2K, H] (e.g. decode_tma.qkv_rope_tma's output, its batch rows); pos [B] int32;
    k, v [B, S, K, H] caches (donated, updated in place). Returns (out [B, N, H], k, v), equal
    to writing k/v at pos and calling `decode_attention` with lengths pos + 1. As
    decode_attention_fused without the rotation, with tensor-core dots."""
    _check_blocks(blocks)
    _check_cache(k_bskh, v_bskh)
    if getattr(qkv_bmh, "ndim", None) != 3:
        raise ValueError(f"qkv must be 3-D [B, N + 2K, H], got shape {getattr(qkv_bmh, 'shape', None)}")
    b, m, h = qkv_bmh.shape
    bk, s, kh, hk = k_bskh.shape
    n = num_heads
    if m != n + 2 * kh or (bk, hk) != (b, h):
        raise ValueError(f"shapes disagree: qkv {qkv_bmh.shape} (want [B, {n} + 2 * {kh}, H]), k {k_bskh.shape}, v {v_bskh.shape}")
    pos_b = _check_lengths(pos_b, b, "pos")
    if (why := rotated_supported(n, kh, h)) is not None:
        raise ValueError(f"decode_attention_rotated: {why}")
    g = n // kh
    plan = _plan(b, kh, s, blocks)
    kernel = functools.partial(_rotated_kernel, block_s=blocks.block_s, chunk=plan.chunk, sm_scale=1.0 / math.sqrt(h),
                               g=g)
    specs = [
        pl.BlockSpec((1,), lambda i, j, c: (i,)),
        pl.BlockSpec((None, m, h), lambda i, j, c: (i, 0, 0)),  # the row's heads; q tile sliced inside
        pl.BlockSpec((None, 1, h), lambda i, j, c: (i, n + j, 0)),  # k head j
        pl.BlockSpec((None, 1, h), lambda i, j, c: (i, n + kh + j, 0)),  # v head j
    ]
    o, m_, l_, k_out, v_out = _cache_writing_call(kernel, specs, (pos_b.astype(jnp.int32), qkv_bmh, qkv_bmh, qkv_bmh),
                                                  k_bskh, v_bskh, rows=MIN_ROWS, plan=plan, blocks=blocks,
                                                  interpret=interpret, name="decode_attention_rotated")
    out = _combine(o, m_, l_)[:, :, :g]  # [B, K, G, H]
    return out.reshape(b, n, h).astype(qkv_bmh.dtype), k_out, v_out


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
    """Pure jnp: reads the whole cache and masks positions >= length. f32 softmax. A row with
    length <= 0 sees no position and returns zeros (as the kernels do), not the mean of v."""
    _check_cache(k_bskh, v_bskh)
    if getattr(q_bnh, "ndim", None) != 3:
        raise ValueError(f"q must be 3-D [B, N, H], got shape {getattr(q_bnh, 'shape', None)}")
    b, n, h = q_bnh.shape
    bk, _, kh, hk = k_bskh.shape
    if (bk, hk) != (b, h) or n % kh:
        raise ValueError(f"shapes disagree: q {q_bnh.shape} (N a multiple of K), k {k_bskh.shape}, v {v_bskh.shape}")
    lengths_b = _check_lengths(lengths_b, b)
    g = n // kh
    q_bkgh = q_bnh.reshape(b, kh, g, h)
    logits = jnp.einsum("bkgh,bskh->bkgs", q_bkgh, k_bskh, preferred_element_type=jnp.float32) / math.sqrt(h)
    valid_bs = jnp.arange(k_bskh.shape[1])[None, :] < lengths_b[:, None]
    logits = jnp.where(valid_bs[:, None, None, :], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(valid_bs.any(axis=-1)[:, None, None, None], probs, 0.0)  # empty rows: no weights
    out = jnp.einsum("bkgs,bskh->bkgh", probs.astype(v_bskh.dtype), v_bskh, preferred_element_type=jnp.float32)
    return out.reshape(b, n, h).astype(q_bnh.dtype)
