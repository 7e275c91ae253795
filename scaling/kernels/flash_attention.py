"""FlashAttention-2 forward and backward as Pallas kernels (Triton GPU lowering).

Reads in this order: the tile sizes (`BlockSizes`) and their tuned table; the static plan of a
call; the three kernels (forward, dK/dV, dQ) with comments tying them to Algorithms 1 and 2 of
the FlashAttention-2 paper (Dao, 2023, arXiv:2307.08691); the `pallas_call`s; the public
`flash_attention` with its `custom_vjp`. The pure-jnp reference lives in `reference.py`.

Layout: q [B, T, H, D], k and v [B, S, KV, D], with G = H // KV query heads per KV head.

GQA without repeating K/V: a program owns one KV head and folds `fold` query heads of its group
into the rows of its q tile, so the tile is [q_tokens * fold, D] and every K/V tile it loads
serves all of them. q viewed as [B, T, H // fold, fold, D] (a free reshape) gives that tile as
one strided block; row r of the tile is token t0 + r // fold, head h * fold + r % fold. `fold`
is the largest power of two that divides G (Triton tiles are powers of two; capped by the q
tiles, so a tile holds at least one token); when G has an odd
factor the remaining G // fold "chunks" run as separate programs that each read the K/V head
again, and their dK/dV partial sums are added outside the kernel.

Numerics: logits, the online softmax and all accumulators are f32 and kept in the log2
domain (exp2 is a single instruction; log2(e) is folded into the logit scale). Masked logits
are set to a large finite negative value, not -inf, so the running max never computes
inf - inf. A row with no visible key (only possible with segment ids) outputs 0 and stores
lse = +inf, which makes every recomputed probability, and so every gradient, exactly 0.

f32 inputs take the precision every other f32 matmul of the model takes: jax's
`jax_default_matmul_precision` ("highest" / "float32": full-f32 dots; unset: TF32 tensor cores
on the GPU, as XLA's own f32 dots). Full f32 ran on the FMA units at ~1.8 TFLOP/s on an H200,
which made the 1b's f32 train step 3.4x slower than XLA's TF32 attention (docs/benchmarks.md).
bf16 / f16 inputs round P and dS to the input dtype before their matmuls, as every flash
kernel does.

Lengths that are not multiples of the tiles are zero-padded in the wrapper. Non-causal calls
mask the padded keys (and skip tiles that hold only padding); causal calls need no extra mask
because a real query t < S never sees a key s > t, and padded query rows are dropped (their
dO is 0, so they add nothing to dK/dV).

Backward: by default two kernels, dK/dV (grid over K/V tiles) and dQ (grid over q tiles),
each recomputing P from the saved log-sum-exp; `BlockSizes.fused_dq` instead accumulates dQ
inside the dK/dV kernel with f32 atomics (fewer matmuls, but slower on an H200: see there).

Backend: Pallas' Triton lowering (`plgpu.CompilerParams`), which jax 0.11 marks deprecated in
favour of Mosaic GPU; on a CPU backend the same kernels run in Pallas interpret mode.
`backend="mosaic"` swaps in the Hopper kernels of `flash_attention_mgpu.py` (forward) and
`flash_attention_mgpu_bwd.py` (backward) for the calls they support.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from scaling.kernels import flash_attention_mgpu as mgpu
from scaling.kernels import flash_attention_mgpu_bwd as mgpu_bwd
from scaling.kernels.reference import SegmentIds, split_segment_ids

# Finite: the running max of a fully masked row stays this value instead of -inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2_E = math.log2(math.e)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = 256
MIN_TILE = 16  # smallest M, N and K of a Triton tensor-core dot


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the three kernels.

    Every tile is a power of two >= 16. "Rows" of a q tile count query positions times the
    query heads folded into the tile (see the module docstring), i.e. the M of its matmuls.

    Attributes:
      block_q: forward, rows of the q tile a program keeps on chip while it streams K/V.
      block_k: forward, K/V rows loaded per inner-loop step (the N of q kᵀ).
      block_q_dkv: dK/dV kernel, rows of the q / dO tile loaded per inner-loop step.
      block_k_dkv: dK/dV kernel, K/V rows a program owns and accumulates dK, dV for.
      block_q_dq: dQ kernel, rows of the q / dO tile a program owns and accumulates dQ for.
      block_k_dq: dQ kernel, K/V rows loaded per inner-loop step.
      num_warps_fwd / num_warps_dkv / num_warps_dq: warps per program of each kernel.
      num_stages_fwd / num_stages_dkv / num_stages_dq: software-pipelining depth of each
        kernel's inner loop (Triton prefetches this many K/V or q tiles ahead).
      fused_dq: False (default): a separate dQ kernel, deterministic. True: the dK/dV kernel
        also accumulates dQ with f32 atomic adds, 5 matmuls per tile pair instead of 7 (the
        dQ kernel recomputes q kᵀ and dO vᵀ), summed in a run-dependent order; measured 2-5×
        slower on an H200 (scalar atomics), kept for experiments. Ignored for f32 inputs.
        block_q_dq, block_k_dq and their warps/stages apply only to the separate dQ kernel.
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 64
    num_warps_fwd: int = 8
    num_warps_dkv: int = 8
    num_warps_dq: int = 8
    num_stages_fwd: int = 3
    num_stages_dkv: int = 2
    num_stages_dq: int = 2
    fused_dq: bool = False

    def tiles(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name.startswith("block_")}


# Tuned per (padded head dim, 4-byte inputs) by experiments/tune_attention.py on an H200
# (docs/attention.md: D=128 from run 3, whose bench used exactly this entry; D=64 and D=256 from
# run 1's sweep). The split backward won everywhere: the fused one ran at 55-128 TFLOP/s against
# 284 at D=128 (Triton issues one scalar f32 atomic per dQ element). f32 entries are not
# tuned: they halve the tiles so that f32 q, K and V tiles fit in shared memory.
BLOCK_SIZE_TABLE: dict[tuple[int, bool], BlockSizes] = {
    (64, False): BlockSizes(block_q=128, block_k=64, num_warps_fwd=8, num_stages_fwd=3,
                            block_q_dkv=64, block_k_dkv=64, num_warps_dkv=4, num_stages_dkv=3,
                            block_q_dq=128, block_k_dq=64, num_warps_dq=8, num_stages_dq=2),
    (128, False): BlockSizes(block_q=128, block_k=128, num_warps_fwd=8, num_stages_fwd=3,
                             block_q_dkv=64, block_k_dkv=64, num_warps_dkv=4, num_stages_dkv=2,
                             block_q_dq=128, block_k_dq=128, num_warps_dq=8, num_stages_dq=2),
    (256, False): BlockSizes(block_q=64, block_k=32, num_warps_fwd=4, num_stages_fwd=2,
                             block_q_dkv=64, block_k_dkv=64, num_warps_dkv=8, num_stages_dkv=1,
                             block_q_dq=128, block_k_dq=32, num_warps_dq=8, num_stages_dq=1),
    (64, True): BlockSizes(block_q=64, block_k=32, num_warps_fwd=4, num_stages_fwd=2,
                           block_q_dkv=32, block_k_dkv=64, num_warps_dkv=4, num_stages_dkv=1,
                           block_q_dq=64, block_k_dq=32, num_warps_dq=4, num_stages_dq=1),
    (128, True): BlockSizes(block_q=64, block_k=32, num_warps_fwd=4, num_stages_fwd=2,
                            block_q_dkv=32, block_k_dkv=64, num_warps_dkv=4, num_stages_dkv=1,
                            block_q_dq=64, block_k_dq=32, num_warps_dq=4, num_stages_dq=1),
    (256, True): BlockSizes(block_q=32, block_k=16, num_warps_fwd=4, num_stages_fwd=1,
                            block_q_dkv=16, block_k_dkv=32, num_warps_dkv=4, num_stages_dkv=1,
                            block_q_dq=32, block_k_dq=16, num_warps_dq=4, num_stages_dq=1),
}


def default_block_sizes(head_dim: int, dtype) -> BlockSizes:
    """The tuned entry for this head dim (rounded up to 64, 128 or 256) and dtype."""
    bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    return BLOCK_SIZE_TABLE[(bucket, jnp.dtype(dtype).itemsize == 4)]


# ----------------------------------------------------------------------------------------------
# The static plan of one call.


@dataclasses.dataclass(frozen=True)
class _Tiles:
    q_tokens: int  # query positions per q tile (rows = q_tokens * fold)
    k: int  # keys per K/V tile
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about a call: shapes after padding and folding, flags, tiles."""

    batch: int
    q_len: int
    kv_len: int
    q_pad: int
    kv_pad: int
    heads: int
    kv_heads: int
    fold: int
    head_dim: int
    head_dim_pad: int
    causal: bool
    segmented: bool
    sm_scale: float
    fwd: _Tiles
    dkv: _Tiles
    dq: _Tiles
    fused_dq: bool
    interpret: bool
    mosaic: mgpu.MosaicConfig | None = None  # forward by the Mosaic GPU kernel
    # Backward by the Mosaic GPU kernels; they read lse as [B, H, T], which the Mosaic forward
    # returns as it is and the Triton forward converts to when this is set.
    mosaic_bwd: mgpu_bwd.MosaicBwdConfig | None = None

    @property
    def chunks(self) -> int:  # programs per KV head (> 1 only when G has an odd factor)
        return self.heads // (self.kv_heads * self.fold)

    @property
    def head_programs(self) -> int:
        return self.heads // self.fold

    @property
    def tail(self) -> bool:  # padded keys are visible to real queries and must be masked
        return not self.causal and self.kv_pad != self.kv_len

    @property
    def has_mask(self) -> bool:
        return self.causal or self.tail or self.segmented


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _make_plan(q, k, *, causal, segmented, sm_scale, blocks: BlockSizes, interpret) -> _Plan:
    b, t, h, d = q.shape
    _, s, kv, _ = k.shape
    group = h // kv
    fold = group & -group  # largest power of two dividing the group
    fold = min(fold, blocks.block_q, blocks.block_q_dkv, blocks.block_q_dq)

    def tiles(block_q, block_k, warps, stages) -> _Tiles:
        # Never use tiles much longer than the sequence; keep rows >= MIN_TILE for the dot.
        q_tokens = min(block_q // fold, max(_next_pow2(t), max(1, MIN_TILE // fold)))
        k_tile = min(block_k, max(_next_pow2(s), MIN_TILE))
        return _Tiles(q_tokens, k_tile, warps, stages)

    fwd = tiles(blocks.block_q, blocks.block_k, blocks.num_warps_fwd, blocks.num_stages_fwd)
    dkv = tiles(blocks.block_q_dkv, blocks.block_k_dkv, blocks.num_warps_dkv, blocks.num_stages_dkv)
    dq = tiles(blocks.block_q_dq, blocks.block_k_dq, blocks.num_warps_dq, blocks.num_stages_dq)
    # All tiles are powers of two, so the largest one is a multiple of the others.
    q_align = max(fwd.q_tokens, dkv.q_tokens, dq.q_tokens)
    k_align = max(fwd.k, dkv.k, dq.k)
    if causal:  # one padded length keeps the diagonal where the loop bounds expect it
        q_pad = kv_pad = _round_up(t, max(q_align, k_align))
    else:
        q_pad, kv_pad = _round_up(t, q_align), _round_up(s, k_align)
    return _Plan(
        batch=b, q_len=t, kv_len=s, q_pad=q_pad, kv_pad=kv_pad, heads=h, kv_heads=kv, fold=fold,
        head_dim=d, head_dim_pad=max(MIN_TILE, _next_pow2(d)), causal=causal, segmented=segmented,
        sm_scale=float(sm_scale), fwd=fwd, dkv=dkv, dq=dq,
        # f32 inputs always take the split backward: with five full-f32 (FMA, not tensor-core)
        # dots the fused dK/dV/dQ kernel did not finish within ~90 s on an H200 (most likely
        # compiling; not investigated), while the split kernels compile and run.
        fused_dq=blocks.fused_dq and jnp.dtype(q.dtype).itemsize < 4, interpret=interpret,
    )


# ----------------------------------------------------------------------------------------------
# Pieces shared by the kernels.


def f32_dot_precision() -> lax.Precision:
    """The kernels' precision for f32 operands: full f32 only where jax's default matmul
    precision asks for it (then XLA's f32 dots are full f32 too), else TF32 like theirs."""
    asked = str(jax.config.jax_default_matmul_precision or "default").lower()
    return lax.Precision.HIGHEST if asked in ("highest", "float32") else lax.Precision.DEFAULT


def _dot(a, b, contract: tuple[int, int]):
    """a, b 2-D; contract one dim of each; f32 result; f32 operands at f32_dot_precision()."""
    precision = f32_dot_precision() if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _nt(a, b):  # a @ b.T
    return _dot(a, b, (1, 1))


def _nn(a, b):  # a @ b
    return _dot(a, b, (1, 0))


def _tn(a, b):  # a.T @ b
    return _dot(a, b, (0, 0))


def _as_rows(x):
    """[tokens, fold, D] -> [tokens * fold, D]; [tokens, D] (fold 1) unchanged."""
    return x if x.ndim == 2 else x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def _row_tokens(plan: _Plan, rows: int):
    """Token offset within the tile of each row: r // fold."""
    iota = jnp.arange(rows, dtype=jnp.int32)
    return iota if plan.fold == 1 else iota // plan.fold


def _mask(plan: _Plan, q_pos, k_pos, q_seg, kv_seg):
    """[rows, keys] visibility: causal, padded-key tail and segment masks, as the plan needs."""
    mask = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if plan.causal:
        mask = q_pos[:, None] >= k_pos[None, :]
    if plan.tail:  # broadcast before comparing: Triton cannot broadcast an i1 [1, N] tile
        k_full = jnp.broadcast_to(k_pos[None, :], (q_pos.shape[0], k_pos.shape[0]))
        mask = both(mask, k_full < plan.kv_len)
    if plan.segmented:
        mask = both(mask, q_seg[:, None] == kv_seg[None, :])
    return mask


def _div(x, n: int):
    """x // n for x >= 0 in int32: with jax_enable_x64 lax.div(int32 x, Python n) raised a dtype
    mismatch (n became int64), so every causal call failed under x64."""
    return lax.div(lax.convert_element_type(x, jnp.int32), np.int32(n))


def _kv_ranges(plan: _Plan, t0, q_tokens: int, block_k: int):
    """(unmasked, masked) ranges of K/V tile indices for the q tile starting at token t0.

    Causal: tiles entirely at or below the diagonal need no mask; tiles entirely above it are
    skipped by the loop bound (FlashAttention-2 section 3.1.1, "causal masking").
    """
    if plan.causal:
        hi = _div(t0 + q_tokens + block_k - 1, block_k)  # last tile holding a key <= t0 + q_tokens - 1
        full = _div(t0 + 1, block_k)  # tiles whose last key is <= t0
    else:  # tiles past the last real key (padding only) are never visited
        hi = -(-plan.kv_len // block_k)
        full = plan.kv_len // block_k
    if plan.segmented:
        return (0, 0), (0, hi)
    return (0, full), (full, hi)


def _q_ranges(plan: _Plan, s0, q_tokens: int, block_k: int):
    """(unmasked, masked) ranges of q tile indices for the K/V tile starting at key s0."""
    num_q = plan.q_pad // q_tokens
    if plan.causal:
        lo = _div(s0, q_tokens)  # first q tile holding a query >= s0
        full = jnp.minimum(_div(s0 + block_k - 1 + q_tokens - 1, q_tokens), num_q)  # t0 >= s0 + block_k - 1
    elif plan.tail:
        # A K/V tile holding padded keys runs masked; one holding only padding does not run.
        # (Arithmetic, not jnp.where: a select of two Python ints lowers to an i1 loop bound.)
        as_int = lambda x: lax.convert_element_type(x, jnp.int32)
        lo = as_int(s0 >= plan.kv_len) * num_q
        full = as_int(s0 + block_k > plan.kv_len) * num_q
    else:
        lo, full = 0, 0
    if plan.segmented:
        return (0, 0), (lo, num_q)
    return (full, num_q), (lo, full)


def _run(plan: _Plan, ranges, body, carry):
    """The unmasked loop, then the masked loop; each exists only if the plan can need it."""
    (lo_free, hi_free), (lo_mask, hi_mask) = ranges
    if not plan.segmented:
        carry = lax.fori_loop(lo_free, hi_free, functools.partial(body, masked=False), carry)
    if plan.has_mask:
        carry = lax.fori_loop(lo_mask, hi_mask, functools.partial(body, masked=True), carry)
    return carry


# ----------------------------------------------------------------------------------------------
# Kernels. Refs first, the static plan after.


def _logits(plan: _Plan, s, scale: float, *, masked: bool, mask_fn):
    """(logits, c): the log2-domain logits are `logits * c`.

    Unmasked tiles keep the raw q kᵀ and return c = scale, so the caller's `s * c - m` compiles
    to one FMA per element; masked tiles scale first, then write MASK_VALUE, and return c = 1.
    """
    if not masked:
        return s, scale
    return jnp.where(mask_fn(), s * scale, MASK_VALUE), 1.0


def _times(x, c: float):
    return x if c == 1.0 else x * c


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, plan: _Plan):
    """FlashAttention-2 Algorithm 1 for one q tile: stream K/V tiles, online softmax.

    q_ref [q_tokens, (fold,) D]; k_ref, v_ref [S_pad, D] (one KV head); q_seg_ref [rows];
    kv_seg_ref [S_pad]; o_ref like q_ref; lse_ref [rows] (log2 domain).
    """
    if plan.segmented:
        q_seg_ref, kv_seg_ref, o_ref, lse_ref = refs
    else:
        (o_ref, lse_ref), q_seg_ref, kv_seg_ref = refs, None, None
    tiles = plan.fwd
    rows, block_k = tiles.q_tokens * plan.fold, tiles.k
    qi = _q_tile_index(plan, tiles)
    t0 = qi * tiles.q_tokens
    q = _as_rows(q_ref[...])  # stays on chip for the whole loop
    q_pos = t0 + _row_tokens(plan, rows)
    q_seg = q_seg_ref[...] if plan.segmented else None
    scale = plan.sm_scale * LOG2_E

    def body(j, carry, *, masked):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        kv_slice = pl.ds(start, block_k)
        k_pos = start + jnp.arange(block_k, dtype=jnp.int32)
        mask_fn = lambda: _mask(plan, q_pos, k_pos, q_seg, kv_seg_ref[kv_slice] if plan.segmented else None)
        s, c = _logits(plan, _nt(q, k_ref[kv_slice, :]), scale, masked=masked, mask_fn=mask_fn)  # S_ij = Q_i K_jᵀ
        m_next = jnp.maximum(m_prev, _times(jnp.max(s, axis=1), c))  # m_i^(j); c > 0 commutes with max
        alpha = jnp.exp2(m_prev - m_next)  # rescales what was accumulated against the old max
        p = jnp.exp2(_times(s, c) - m_next[:, None])  # P~_ij
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        v = v_ref[kv_slice, :]
        acc = acc * alpha[:, None] + _nn(p.astype(v.dtype), v)  # O~_i, normalised once at the end
        return acc, m_next, l_next

    carry = (
        jnp.zeros((rows, plan.head_dim_pad), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = _run(plan, _kv_ranges(plan, t0, tiles.q_tokens, block_k), body, carry)
    if plan.segmented:  # a row that saw no key still holds the initial max
        empty = m == MASK_VALUE
        l = jnp.where(empty, 1.0, l)
    o = acc * (1.0 / l)[:, None]
    lse = m + jnp.log2(l)  # L_i, kept for the backward pass
    if plan.segmented:
        o = jnp.where(empty[:, None], 0.0, o)
        lse = jnp.where(empty, jnp.inf, lse)
    o_ref[...] = o.reshape(o_ref.shape).astype(o_ref.dtype)
    lse_ref[...] = lse


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan: _Plan):
    """FlashAttention-2 Algorithm 2, outer loop over K/V: one K/V tile, stream q / dO tiles.

    q_ref, do_ref [T_pad, (fold,) D]; k_ref, v_ref [block_k, D]; lse_ref, delta_ref
    [T_pad * fold]; q_seg_ref [T_pad * fold]; kv_seg_ref [block_k]; dk_ref, dv_ref [block_k, D].
    With `plan.fused_dq` also dq_ref [T_pad, (fold,) D] f32 (zero-initialised, aliased), into
    which each step atomically adds dS_ij K_j, as Algorithm 2 line 21 does with dQ in HBM.
    """
    refs = list(refs)
    q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if plan.segmented else (None, None)
    if plan.fused_dq:
        _, dk_ref, dv_ref, dq_ref = refs  # refs[0] is the aliased dq input; write via the output
    else:
        dk_ref, dv_ref = refs
    tiles = plan.dkv
    q_tokens, block_k = tiles.q_tokens, tiles.k
    rows = q_tokens * plan.fold
    s0 = pl.program_id(0) * block_k
    k = k_ref[...]
    v = v_ref[...]
    k_pos = s0 + jnp.arange(block_k, dtype=jnp.int32)
    kv_seg = kv_seg_ref[...] if plan.segmented else None
    row_tokens = _row_tokens(plan, rows)
    scale = plan.sm_scale * LOG2_E

    def body(i, carry, *, masked):
        dk, dv = carry
        t0 = pl.multiple_of(i * q_tokens, q_tokens)
        q_slice = pl.ds(t0, q_tokens)
        row_slice = pl.ds(pl.multiple_of(i * rows, rows), rows)
        q = _as_rows(q_ref[q_slice])
        do = _as_rows(do_ref[q_slice])
        mask_fn = lambda: _mask(plan, t0 + row_tokens, k_pos, q_seg_ref[row_slice] if plan.segmented else None, kv_seg)
        s, c = _logits(plan, _nt(q, k), scale, masked=masked, mask_fn=mask_fn)
        p = jnp.exp2(_times(s, c) - lse_ref[row_slice][:, None])  # P_ij recomputed from L_i
        dv = dv + _tn(p.astype(do.dtype), do)  # dV_j += P_ijᵀ dO_i
        dp = _nt(do, v)  # dP_ij = dO_i V_jᵀ
        ds = (p * (dp - delta_ref[row_slice][:, None])).astype(q.dtype)  # dS_ij = P_ij ∘ (dP_ij − D_i)
        dk = dk + _tn(ds, q)  # dK_j += dS_ijᵀ Q_i (sm_scale applied once, below)
        if plan.fused_dq:  # dQ_i += dS_ij K_j, summed across K/V programs in f32 (sm_scale: wrapper)
            dq = _nn(ds, k)
            idx = (q_slice,) + tuple(pl.ds(0, n) for n in dq_ref.shape[1:])
            plgpu.atomic_add(dq_ref, idx, dq.reshape((q_tokens, *dq_ref.shape[1:])))
        return dk, dv

    zeros = jnp.zeros((block_k, plan.head_dim_pad), jnp.float32)
    dk, dv = _run(plan, _q_ranges(plan, s0, q_tokens, block_k), body, (zeros, zeros))
    dk_ref[...] = (dk * plan.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan: _Plan):
    """FlashAttention-2 Algorithm 2's dQ, with the loop order swapped: one q tile, stream K/V.

    q_ref, do_ref [q_tokens, (fold,) D]; k_ref, v_ref [S_pad, D]; lse_ref, delta_ref, q_seg_ref
    [rows]; kv_seg_ref [S_pad]; dq_ref like q_ref.
    """
    if plan.segmented:
        q_seg_ref, kv_seg_ref, dq_ref = refs
    else:
        (dq_ref,), q_seg_ref, kv_seg_ref = refs, None, None
    tiles = plan.dq
    rows, block_k = tiles.q_tokens * plan.fold, tiles.k
    qi = _q_tile_index(plan, tiles)
    t0 = qi * tiles.q_tokens
    q = _as_rows(q_ref[...])
    do = _as_rows(do_ref[...])
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_pos = t0 + _row_tokens(plan, rows)
    q_seg = q_seg_ref[...] if plan.segmented else None
    scale = plan.sm_scale * LOG2_E

    def body(j, dq, *, masked):
        start = pl.multiple_of(j * block_k, block_k)
        kv_slice = pl.ds(start, block_k)
        k_pos = start + jnp.arange(block_k, dtype=jnp.int32)
        k = k_ref[kv_slice, :]
        mask_fn = lambda: _mask(plan, q_pos, k_pos, q_seg, kv_seg_ref[kv_slice] if plan.segmented else None)
        s, c = _logits(plan, _nt(q, k), scale, masked=masked, mask_fn=mask_fn)
        p = jnp.exp2(_times(s, c) - lse[:, None])
        dp = _nt(do, v_ref[kv_slice, :])
        ds = p * (dp - delta[:, None])
        return dq + _nn(ds.astype(k.dtype), k)  # dQ_i += dS_ij K_j

    dq = _run(plan, _kv_ranges(plan, t0, tiles.q_tokens, block_k), body,
              jnp.zeros((rows, plan.head_dim_pad), jnp.float32))
    dq_ref[...] = (dq * plan.sm_scale).reshape(dq_ref.shape).astype(dq_ref.dtype)


def _q_tile_index(plan: _Plan, tiles: _Tiles):
    """Causal q tiles run last-first: the longest programs start first and the tail is short."""
    i = pl.program_id(0)
    return plan.q_pad // tiles.q_tokens - 1 - i if plan.causal else i


# ----------------------------------------------------------------------------------------------
# pallas_calls.


def _pad_to(x, axis_sizes: dict[int, int]):
    pads = [(0, axis_sizes.get(a, n) - n) for a, n in enumerate(x.shape)]
    return x if all(p == (0, 0) for p in pads) else jnp.pad(x, pads)


def _pad_q(plan: _Plan, x):
    """[B, T, H, D] -> [B, T_pad, H // fold, fold, D_pad]: the folded view the kernels tile."""
    x = _pad_to(x, {1: plan.q_pad, 3: plan.head_dim_pad})
    return x.reshape(plan.batch, plan.q_pad, plan.head_programs, plan.fold, plan.head_dim_pad)


def _pad_kv(plan: _Plan, x):
    return _pad_to(x, {1: plan.kv_pad, 3: plan.head_dim_pad})


def _segment_args(plan: _Plan, seg):
    """Padded q ids repeated per folded row [B, T_pad * fold], padded kv ids [B, S_pad]."""
    q_seg, kv_seg = seg
    q_seg = _pad_to(q_seg, {1: plan.q_pad})
    if plan.fold > 1:
        q_seg = jnp.repeat(q_seg, plan.fold, axis=1)
    return q_seg, _pad_to(kv_seg, {1: plan.kv_pad})


def _q_block(plan: _Plan, q_tokens: int):
    """Block shape of a q-like tile in the folded 5-D view (fold squeezed away when 1)."""
    return (None, q_tokens, None, plan.fold if plan.fold > 1 else None, plan.head_dim_pad)


def _kv_head(plan: _Plan, h):
    return h if plan.chunks == 1 else h // plan.chunks


def _params(tiles: _Tiles):
    return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _q_major_index(plan: _Plan, tiles: _Tiles):
    """Index of the q tile of grid step i (mirrors `_q_tile_index`)."""
    n = plan.q_pad // tiles.q_tokens
    return (lambda i: n - 1 - i) if plan.causal else (lambda i: i)


def _mosaic_forward(q, k, v, plan: _Plan):
    """The Mosaic GPU forward, its lse converted to this module's layout.

    mgpu returns lse [B, H, T] (log2 domain, same definition as `_fwd_kernel`'s); the backward
    reads [B, H // fold, T_pad * fold] with row t * fold + f for head h * fold + f. Padded rows
    get lse = +inf (their recomputed P is 0; their dO and delta are 0 anyway).
    """
    o, lse = mgpu.mosaic_forward(q, k, v, causal=plan.causal, sm_scale=plan.sm_scale,
                                 config=plan.mosaic, interpret=plan.interpret)
    if plan.mosaic_bwd is not None:  # the Mosaic backward reads lse [B, H, T] as it is
        return o, lse
    b, hp, fold = plan.batch, plan.head_programs, plan.fold
    lse = lse.reshape(b, hp, fold, plan.q_len).transpose(0, 1, 3, 2)
    if plan.q_pad != plan.q_len:
        lse = jnp.pad(lse, ((0, 0), (0, 0), (0, plan.q_pad - plan.q_len), (0, 0)), constant_values=jnp.inf)
    return o, lse.reshape(b, hp, plan.q_pad * fold)


@functools.partial(jax.jit, static_argnames="plan")
def _forward(q, k, v, seg, plan: _Plan):
    if plan.mosaic is not None:
        # Mosaic GPU names every kernel `anonymous_mosaic_gpu_kernel`: the scope puts what it
        # is into the op's name, where a profile (scaling.profile_summary) reads it.
        with jax.named_scope("flash_attention_fwd"):
            return _mosaic_forward(q, k, v, plan)
    tiles = plan.fwd
    rows = tiles.q_tokens * plan.fold
    qi = _q_major_index(plan, tiles)
    q_spec = pl.BlockSpec(_q_block(plan, tiles.q_tokens), lambda i, b, h: (b, qi(i), h, 0, 0))
    kv_spec = pl.BlockSpec((None, plan.kv_pad, None, plan.head_dim_pad),
                           lambda i, b, h: (b, 0, _kv_head(plan, h), 0))
    in_specs = [q_spec, kv_spec, kv_spec]
    args = [_pad_q(plan, q), _pad_kv(plan, k), _pad_kv(plan, v)]
    if plan.segmented:
        in_specs += [pl.BlockSpec((None, rows), lambda i, b, h: (b, qi(i))),
                     pl.BlockSpec((None, plan.kv_pad), lambda i, b, h: (b, 0))]
        args += list(_segment_args(plan, seg))
    lse_shape = (plan.batch, plan.head_programs, plan.q_pad * plan.fold)
    o5, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, plan=plan),
        grid=(plan.q_pad // tiles.q_tokens, plan.batch, plan.head_programs),
        in_specs=in_specs,
        out_specs=[q_spec, pl.BlockSpec((None, None, rows), lambda i, b, h: (b, h, qi(i)))],
        out_shape=[jax.ShapeDtypeStruct(args[0].shape, q.dtype),
                   jax.ShapeDtypeStruct(lse_shape, jnp.float32)],
        compiler_params=_params(tiles),
        interpret=plan.interpret,
        name="flash_attention_fwd",
    )(*args)
    o = o5.reshape(plan.batch, plan.q_pad, plan.heads, plan.head_dim_pad)
    if plan.mosaic_bwd is not None:  # Triton forward + Mosaic backward: lse as [B, H, T]
        lse = lse.reshape(plan.batch, plan.head_programs, plan.q_pad, plan.fold)[:, :, : plan.q_len]
        lse = lse.transpose(0, 1, 3, 2).reshape(plan.batch, plan.heads, plan.q_len)
    return o[:, : plan.q_len, :, : plan.head_dim], lse


@functools.partial(jax.jit, static_argnames="plan")
def _backward(q, k, v, seg, o, lse, do, plan: _Plan):
    if plan.mosaic_bwd is not None:
        with jax.named_scope("flash_attention_bwd"):  # (see _forward)
            return mgpu_bwd.mosaic_backward(q, k, v, o, lse, do, causal=plan.causal, sm_scale=plan.sm_scale,
                                            config=plan.mosaic_bwd, interpret=plan.interpret)
    b, hp, fold = plan.batch, plan.head_programs, plan.fold
    # D_i = rowsum(dO_i ∘ O_i): one cheap fused XLA reduction, laid out like lse.
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, T, H]
    delta = _pad_to(delta, {1: plan.q_pad}).reshape(b, plan.q_pad, hp, fold)
    delta = delta.transpose(0, 2, 1, 3).reshape(b, hp, plan.q_pad * fold)
    q5, do5 = _pad_q(plan, q), _pad_q(plan, do)
    kp, vp = _pad_kv(plan, k), _pad_kv(plan, v)
    seg_args = list(_segment_args(plan, seg)) if plan.segmented else []

    # dK, dV: grid over K/V tiles; each program streams every q / dO tile of its head group.
    t = plan.dkv
    whole_q = pl.BlockSpec(_q_block(plan, plan.q_pad), lambda j, b, h: (b, 0, h, 0, 0))
    kv_tile = pl.BlockSpec((None, t.k, None, plan.head_dim_pad),
                           lambda j, b, h: (b, j, _kv_head(plan, h), 0))
    whole_rows = pl.BlockSpec((None, None, plan.q_pad * fold), lambda j, b, h: (b, h, 0))
    in_specs = [whole_q, kv_tile, kv_tile, whole_q, whole_rows, whole_rows]
    if plan.segmented:
        in_specs += [pl.BlockSpec((None, plan.q_pad * fold), lambda j, b, h: (b, 0)),
                     pl.BlockSpec((None, t.k), lambda j, b, h: (b, j))]
    # With chunks > 1 several programs write partial sums for one KV head: keep them f32.
    dkv_dtype = k.dtype if plan.chunks == 1 else jnp.float32
    dkv_shape = jax.ShapeDtypeStruct((b, plan.kv_pad, hp, plan.head_dim_pad), dkv_dtype)
    out_tile = pl.BlockSpec((None, t.k, None, plan.head_dim_pad), lambda j, b, h: (b, j, h, 0))
    out_specs, out_shape, args = [out_tile, out_tile], [dkv_shape, dkv_shape], [q5, kp, vp, do5, lse, delta, *seg_args]
    aliases = {}
    if plan.fused_dq:  # an f32 dQ accumulator, zeroed here, updated in place by atomic adds
        in_specs.append(whole_q)
        out_specs.append(whole_q)
        out_shape.append(jax.ShapeDtypeStruct(q5.shape, jnp.float32))
        aliases = {len(args): 2}
        args.append(jnp.zeros(q5.shape, jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_dkv_kernel, plan=plan),
        grid=(plan.kv_pad // t.k, b, hp),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=_params(t),
        interpret=plan.interpret,
        name="flash_attention_dkv",
    )(*args)
    dk, dv = outs[:2]
    if plan.fused_dq:
        dq5 = (outs[2] * plan.sm_scale).astype(q.dtype)
    else:
        dq5 = _dq_call(plan, q5, kp, vp, do5, lse, delta, seg_args)

    dq = dq5.reshape(b, plan.q_pad, plan.heads, plan.head_dim_pad)[:, : plan.q_len, :, : plan.head_dim]
    if plan.chunks > 1:  # add the partial sums of the programs sharing a KV head
        shape = (b, plan.kv_pad, plan.kv_heads, plan.chunks, plan.head_dim_pad)
        dk = dk.reshape(shape).sum(axis=3).astype(k.dtype)
        dv = dv.reshape(shape).sum(axis=3).astype(v.dtype)
    return dq, dk[:, : plan.kv_len, :, : plan.head_dim], dv[:, : plan.kv_len, :, : plan.head_dim]


def _dq_call(plan: _Plan, q5, kp, vp, do5, lse, delta, seg_args):
    """dQ: grid over q tiles; each program streams the K/V tiles its rows can see."""
    b, hp, fold = plan.batch, plan.head_programs, plan.fold
    t = plan.dq
    rows = t.q_tokens * fold
    qi = _q_major_index(plan, t)
    q_tile = pl.BlockSpec(_q_block(plan, t.q_tokens), lambda i, b, h: (b, qi(i), h, 0, 0))
    whole_kv = pl.BlockSpec((None, plan.kv_pad, None, plan.head_dim_pad),
                            lambda i, b, h: (b, 0, _kv_head(plan, h), 0))
    row_tile = pl.BlockSpec((None, None, rows), lambda i, b, h: (b, h, qi(i)))
    in_specs = [q_tile, whole_kv, whole_kv, q_tile, row_tile, row_tile]
    if plan.segmented:
        in_specs += [pl.BlockSpec((None, rows), lambda i, b, h: (b, qi(i))),
                     pl.BlockSpec((None, plan.kv_pad), lambda i, b, h: (b, 0))]
    return pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan),
        grid=(plan.q_pad // t.q_tokens, b, hp),
        in_specs=in_specs,
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
        compiler_params=_params(t),
        interpret=plan.interpret,
        name="flash_attention_dq",
    )(q5, kp, vp, do5, lse, delta, *seg_args)


