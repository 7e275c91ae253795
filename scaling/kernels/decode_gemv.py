"""The decode step's projections as Pallas kernels with their neighbours fused in.

A decode step at small batch is memory-bound: each weight byte is read once per step and
used for B multiply-adds. XLA runs a Llama layer's step as ~15 kernels (docs/decoding.md:
two RMSNorms, four gemms, RoPE, residual adds, SwiGLU, ...), nine of which move almost no
bytes but cost 1.3-2.5 us of launch and ramp each. These kernels fold that work into the
four weight reads:

    qkv_rope        RMSNorm -> x Wqkv -> RoPE on q and k; k, v written into the cache at
                    each row's position (in place); q returned
    matmul_residual a W + r  (output projection and down projection with their residual add)
    gate_up_swiglu  RMSNorm -> silu(x Wg) * (x Wu)
    norm_matmul     RMSNorm -> x W in f32 (the output head)

RMSNorm without a pass of its own: the norm's scale is folded into the weight rows once
(`fold_norm`), and the row statistic rsqrt(mean(x^2) + eps) is accumulated from the same
x tiles the matmul loads and applied to the f32 accumulator at the end:
    (x * r * s) W = r * (x (diag(s) W)).

Layout: weights are stored output-major, W^T [X, D] (each output feature's weights
contiguous, as torch's nn.Linear and gpt-fast's int8 GEMV keep them). A program owns a
block of output features and loops over the reduction in [BN, BK] weight tiles (then a
power-of-two tail, `_k_plan`).

Two ways to do the products, chosen by the batch (static): B >= 16 rows dot [B, BK] x tiles
with [BN, BK] weight tiles on the tensor cores (the smallest M of a Triton dot is 16). Fewer
rows (decoding at batch 1-8) take a vector path: products on the CUDA cores, accumulated
element-wise as [B, BN, BK] f32 and summed once after the loop (the layout of Inductor's GEMV
reductions that gpt-fast relies on). It needs no padding rows, and small BN gives the
thousands of small programs that keep every SM's loads in flight (a memory-bound kernel
hides latency by occupancy; a few large programs that stream one tile sequence each do not:
docs/decoding.md measured 18-60% of the copy bandwidth for those).

Each kernel has a pure-jnp reference below (`*_reference`), the tests' oracle; on a CPU
backend the kernels run in Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

MIN_ROWS = 16  # smallest M of a Triton tensor-core dot


@dataclasses.dataclass(frozen=True)
class GemvBlocks:
    """Tiles and launch parameters (defaults: the first guess measured in docs/decoding.md).

    block_k: the reduction tile (columns of W^T per load).
    block_n: output features per program for matmul_residual / gate_up_swiglu (gate and up
        each); qkv_rope's is the RoPE half-width per program (head_dim / 2 / rope_parts).
    rope_parts: programs per head in qkv_rope (each owns matching slices of both halves).
    prefetch: 1 = load the next W tile into registers before the current tile's dot (a
        software pipeline in the loop carry, on top of Triton's num_stages).
    """

    block_k: int = 256
    block_n: int = 16
    rope_parts: int = 2
    num_warps: int = 4
    num_stages: int = 4
    prefetch: int = 0


@dataclasses.dataclass(frozen=True)
class LayerBlocks:
    """GemvBlocks per kernel of a decoder layer (each weight shape tunes on its own)."""

    qkv: GemvBlocks = GemvBlocks()
    out: GemvBlocks = GemvBlocks()
    gate_up: GemvBlocks = GemvBlocks()
    down: GemvBlocks = GemvBlocks()
    head: GemvBlocks = GemvBlocks(block_n=64)

    @classmethod
    def parse(cls, spec: str) -> "LayerBlocks":
        """'qkv=256/16/2/4/4,down=512/32/1/4/3/1' (block_k/block_n/rope_parts/num_warps/num_stages
        [/prefetch]); kernels not named keep the defaults."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {}
        for item in filter(None, spec.split(",")):
            name, _, val = item.partition("=")
            if name not in fields:
                raise ValueError(f"gemv blocks: unknown kernel {name!r}; allowed: {sorted(fields)}")
            nums = [int(v) for v in val.split("/")]
            if len(nums) not in (5, 6):
                raise ValueError(f"gemv blocks {item!r}: want block_k/block_n/rope_parts/num_warps/num_stages[/prefetch]")
            kw[name] = GemvBlocks(*nums)
        return cls(**kw)