# ----------------------------------------------------------------------------------------------
# Public API.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, plan: _Plan):
    return _forward(q, k, v, seg, plan)[0]


def _flash_fwd(q, k, v, seg, plan: _Plan):
    o, lse = _forward(q, k, v, seg, plan)
    return o, (q, k, v, seg, o, lse)  # residuals: inputs, output and log-sum-exp only


def _flash_bwd(plan: _Plan, res, do):
    q, k, v, seg, o, lse = res
    dq, dk, dv = _backward(q, k, v, seg, o, lse, do, plan)
    seg_ct = None if seg is None else (None, None)  # integer ids have no cotangent
    return dq, dk, dv, seg_ct


_flash.defvjp(_flash_fwd, _flash_bwd)


def _is_pow2(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _validate(q, k, v, causal, segment_ids, sm_scale, block_sizes):
    if not (isinstance(causal, (bool, np.bool_)) or (isinstance(causal, int) and causal in (0, 1))):
        raise TypeError(f"causal must be True or False, got {causal!r}")  # ("no" would read as True)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D ({'[B, T, H, D]' if name == 'q' else '[B, S, KV, D]'}), "
                             f"got shape {getattr(x, 'shape', None)}")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype={x.dtype} is not supported; allowed: bfloat16, float16, float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")
    b, t, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, S, KV, D], got {k.shape=}, {v.shape=}")
    kb, s, kv, kd = k.shape
    if kb != b:
        raise ValueError(f"k batch {kb} must equal q batch {b} ({q.shape=}, {k.shape=})")
    if kd != d:
        raise ValueError(f"k head dim {kd} must equal q head dim {d} ({q.shape=}, {k.shape=})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d=} must be in [1, {MAX_HEAD_DIM}] (64, 128 and 256 are tuned)")
    if kv < 1 or h % kv:  # (kv 0 was a ZeroDivisionError)
        raise ValueError(f"q heads {h=} must be a multiple of k/v heads {kv=} >= 1 (GQA groups)")
    if min(t, s) < 1:
        raise ValueError(f"sequence lengths must be >= 1, got q length {t=} and kv length {s=}")
    if min(b, h) < 1:  # were a ZeroDivisionError / a Pallas slice error from inside the kernel
        raise ValueError(f"batch and head counts must be >= 1, got batch {b=}, q heads {h=}")
    if causal and t != s:
        raise ValueError(f"causal=True needs equal q and kv lengths, got {t=} and {s=}; "
                         "use causal=False for cross attention")
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)) and len(segment_ids) != 2:
            raise ValueError(f"segment_ids pair must have 2 arrays (q [B, T], kv [B, S]), got {len(segment_ids)}")
        if not isinstance(segment_ids, (tuple, list)) and t != s:
            raise ValueError(f"a single segment_ids array needs equal q and kv lengths, got {t=} and {s=}; "
                             "pass a (q_segment_ids, kv_segment_ids) pair")
        pair = split_segment_ids(segment_ids)
        for name, ids, want in (("q_segment_ids", pair[0], (b, t)), ("kv_segment_ids", pair[1], (b, s))):
            if getattr(ids, "shape", None) != want:
                raise ValueError(f"{name} must have shape [B, T]={want}, got {getattr(ids, 'shape', None)}"
                                 if name == "q_segment_ids" else
                                 f"{name} must have shape [B, S]={want}, got {getattr(ids, 'shape', None)}")
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(f"{name}.dtype={ids.dtype} must be an integer type (int32)")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not (  # True would read as 1.0
            isinstance(sm_scale, numbers.Real) and math.isfinite(sm_scale) and sm_scale > 0)):
        raise ValueError(f"sm_scale must be a finite Python number > 0 or None, got {sm_scale!r}")
    if block_sizes is not None:
        if not isinstance(block_sizes, BlockSizes):
            raise TypeError(f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}")
        for f in dataclasses.fields(block_sizes):
            value = getattr(block_sizes, f.name)
            if f.name != "fused_dq" and (isinstance(value, bool) or not isinstance(value, int)):
                # A numpy int (a tuning sweep's np.arange) read "block_q=32 must be a power of two".
                raise TypeError(f"block_sizes.{f.name}={value!r} must be a Python int, got {type(value).__name__}")
        for name, size in block_sizes.tiles().items():
            if not _is_pow2(size) or size < MIN_TILE:
                raise ValueError(f"block_sizes.{name}={size} must be a power of two >= {MIN_TILE}")
        for f in dataclasses.fields(block_sizes):
            value = getattr(block_sizes, f.name)
            if f.name.startswith("num_warps") and not (_is_pow2(value) and value <= 32):
                # (32 warps = 1,024 threads, a CUDA block's limit)
                raise ValueError(f"block_sizes.{f.name}={value} must be a power of two in 1..32")
            if f.name.startswith("num_stages") and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"block_sizes.{f.name}={value} must be an int >= 1")
        if not isinstance(block_sizes.fused_dq, bool):
            raise ValueError(f"block_sizes.fused_dq={block_sizes.fused_dq!r} must be True or False")


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: SegmentIds = None,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    backend: str = "triton",
    mosaic_config: mgpu.MosaicConfig | None = None,
    mosaic_backward: bool = True,
    mosaic_bwd_config: mgpu_bwd.MosaicBwdConfig | None = None,
    bwd_workspace_bytes: int | None = None,
) -> jax.Array:
    """softmax(q kᵀ · sm_scale + mask) v with FlashAttention-2 Pallas kernels; differentiable.

    q: [B, T, H, D]; k, v: [B, S, KV, D] with H % KV == 0 (query head h uses KV head
    h // (H // KV)); dtypes bfloat16, float16 or float32 (all three the same); D <= 256.
    causal: query t sees keys s <= t; needs T == S.
    segment_ids: None, one int [B, T] array (needs T == S), or a (q [B, T], kv [B, S]) pair;
      a query sees only keys with an equal id. Rows that see no key output 0 (gradient 0).
    sm_scale: logit scale, default 1 / sqrt(D).
    block_sizes: tiles and launch parameters; default: the tuned `BLOCK_SIZE_TABLE` entry.
    interpret: run the kernels in Pallas interpret mode. On a CPU backend interpret mode is
      used automatically (the Triton kernels need a GPU), so the same code runs everywhere.
    backend: which kernels run. "triton" (default): the Triton-lowered Pallas kernels
      (`_fwd_kernel`, then the dK/dV + dQ pair). "mosaic": the Hopper forward of
      `flash_attention_mgpu.py` (wgmma, TMA ring, warp specialisation) when it supports the
      call, otherwise the Triton forward (it refuses segment ids, f32, head dims other than
      64/128/256 and lengths that are not multiples of its tiles; see
      `flash_attention_mgpu.unsupported_reason`); with the Mosaic forward, also the Hopper
      backward of `flash_attention_mgpu_bwd.py` when it supports the call (head dims 64/128,
      lengths multiples of 128 by default; see `flash_attention_mgpu_bwd.unsupported_reason`),
      otherwise the Triton backward. "auto": on an sm_90 GPU the faster measured forward
      (`mosaic_forward_preferred`: the Mosaic one on the H100 and H200 since it runs
      persistent) and the Mosaic backward whenever it supports the call (after a Triton forward
      too); "triton" elsewhere.
      On a CPU backend "mosaic" runs Pallas' GPU interpret mode (slow; for tests).
    mosaic_config: tiles of the Mosaic forward; default per head dim and device (`mgpu.default_config`).
    mosaic_backward: False keeps the Triton backward behind the Mosaic forward (a switch for
      comparisons and a fallback; no effect with backend="triton").
    mosaic_bwd_config: tiles of the Mosaic backward; default per head dim and key length
      (`mgpu_bwd.default_config`).
    bwd_workspace_bytes: with the default Mosaic backward tiles, the most temporary memory its
      dS workspace may take per chunk (None: 4 GiB; 0: none, the split kernels). See below.

    Returns [B, T, H, D] in q's dtype. The backward pass saves only q, k, v, the output and the
    per-row log-sum-exp, and recomputes the probabilities in two Pallas kernels (dK/dV, dQ).
    The Mosaic backward of multi-head D=128 attention (its default since the twelfth session)
    trades memory for speed inside the backward: the dK/dV kernel also writes dS, in the input
    dtype, to a temporary workspace that a third kernel turns into dQ (about B·H·T·S bytes, half
    of the 2-byte size when causal; in chunks of at most `MosaicBwdConfig.ds_workspace_max_bytes`,
    4 GiB by default, `bwd_workspace_bytes` otherwise). `bwd_workspace_bytes=0` (or
    `mosaic_bwd_config=MosaicBwdConfig()`) keeps the O(T) split kernels.
    """
    if not isinstance(mosaic_backward, bool):
        raise TypeError(f"mosaic_backward must be True or False, got {mosaic_backward!r}")
    if mosaic_bwd_config is not None and not isinstance(mosaic_bwd_config, mgpu_bwd.MosaicBwdConfig):
        raise TypeError(f"mosaic_bwd_config must be a MosaicBwdConfig or None, got {type(mosaic_bwd_config).__name__}")
    if mosaic_bwd_config is not None:
        mgpu_bwd.validate_config(mosaic_bwd_config)
    if bwd_workspace_bytes is not None and (isinstance(bwd_workspace_bytes, bool) or not isinstance(bwd_workspace_bytes, int)
                                            or bwd_workspace_bytes < 0):  # (True read as 1 byte)
        raise ValueError(f"bwd_workspace_bytes must be None or an int >= 0 (0: no dS workspace), got {bwd_workspace_bytes!r}")
    if not isinstance(interpret, (bool, np.bool_)):  # ("no" is truthy: interpret mode on a GPU)
        raise TypeError(f"interpret must be True or False, got {interpret!r}")
    _validate(q, k, v, causal, segment_ids, sm_scale, block_sizes)
    seg = split_segment_ids(segment_ids)
    if seg is not None:
        seg = (seg[0].astype(jnp.int32), seg[1].astype(jnp.int32))
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    blocks = block_sizes if block_sizes is not None else default_block_sizes(d, q.dtype)
    interpret = bool(interpret) or jax.default_backend() == "cpu"
    plan = _make_plan(q, k, causal=bool(causal), segmented=seg is not None, sm_scale=scale,
                      blocks=blocks, interpret=interpret)
    use_fwd = _use_mosaic(backend, q, k, causal=bool(causal), segmented=seg is not None, config=mosaic_config)
    if use_fwd:
        plan = dataclasses.replace(plan, mosaic=mosaic_config or mgpu.default_config(d))
    # "mosaic": the Mosaic backward behind the Mosaic forward; "auto" (Hopper): the Mosaic
    # backward whenever it supports the call, whichever forward ran.
    want_bwd = use_fwd or (backend == "auto" and is_hopper())
    bwd_config = mosaic_bwd_config
    if bwd_config is None and d in mgpu_bwd.HEAD_DIMS:
        bwd_config = mgpu_bwd.default_config(d, k.shape[1], bwd_workspace_bytes)
    if (mosaic_backward and want_bwd and seg is None and bwd_config is not None
            and mgpu_bwd.unsupported_reason(q.shape, k.shape, q.dtype, causal=bool(causal), segmented=False,
                                            config=bwd_config) is None):
        plan = dataclasses.replace(plan, mosaic_bwd=bwd_config)
    return _flash(q, k, v, seg, plan)