def _f32(x):
    return x.astype(jnp.float32)


def _dot_t(a, b):
    """a [M, K] . b [N, K]^T -> [M, N] f32 (f32 inputs at full precision, not TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _tensor_cores(b: int) -> bool:
    """Whether B rows take the tensor-core dot (else the CUDA-core vector path)."""
    return b >= MIN_ROWS


def _acc_init(b: int, n: int, bk: int):
    shape = (b, n) if _tensor_cores(b) else (b, n, bk)
    return jnp.zeros(shape, jnp.float32)


def _acc_add(acc, x, w):
    """acc + x [B, BK] . w [BN, BK]^T: a tensor-core dot into [B, BN], or element-wise products
    into [B, BN, BK] (reduced once by _acc_done, not per tile: no shuffles inside the loop)."""
    if _tensor_cores(x.shape[0]):
        return acc + _dot_t(x, w)
    return acc + _f32(x)[:, None, :] * _f32(w)[None, :, :]


def _acc_done(acc):
    return acc if acc.ndim == 2 else jnp.sum(acc, axis=2)


def _k_plan(k: int, want: int, b: int = MIN_ROWS) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """How a reduction of length k is tiled: (bk, full tiles, tail pieces (start, width)).
    bk = want (a power of two) or the largest power of two <= k; the remainder k mod bk is cut
    into power-of-two pieces (Triton block shapes), so k = 11008 (llama2_7b's mlp dim) keeps
    1024-wide tiles (10 of them, then 512 + 256) instead of 43 tiles of 256. k must be a
    multiple of 16 (the smallest piece: a tensor-core dot's K, and 32 bytes of bf16)."""
    if k % MIN_ROWS or want < MIN_ROWS or want & (want - 1):
        raise ValueError(f"reduction dim {k} must be a multiple of {MIN_ROWS} and block_k={want} a power of two "
                         f">= {MIN_ROWS}")
    bk = want
    while bk > k:
        bk //= 2
    full = k // bk
    pieces, start, rest = [], full * bk, k - full * bk
    width = bk // 2
    while rest:
        if rest >= width:
            pieces.append((start, width))
            start, rest = start + width, rest - width
        width //= 2
    return bk, full, tuple(pieces)


def _params(blocks: GemvBlocks, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _name(base: str, blocks: GemvBlocks) -> str:
    """Kernel name with its tiles, so a profile tells tile choices apart."""
    return f"{base}_k{blocks.block_k}_n{blocks.block_n}_p{blocks.rope_parts}_w{blocks.num_warps}_s{blocks.num_stages}"


def _interpret(interpret: bool) -> bool:
    return bool(interpret) or jax.default_backend() == "cpu"


def _min_n(b: int) -> int:
    """The smallest output block: a dot's N on the tensor-core path, one feature otherwise."""
    return MIN_ROWS if _tensor_cores(b) else 1


def _check_block_n(dim: int, bn: int, b: int, what: str) -> int:
    if bn < _min_n(b) or bn & (bn - 1) or dim % bn:
        raise ValueError(f"{what} {dim} must be a multiple of block_n={bn}, a power of two >= {_min_n(b)} at batch {b}")
    return bn


def _check_rows(b: int) -> None:
    if b < 1 or b & (b - 1):
        raise ValueError(f"batch {b} must be a power of two (Triton block shapes); pad the rows")


def fold_norm(w_dx, scale_d):
    """diag(scale) W, transposed to the kernels' output-major layout: [X, D], in f32."""
    return (_f32(w_dx) * _f32(scale_d)[:, None]).T


def _kslice(i, bk: int):
    """Columns [i * bk, (i + 1) * bk); a traced i is marked a multiple of bk for aligned loads
    (the prefetch prologue's i = 0 is a Python int, which multiple_of cannot lower)."""
    return pl.ds(i * bk if isinstance(i, int) else pl.multiple_of(i * bk, bk), bk)


def _k_loop(n: int, load, step, init, prefetch: int):
    """carry = step(i, load(i), carry) for i < n. prefetch: tile i + 1 is loaded before tile i's
    step runs (its registers are the loop carry), so its latency hides behind the dot."""
    if not prefetch:
        return lax.fori_loop(0, n, lambda i, c: step(i, load(i), c), init)

    def body(i, c):
        tiles, carry = c
        nxt = load(jnp.minimum(i + 1, n - 1))  # the last iteration re-loads its own tile
        return nxt, step(i, tiles, carry)

    return lax.fori_loop(0, n, body, (load(0), init))[1]


def _matmul_rows(x_ref, w_ref, row_blocks, n: int, *, k: int, bk: int, prefetch: int, norm_eps: float | None,
                 b: int | None = None):
    """x W^T for blocks of n rows of W^T ([B, n] f32 each), over the whole reduction k: full
    tiles of bk in a loop, then the _k_plan tail pieces. norm_eps: RMSNorm x first (the norm's
    scale folded into W), its statistic summed from the same x tiles the products load.
    b: the first b rows of x only (x padded beyond the batch); None = all of them."""
    b = x_ref.shape[0] if b is None else b
    _, full, tail = _k_plan(k, bk, b)

    def load(i):
        ks = _kslice(i, bk)
        return tuple(w_ref[rows, ks] for rows in row_blocks)

    def step(i, tiles, carry):
        accs, ss = carry
        x = x_ref[pl.ds(0, b), _kslice(i, bk)]
        accs = tuple(_acc_add(a, x, w) for a, w in zip(accs, tiles))
        return accs, ss + jnp.sum(_f32(x) * _f32(x), axis=1)

    init = (tuple(_acc_init(b, n, bk) for _ in row_blocks), jnp.zeros((b,), jnp.float32))
    accs, ss = _k_loop(full, load, step, init, prefetch) if full else init
    outs = [_acc_done(a) for a in accs]
    for start, width in tail:  # static pieces: each reduced on its own
        x = x_ref[pl.ds(0, b), pl.ds(start, width)]
        outs = [o + _acc_done(_acc_add(_acc_init(b, n, width), x, w_ref[rows, pl.ds(start, width)]))
                for o, rows in zip(outs, row_blocks)]
        ss = ss + jnp.sum(_f32(x) * _f32(x), axis=1)
    if norm_eps is None:
        return outs
    r = lax.rsqrt(ss / k + norm_eps)[:, None]
    return [o * r for o in outs]


# ----------------------------------------------------------------------------------------------
# qkv_rope


def _qkv_kernel(pos_ref, inv_ref, x_ref, w_ref, _k_in, _v_in, q_ref, k_ref, v_ref, *,
                n: int, kv: int, h: int, cols: int, bk: int, d: int, eps: float, prefetch: int, grouped: bool):
    """Program (head, part): output columns [part*cols, +cols) and [h/2 + part*cols, +cols) of
    one head (the RoPE pairs), for every row. Heads [0, n) are q, [n, n+kv) k, then v."""
    head, part = pl.program_id(0), pl.program_id(1)
    half = h // 2
    lo = head * h + part * cols
    b = pos_ref.shape[0]  # x may carry padding rows past the batch
    a_lo, a_hi = _matmul_rows(x_ref, w_ref, (pl.ds(lo, cols), pl.ds(lo + half, cols)), cols,
                              k=d, bk=bk, prefetch=prefetch, norm_eps=eps, b=b)

    pos = pos_ref[...]  # [B]: where each row's new token goes
    angles = _f32(pos)[:, None] * inv_ref[pl.ds(part * cols, cols)][None, :]
    # v heads pass through: cos -> 1, sin -> 0 (arithmetic: Triton lowers no where on a scalar i1).
    rot = 1.0 - jnp.minimum(jnp.maximum(head - (n + kv) + 1, 0), 1).astype(jnp.float32)
    cos = jnp.cos(angles) * rot + (1.0 - rot)
    sin = jnp.sin(angles) * rot
    out_lo = a_lo * cos - a_hi * sin  # layers.apply_rope's half-split pairs (i, i + h/2)
    out_hi = a_hi * cos + a_lo * sin
    c_lo, c_hi = pl.ds(part * cols, cols), pl.ds(half + part * cols, cols)

    @pl.when(head < n)
    def _q():
        if grouped:  # [B, K, 16, H]: query head `head` is row head % G of KV head head // G
            g = n // kv
            q_ref[:, head // g, head % g, c_lo] = out_lo.astype(q_ref.dtype)
            q_ref[:, head // g, head % g, c_hi] = out_hi.astype(q_ref.dtype)
        else:
            q_ref[:, head, c_lo] = out_lo.astype(q_ref.dtype)
            q_ref[:, head, c_hi] = out_hi.astype(q_ref.dtype)

    rows = lax.broadcasted_iota(jnp.int32, (b,), 0)

    @pl.when((head >= n) & (head < n + kv))
    def _k():
        k_ref[rows, pos, head - n, c_lo] = out_lo.astype(k_ref.dtype)
        k_ref[rows, pos, head - n, c_hi] = out_hi.astype(k_ref.dtype)

    @pl.when(head >= n + kv)
    def _v():
        v_ref[rows, pos, head - n - kv, c_lo] = out_lo.astype(v_ref.dtype)
        v_ref[rows, pos, head - n - kv, c_hi] = out_hi.astype(v_ref.dtype)


Q_LAYOUTS = ("heads", "groups")


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "blocks", "q_layout", "interpret"),
                   donate_argnames=("k_bskh", "v_bskh"))
def qkv_rope(x_bd, wqkv_xd, inv_freq, pos_b, k_bskh, v_bskh, *, num_heads: int, eps: float,
             blocks: GemvBlocks = GemvBlocks(), q_layout: str = "heads", interpret: bool = False):
    """RMSNorm(x) Wqkv, RoPE at pos on q and k, k/v written into the caches at pos.

    x [B, D] (or more rows: a padded batch, whose first B rows are used; B is the caches');
    wqkv [(N + 2K) H, D] = fold_norm(Wqkv, norm scale) in the compute dtype;
    inv_freq [H/2] f32 (layers.rope_frequencies); pos [B] int32 (< S); caches [B, S, K, H]
    (donated, updated in place). Returns (q, k cache, v cache) with q [B, N, H]
    (q_layout="heads") or [B, K, 16, H] (q_layout="groups": the flash-decoding kernel's tile,
    each KV head's G query heads in rows [0, G), rows [G, 16) unwritten; for
    decode_attention.decode_attention_grouped).
    """
    d = x_bd.shape[1]
    b, s, kv, h = k_bskh.shape
    n = num_heads
    if q_layout not in Q_LAYOUTS:
        raise ValueError(f"q_layout={q_layout!r}: allowed {Q_LAYOUTS}")
    grouped = q_layout == "groups"
    if grouped and (n % kv or n // kv > MIN_ROWS):
        raise ValueError(f"q_layout='groups' needs num_heads {n} a multiple of the KV heads {kv}, at most {MIN_ROWS} per KV head")
    if wqkv_xd.shape != ((n + 2 * kv) * h, d):
        raise ValueError(f"wqkv {wqkv_xd.shape} must be [(N + 2K) H, D] = {((n + 2 * kv) * h, d)}")
    if x_bd.shape[0] < b or v_bskh.shape != k_bskh.shape or pos_b.shape != (b,):
        raise ValueError(f"x {x_bd.shape} (want [>= B, D]), caches {k_bskh.shape}, {v_bskh.shape} (want [B, S, K, H] "
                         f"alike) and pos {pos_b.shape} (want [B]) disagree")
    _check_rows(b)
    parts = blocks.rope_parts
    cols = h // 2 // parts
    if h % (2 * parts) or cols < _min_n(b) or cols & (cols - 1):
        raise ValueError(f"head_dim {h} / 2 / rope_parts {parts} = {cols} must be a power of two >= {_min_n(b)} "
                         f"at batch {b}")
    bk = _k_plan(d, blocks.block_k, b)[0]
    interpret = _interpret(interpret)
    kernel = functools.partial(_qkv_kernel, n=n, kv=kv, h=h, cols=cols, bk=bk, d=d, eps=eps, prefetch=blocks.prefetch,
                               grouped=grouped)
    q, k_out, v_out = pl.pallas_call(
        kernel,
        grid=(n + 2 * kv, parts),
        out_shape=[
            jax.ShapeDtypeStruct((b, kv, MIN_ROWS, h) if grouped else (b, n, h), x_bd.dtype),
            jax.ShapeDtypeStruct(k_bskh.shape, k_bskh.dtype),
            jax.ShapeDtypeStruct(v_bskh.shape, v_bskh.dtype),
        ],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=_params(blocks, interpret),
        interpret=interpret,
        name=_name("decode_qkv_rope", blocks),
    )(pos_b.astype(jnp.int32), inv_freq.astype(jnp.float32), x_bd, wqkv_xd, k_bskh, v_bskh)
    return q, k_out, v_out


# ----------------------------------------------------------------------------------------------
# matmul_residual


def _residual_kernel(a_ref, w_ref, r_ref, o_ref, *, bn: int, bk: int, k: int, prefetch: int, b: int):
    cols = pl.ds(pl.program_id(0) * bn, bn)
    (acc,) = _matmul_rows(a_ref, w_ref, (cols,), bn, k=k, bk=bk, prefetch=prefetch, norm_eps=None, b=b)
    batch = pl.ds(0, b)
    o_ref[batch, cols] = (_f32(r_ref[batch, cols]) + acc).astype(o_ref.dtype)
    # Padding rows past the batch pass through unchanged, in power-of-two pieces (Triton's
    # tiles must be: 8 - B rows is 7 at batch 1).
    for start, size in _pow2_pieces(b, r_ref.shape[0]):
        pad = pl.ds(start, size)
        o_ref[pad, cols] = r_ref[pad, cols]


def _pow2_pieces(start: int, stop: int) -> list[tuple[int, int]]:
    """[start, stop) as consecutive (offset, size) pieces whose sizes are powers of two."""
    pieces = []
    while start < stop:
        size = 1 << ((stop - start).bit_length() - 1)
        pieces.append((start, size))
        start += size
    return pieces


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "rows"))
def matmul_residual(a_bk, w_dk, r_bd, *, blocks: GemvBlocks = GemvBlocks(), interpret: bool = False,
                    rows: int | None = None):
    """r + a W: a [B, K] (or more rows: a padded batch, whose first B rows are used); w [D, K]
    (W^T, output-major); r [R, D]. Returns [R, D] in r's dtype. rows: B, the batch rows to
    compute (None: all R); r's rows past them are padding and pass through unchanged, so a
    residual stream padded to the TMA kernels' 8 rows stays padded without an XLA pad."""
    k = a_bk.shape[1]
    d = r_bd.shape[1]
    b = r_bd.shape[0] if rows is None else rows
    if w_dk.shape != (d, k) or a_bk.shape[0] < b or not 0 < b <= r_bd.shape[0]:
        raise ValueError(f"shapes disagree: a {a_bk.shape} (want [>= {b}, K]), w {w_dk.shape} (want [{d}, {k}]), "
                         f"r {r_bd.shape} (want [>= {b}, D]), rows={rows}")
    _check_rows(b)
    bn = _check_block_n(d, blocks.block_n, b, "output dim")
    bk = _k_plan(k, blocks.block_k, b)[0]
    interpret = _interpret(interpret)
    return pl.pallas_call(
        functools.partial(_residual_kernel, bn=bn, bk=bk, k=k, prefetch=blocks.prefetch, b=b),
        grid=(d // bn,),
        out_shape=jax.ShapeDtypeStruct(r_bd.shape, r_bd.dtype),
        compiler_params=_params(blocks, interpret),
        interpret=interpret,
        name=_name("decode_matmul_residual", blocks),
    )(a_bk.astype(w_dk.dtype), w_dk, r_bd)


# ----------------------------------------------------------------------------------------------
# gate_up_swiglu


def _swiglu_kernel(x_ref, w_ref, o_ref, *, bn: int, bk: int, d: int, f: int, eps: float, prefetch: int):
    j = pl.program_id(0)
    gate_rows = pl.ds(j * bn, bn)
    g, u = _matmul_rows(x_ref, w_ref, (gate_rows, pl.ds(f + j * bn, bn)), bn, k=d, bk=bk, prefetch=prefetch, norm_eps=eps)
    o_ref[:, gate_rows] = (g * jax.nn.sigmoid(g) * u).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret"))
def gate_up_swiglu(x_bd, wgu_xd, *, eps: float, blocks: GemvBlocks = GemvBlocks(), interpret: bool = False):
    """silu(n(x) Wg) * (n(x) Wu) with n the RMSNorm: x [B, D]; wgu [2F, D] = fold_norm([Wg | Wu],
    norm scale) (gate rows first). Returns [B, F] in x's dtype."""
    b, d = x_bd.shape
    two_f = wgu_xd.shape[0]
    if wgu_xd.shape != (two_f, d) or two_f % 2:
        raise ValueError(f"wgu {wgu_xd.shape} must be [2F, D={d}]")
    f = two_f // 2
    _check_rows(b)
    bn = _check_block_n(f, blocks.block_n, b, "mlp dim")
    bk = _k_plan(d, blocks.block_k, b)[0]
    interpret = _interpret(interpret)
    return pl.pallas_call(
        functools.partial(_swiglu_kernel, bn=bn, bk=bk, d=d, f=f, eps=eps, prefetch=blocks.prefetch),
        grid=(f // bn,),
        out_shape=jax.ShapeDtypeStruct((b, f), x_bd.dtype),
        compiler_params=_params(blocks, interpret),
        interpret=interpret,
        name=_name("decode_gate_up_swiglu", blocks),
    )(x_bd, wgu_xd)


# ----------------------------------------------------------------------------------------------
# norm_matmul (the output head)


def _head_kernel(x_ref, w_ref, o_ref, *, bn: int, bk: int, d: int, eps: float, prefetch: int):
    rows = pl.ds(pl.program_id(0) * bn, bn)
    (acc,) = _matmul_rows(x_ref, w_ref, (rows,), bn, k=d, bk=bk, prefetch=prefetch, norm_eps=eps)
    o_ref[:, rows] = acc


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret"))
def norm_matmul(x_bd, w_xd, *, eps: float, blocks: GemvBlocks = GemvBlocks(), interpret: bool = False):
    """RMSNorm(x) W in f32 (the output head's logits): x [B, D]; w [X, D] = fold_norm(W, norm
    scale). Returns [B, X] f32."""
    b, d = x_bd.shape
    x_out = w_xd.shape[0]
    if w_xd.shape != (x_out, d):
        raise ValueError(f"w {w_xd.shape} must be [X, D={d}]")
    _check_rows(b)
    bn = _check_block_n(x_out, blocks.block_n, b, "output dim")
    bk = _k_plan(d, blocks.block_k, b)[0]
    interpret = _interpret(interpret)
    return pl.pallas_call(
        functools.partial(_head_kernel, bn=bn, bk=bk, d=d, eps=eps, prefetch=blocks.prefetch),
        grid=(x_out // bn,),
        out_shape=jax.ShapeDtypeStruct((b, x_out), jnp.float32),
        compiler_params=_params(blocks, interpret),
        interpret=interpret,
        name=_name("decode_norm_matmul", blocks),
    )(x_bd.astype(w_xd.dtype), w_xd)


# ----------------------------------------------------------------------------------------------
# References (pure jnp, f32 math): the tests' oracle.


def _norm_ref(x_bd, eps):
    x = _f32(x_bd)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def qkv_rope_reference(x_bd, wqkv_xd, inv_freq, pos_b, k_bskh, v_bskh, *, num_heads: int, eps: float):
    b = x_bd.shape[0]
    kv, h = k_bskh.shape[2], k_bskh.shape[3]
    y = jnp.dot(_norm_ref(x_bd, eps), _f32(wqkv_xd).T, precision=lax.Precision.HIGHEST)
    y = y.reshape(b, num_heads + 2 * kv, h)
    angles = _f32(pos_b)[:, None, None] * inv_freq[None, None, :]
    y1, y2 = y[..., : h // 2], y[..., h // 2 :]
    c, s = jnp.cos(angles), jnp.sin(angles)
    roped = jnp.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], axis=-1)
    q, k = roped[:, :num_heads], roped[:, num_heads : num_heads + kv]
    v = y[:, num_heads + kv :]
    rows = jnp.arange(b)
    k_bskh = k_bskh.at[rows, pos_b].set(k.astype(k_bskh.dtype))
    v_bskh = v_bskh.at[rows, pos_b].set(v.astype(v_bskh.dtype))
    return q.astype(x_bd.dtype), k_bskh, v_bskh


def matmul_residual_reference(a_bk, w_dk, r_bd):
    return (_f32(r_bd) + jnp.dot(_f32(a_bk), _f32(w_dk).T, precision=lax.Precision.HIGHEST)).astype(r_bd.dtype)


def norm_matmul_reference(x_bd, w_xd, *, eps: float):
    return jnp.dot(_norm_ref(x_bd, eps), _f32(w_xd).T, precision=lax.Precision.HIGHEST)


def gate_up_swiglu_reference(x_bd, wgu_xd, *, eps: float):
    f = wgu_xd.shape[0] // 2
    y = jnp.dot(_norm_ref(x_bd, eps), _f32(wgu_xd).T, precision=lax.Precision.HIGHEST)
    return (jax.nn.silu(y[:, :f]) * y[:, f:]).astype(x_bd.dtype)


# The vector path's tiles, from experiments/bench_gemv.py on an H100 (1b shapes, batch 1;
# docs/decoding.md): two output features (qkv: two RoPE pairs) per program, so a projection is
# 768-8192 programs; the whole 2048-wide reduction in one or two tiles.
VECTOR_GEMV = LayerBlocks(
    qkv=GemvBlocks(block_k=1024, block_n=2, rope_parts=0, num_warps=4, num_stages=2),
    out=GemvBlocks(block_k=2048, block_n=2, rope_parts=0, num_warps=4, num_stages=1),
    gate_up=GemvBlocks(block_k=2048, block_n=2, rope_parts=0, num_warps=4, num_stages=1),
    down=GemvBlocks(block_k=1024, block_n=2, rope_parts=0, num_warps=4, num_stages=2),
    head=GemvBlocks(block_k=2048, block_n=4, rope_parts=0, num_warps=8, num_stages=1),
)


# The H200 (bench_gemv.py on one H200, 1b and llama2_7b at batch 1; docs/decoding.md, sixth
# session): its faster memory favours other tiles than the H100's. Gate/up runs 2/1024 (7b
# 51.7 µs vs 56.7 with the H100 tiles), the head 16/256 (7b 70.3 vs 83.1 µs), and the down
# projection keeps ~1024 programs: 2 outputs x 1024 columns per program at hidden 2048 (1b 11.0
# µs; 4/512: 14.7), 4 x 512 at hidden 4096 (7b 25.5 µs; 2/1024: 29.7); see `_down_for_hidden`.
# At hidden <= 2048 gate/up takes one tile per row instead (`_gate_up_for_hidden`).
VECTOR_GEMV_H200 = LayerBlocks(
    qkv=VECTOR_GEMV.qkv,
    out=VECTOR_GEMV.out,
    gate_up=GemvBlocks(block_k=1024, block_n=2, rope_parts=0, num_warps=4, num_stages=2),
    down=VECTOR_GEMV.down,
    head=GemvBlocks(block_k=256, block_n=16, rope_parts=0, num_warps=4, num_stages=3),
)


def _down_for_hidden(down: GemvBlocks, hidden: int) -> GemvBlocks:
    """About 1024 programs for the down projection (hidden / block_n), the same bytes per step."""
    block_n = max(down.block_n, hidden // 1024)
    return dataclasses.replace(down, block_n=block_n, block_k=max(128, down.block_k * down.block_n // block_n))


def _gate_up_for_hidden(gate_up: GemvBlocks, hidden: int) -> GemvBlocks:
    """Up to hidden 2048 one 2048-wide tile spans the whole reduction (no loop): 1b gate/up 21.2
    µs on the H200 against 23.2 with 2/1024/4/2 (bench_gemv_h200.md); wider rows keep the table's."""
    if hidden <= 2048:
        return dataclasses.replace(gate_up, block_k=2048, num_stages=1)
    return gate_up


def vector_table(device_kind: str | None = None) -> LayerBlocks:
    """The vector path's tiles at 1-2 rows for this GPU (the first device's when None)."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    return VECTOR_GEMV_H200 if "H200" in device_kind else VECTOR_GEMV


def default_blocks(batch: int, head_dim: int, *, hidden: int | None = None,
                   device_kind: str | None = None) -> LayerBlocks:
    """Tiles for a decode step of `batch` rows: the tensor-core defaults from 16 rows, else
    the vector path's for this GPU (qkv: rope_parts set so that a program owns block_n RoPE
    pairs; on the H200 the down projection's block_n and the gate/up block_k also follow
    `hidden`, when given)."""
    if _tensor_cores(batch):
        return LayerBlocks()
    # The [B, BN, BK] f32 accumulator lives in registers: shrink BK as the batch grows.
    shrink = max(batch, 2) // 2

    def scaled(g: GemvBlocks) -> GemvBlocks:
        return dataclasses.replace(g, block_k=max(128, g.block_k // shrink))

    v = vector_table(device_kind)
    if v is VECTOR_GEMV_H200 and hidden is not None:
        v = dataclasses.replace(v, down=_down_for_hidden(v.down, hidden), gate_up=_gate_up_for_hidden(v.gate_up, hidden))
    qkv = dataclasses.replace(scaled(v.qkv), rope_parts=max(1, head_dim // 2 // v.qkv.block_n))
    return LayerBlocks(qkv=qkv, out=scaled(v.out), gate_up=scaled(v.gate_up), down=scaled(v.down), head=scaled(v.head))


def unsupported_reason(hidden: int, mlp_dim: int, num_heads: int, head_dim: int, vocab: int, batch: int,
                       blocks: LayerBlocks) -> str | None:
    """Why a model's shapes do not tile with these blocks at `batch` rows (None: they do)."""
    parts = blocks.qkv.rope_parts
    cols = head_dim // 2 // max(parts, 1)
    if parts < 1 or head_dim % (2 * parts) or cols < _min_n(batch) or cols & (cols - 1):
        return f"head_dim {head_dim} / 2 / qkv rope_parts {parts} must be a power of two >= {_min_n(batch)}"
    for name, dim, reduce_dim in (("out", hidden, num_heads * head_dim), ("down", hidden, mlp_dim),
                                  ("gate_up", mlp_dim, hidden), ("head", vocab, hidden)):
        bn = getattr(blocks, name).block_n
        if bn < _min_n(batch) or bn & (bn - 1) or dim % bn:
            return f"{name}: output dim {dim} is not a multiple of block_n {bn} (a power of two >= {_min_n(batch)})"
        if reduce_dim % MIN_ROWS:
            return f"{name}: reduction dim {reduce_dim} is not a multiple of {MIN_ROWS}"
    return None