BACKENDS = ("triton", "mosaic", "auto")


def is_hopper() -> bool:
    """Whether the first device is an sm_90 (H100 / H200) GPU."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def _use_mosaic(backend, q, k, *, causal, segmented, config) -> bool:
    """Whether the Mosaic forward takes this call (silent fallback to Triton when unsupported)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if config is not None and not isinstance(config, mgpu.MosaicConfig):
        raise TypeError(f"mosaic_config must be a MosaicConfig or None, got {type(config).__name__}")
    if backend == "triton" or (backend == "auto" and not is_hopper()):
        return False
    reason = mgpu.unsupported_reason(q.shape, k.shape, q.dtype, causal=causal, segmented=segmented, config=config)
    if reason is not None:
        return False
    return backend == "mosaic" or mosaic_forward_preferred(q.shape, k.shape, causal=causal,
                                                           kind=mgpu.device_kind())


def mosaic_forward_preferred(q_shape, k_shape, *, causal: bool, kind: str) -> bool:
    """backend="auto" on Hopper: whether the Mosaic forward beats the Triton forward here.

    Yes on both measured GPUs since the Mosaic forward runs persistent (seventh session,
    docs/attention.md, "Persistent forward"; interleaved same-run timings, D=128 unless noted):
    on the H100 it was 0.98-1.08x cuDNN against the Triton forward's 0.73-0.86x (causal 2k-16k,
    non-causal 4k, GQA 4, D=64), on the H200 1.01-1.07x against 0.72-0.90x. Before it, the H100
    preferred the Triton forward for MHA at T <= 4k and for non-causal D=128, which the
    fifth session's rule encoded. Kept as a function (with its arguments) as the place for the
    next measured exception.
    """
    del q_shape, k_shape, causal, kind
    return True
