"""Decode projections whose weights stream by TMA (Mosaic GPU, Hopper): one kernel, four epilogues.

`gate_up_swiglu_tma` (the decoder's layers="pallas_tma"), `matmul_residual_tma` (the output and
down projections with the residual add), `norm_matmul_tma` (the head) and `qkv_rope_tma` (q/k/v
with RoPE, weight rows in `rope_row_order`; not yet in the decoder) share the kernel below; which
of the first three the decoder runs is TmaSettings.projections (docs/decoding.md, "Tenth
session" and "Eleventh session").

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
down projection (decode_gemv.matmul_residual) reads the batch rows of h8 directly. The residual
epilogue loads its [8, block_f] tile of r by TMA and reads it transposed into the accumulator's
layout; the head writes [V, 8] f32 (no layout stores an f32 tile transposed) and XLA transposes.

The statistic in the kernel (r8=None, norm_eps; what the decoder's layers="pallas_tma" runs since
the tenth session): a [8, block_k] tile has no register layout that reduces along its rows, so
the producer also copies each x tile, unswizzled, into a second small ring; the consumer loads
each of its 8 rows as a warpgroup-strided vector and adds its squares elementwise (no
cross-thread work per step), and after the last step reduces each row once. With it the decoder
needs no XLA kernel before this one: its residual stream stays padded to 8 rows for the whole
step (docs/decoding.md, "Tenth session").

Programmatic dependent launch (`pdl=True`, opt-in; measured in the eleventh session: no effect
inside XLA's command buffers, 7-16% per kernel without them, docs/decoding.md): at batch 1 a projection's
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


DEFAULT_BLOCKS = TmaBlocks()  # what the decoder runs unless its tma=TmaSettings(blocks=...) says otherwise
# The decoder's projections (layers="pallas_tma") that these kernels run by default; the gate/up
# always (a Decoder's `tma=TmaSettings(...)` overrides these module defaults). None: per model,
# the projections whose grid is wide enough (projections_by_grid). Measured in the decoder
# (eleventh session, docs/decoding.md): that choice was at least as fast as the gate/up alone and
# as every projection, on an H200 (7b 4.05 ms against 4.19 and 4.05; 1b 0.822 against 0.828 and
# 0.891) and an H100.
TMA_PROJECTIONS: tuple[str, ...] | None = None
PROJECTIONS = ("gate_up", "out", "down", "head")
# q/k/v by qkv_rope_tma, with the cache write in decode_attention_fused (RoPE already applied):
# an experiment (docs/decoding.md, "Eleventh session"); head_dim 2 block_f only, where the rope
# row order is the natural one
QKV = "qkv"
DEFAULT_PDL = False  # inside XLA's command buffers (the default) PDL does nothing: docs/decoding.md, "Eleventh session"


def smem_bytes(blocks: TmaBlocks, itemsize: int = 2, in_kernel_norm: bool = False, *, halves: int = 2,
               out_itemsize: int | None = None, residual: bool = False, rope: bool = False) -> int:
    """Shared memory of one CTA: per ring slot the x tile (twice with in_kernel_norm: a plain copy
    for the statistic), `halves` weight tiles; the output tile, the residual tile, and r8, or with
    in_kernel_norm the cross-warp reduction scratch Mosaic reserves for a kernel that reduces
    (plgpu.CompilerParams.reduction_scratch_bytes; the statistic's row sums)."""
    x_copies = 2 if in_kernel_norm else 1
    per_slot = (x_copies * ROWS + halves * blocks.block_f) * blocks.block_k * itemsize
    out = blocks.block_f * ROWS * (itemsize if out_itemsize is None else out_itemsize)
    res = blocks.block_f * ROWS * itemsize if residual else 0
    r = REDUCTION_SCRATCH if in_kernel_norm else ROWS * 4
    tables = 2 * blocks.block_f * ROWS * 4 if rope else 0  # qkv_rope_tma's cos and sin
    out *= 2 if rope else 1  # qkv_rope_tma writes both halves' features
    return blocks.stages * per_slot + out + res + r + tables


def unsupported_reason(hidden: int, mlp_dim: int, blocks: TmaBlocks | None = None,
                       in_kernel_norm: bool = False, **smem) -> str | None:
    """Why these kernels cannot take a reduction of `hidden` and `mlp_dim` outputs per weight half
    (the gate/up's names; None: they can). smem: smem_bytes' keywords for the other kernels."""
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
        return f"the outputs ({mlp_dim}) are not a multiple of block_f {blocks.block_f}"
    if hidden % blocks.block_k:
        return f"the reduction ({hidden}) is not a multiple of block_k {blocks.block_k}"
    if (need := smem_bytes(blocks, in_kernel_norm=in_kernel_norm, **smem)) > SMEM_BYTES:
        return f"the tiles need {need} bytes of shared memory, more than {SMEM_BYTES}"
    return None


@dataclasses.dataclass(frozen=True)
class TmaSettings:
    """What a decoder's TMA kernels run: a snapshot of this module's knobs, taken when the Decoder
    is built and passed to its compiled step as a static argument (so a later change of the knobs
    compiles a new step instead of reusing one traced before it)."""

    projections: tuple[str, ...] = ("gate_up",)
    pdl: bool = False
    blocks: TmaBlocks = TmaBlocks()


def settings(cfg=None, vocab_rows: int | None = None) -> TmaSettings:
    """The knobs as they are now: TMA_PROJECTIONS, DEFAULT_PDL, DEFAULT_BLOCKS. With
    TMA_PROJECTIONS None the projections are projections_by_grid's for this model (a
    ModelConfig; vocab_rows: the head's padded rows), the gate/up alone without one."""
    projections = TMA_PROJECTIONS
    if projections is None:
        projections = projections_by_grid(cfg, vocab_rows, DEFAULT_BLOCKS) if cfg is not None else ("gate_up",)
    return TmaSettings(tuple(projections), bool(DEFAULT_PDL), DEFAULT_BLOCKS)


def projections_reason(cfg, vocab_rows: int, tma: TmaSettings | None = None) -> str | None:
    """Why the decoder cannot run this model (a ModelConfig) with these kernels and `tma`'s
    projections and tiles (None: settings() for it); vocab_rows: the head's padded rows."""
    tma = settings(cfg, vocab_rows) if tma is None else tma
    projections = tma.projections
    if unknown := set(projections) - {*PROJECTIONS, QKV}:
        return f"unknown TMA projections {sorted(unknown)}; allowed {(*PROJECTIONS, QKV)}"
    attn_width = cfg.num_heads * cfg.resolved_head_dim
    shapes = {  # name: (reduction, outputs per half, smem_bytes keywords)
        "gate_up": (cfg.hidden_size, cfg.mlp_dim, dict(in_kernel_norm=True)),
        "out": (attn_width, cfg.hidden_size, dict(halves=1, residual=True)),
        "down": (cfg.mlp_dim, cfg.hidden_size, dict(halves=1, residual=True)),
        "head": (cfg.hidden_size, vocab_rows, dict(in_kernel_norm=True, halves=1, out_itemsize=4)),
    }
    if QKV in projections:
        h, bf = cfg.resolved_head_dim, tma.blocks.block_f
        if h != 2 * bf:
            return f"qkv projection: head_dim {h} must be 2 * block_f = {2 * bf} (the natural row order)"
        shapes[QKV] = (cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * h, dict(in_kernel_norm=True, rope=True))
    for name in ("gate_up", *projections):
        k, n, kw = shapes[name]
        if reason := unsupported_reason(k, n, tma.blocks, **kw):
            return f"{name} projection: {reason}"
    return None


# Without K splits a projection has outputs / block_f CTAs. On an H200 (132 SMs; tenth and
# eleventh sessions, docs/decoding.md) the TMA kernel lost to the Triton kernels with 32 CTAs
# (the 1b's output and down projections, 2048 outputs) and won with 64 and more (the 7b's output
# and down, 4096; every gate/up; the heads).
MIN_CTAS = 64


def projections_by_grid(cfg, vocab_rows: int, blocks: TmaBlocks | None = None) -> tuple[str, ...]:
    """The projections whose grid has at least MIN_CTAS CTAs at these tiles (the gate/up always):
    a TmaSettings.projections for this model (a ModelConfig); vocab_rows: the head's padded rows."""
    blocks = blocks or DEFAULT_BLOCKS
    outputs = {"out": cfg.hidden_size, "down": cfg.hidden_size, "head": vocab_rows}
    return ("gate_up", *(name for name, n in outputs.items() if n // blocks.block_f >= MIN_CTAS))


def row_rsqrt(x8, eps: float):
    """rsqrt(mean(x²) + eps) per row, f32: the RMSNorm statistic the kernel's epilogue applies."""
    x = x8.astype(jnp.float32)
    return lax.rsqrt(jnp.mean(x * x, axis=-1) + eps)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one projection kernel does (static)."""

    blocks: TmaBlocks
    k: int  # the reduction: x's columns
    n: int  # output columns (per weight half)
    halves: int  # 2: w = [Wg | Wu] and the SwiGLU epilogue; 1: w alone
    norm: str  # "none", "given" (r8 comes in) or "kernel" (the statistic from plain x copies)
    norm_eps: float | None
    residual: bool  # out = r + acc, r [8, n] in
    features_major: bool  # out [n, 8] (f32: Mosaic stores no transposed f32 tile), else [8, n]
    interpret: bool
    pdl: bool
    # q/k/v with RoPE (qkv_rope_tma): head_dim > 0. A CTA takes 2 block_f rows in rope order
    # (rope_row_order): ring 0 the first halves of its heads, ring 1 their rotary partners
    rope_head_dim: int = 0
    rope_rows: int = 0  # rows [0, rope_rows) rotate (q and k); the rest (v) do not

    def ref_names(self) -> list[str]:
        """The kernel's refs in order: inputs, the output, scratch, barriers."""
        halves = [f"w_ring{i}" for i in range(self.halves)]
        rope = bool(self.rope_head_dim)
        return (["x", *(["r8"] if self.norm == "given" else []), "w", *(["res"] if self.residual else []),
                 *(["cs"] if rope else []), "o",
                 "x_ring", *halves, *(["xp_ring"] if self.norm == "kernel" else []),
                 *(["r_smem"] if self.norm == "given" else []), *(["res_smem"] if self.residual else []),
                 *(["cs_smem"] if rope else []), "out_smem",
                 "x_full", *[f"w_full{i}" for i in range(self.halves)], "free",
                 *(["xp_full"] if self.norm == "kernel" else []), *(["r_full"] if self.norm == "given" else []),
                 *(["res_full"] if self.residual else []), *(["cs_full"] if rope else [])])


def _kernel(*refs, plan: _Plan):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ref = dict(zip(plan.ref_names(), refs, strict=True))
    x_ring, out_smem, free = ref["x_ring"], ref["out_smem"], ref["free"]
    w_rings = [ref[f"w_ring{i}"] for i in range(plan.halves)]
    w_fulls = [ref[f"w_full{i}"] for i in range(plan.halves)]
    bf, bk, stages = plan.blocks.block_f, plan.blocks.block_k, plan.blocks.stages
    steps = plan.k // bk
    f0 = lax.axis_index("f") * bf * (2 if plan.rope_head_dim else 1)  # the CTA's first output row
    wg = lax.axis_index("wg")
    interpret, in_kernel_norm = plan.interpret, plan.norm == "kernel"

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
            xp_ring = ref["xp_ring"]
            plgpu.barrier_wait(ref["xp_full"].at[slot])
            if interpret:
                return ss + jnp.square(xp_ring.at[slot][...].astype(jnp.float32))
            strided = plgpu.Layout.WG_STRIDED((bk,), vec_size=bk // 128)
            return tuple(acc + jnp.square(plgpu.load(xp_ring.at[slot, b], layout=strided).astype(jnp.float32))
                         for b, acc in enumerate(ss))

        def step(j, carry):
            accs, ss = carry
            slot = lax.rem(j, stages)
            for bar in (ref["x_full"], *w_fulls):
                plgpu.barrier_wait(bar.at[slot])
            accs = products(accs, tuple(w.at[slot] for w in w_rings), x_ring.at[slot])
            if in_kernel_norm:
                ss = squares(ss, slot)
            plgpu.barrier_arrive(free.at[slot])
            return accs, ss

        acc0 = jnp.zeros((bf, ROWS), jnp.float32)
        if not interpret:
            acc0 = plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)
        ss0 = ()
        if in_kernel_norm and interpret:
            ss0 = jnp.zeros((ROWS, bk), jnp.float32)
        elif in_kernel_norm:
            ss0 = tuple(plgpu.layout_cast(jnp.zeros((bk,), jnp.float32), plgpu.Layout.WG_STRIDED((bk,), vec_size=bk // 128))
                        for _ in range(ROWS))
        accs, ss = lax.fori_loop(0, steps, step, ((acc0,) * plan.halves, ss0))
        r = None
        if plan.norm == "given":
            plgpu.barrier_wait(ref["r_full"])
            r_smem = ref["r_smem"]
            r = r_smem[...] if interpret else plgpu.load(r_smem, layout=plgpu.Layout.WGMMA.reduce(0))
        elif in_kernel_norm and interpret:
            r = lax.rsqrt(ss.sum(axis=1) / plan.k + plan.norm_eps)
        elif in_kernel_norm:  # r[b] from row b's sum, placed in the layout that broadcasts over acc's columns
            row = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
            r = jnp.zeros((ROWS,), jnp.float32)
            for b, acc in enumerate(ss):
                r = jnp.where(row == b, lax.rsqrt(jnp.sum(acc) / plan.k + plan.norm_eps), r)
        if r is not None:
            r = lax.broadcast_in_dim(r, acc0.shape, [1])  # column b is row b of x
            accs = tuple(a * r for a in accs)
        parts = None
        if plan.rope_head_dim:  # rotate half: each first-half feature and its partner sit at the same place
            plgpu.barrier_wait(ref["cs_full"])
            cs = ref["cs_smem"]
            cos, sin = ((cs.at[i][...] if interpret else plgpu.load(cs.at[i], layout=plgpu.Layout.WGMMA))
                        for i in range(2))
            y1, y2 = accs
            parts = (y1 * cos - y2 * sin, y2 * cos + y1 * sin)
            h = None
        elif plan.halves == 2:
            g, u = accs
            h = g / (1.0 + jnp.exp(-g)) * u  # silu(g) * u
        else:
            (h,) = accs
        if plan.residual:  # the residual tile [8, block_f], read transposed like the output is written
            plgpu.barrier_wait(ref["res_full"])
            res_t = ref["res_smem"].T
            res = res_t[...] if interpret else plgpu.load(res_t, layout=plgpu.Layout.WGMMA)
            h = h + res.astype(jnp.float32)
        if parts is not None:  # the two halves side by side, rows of x's layout
            for i, part in enumerate(parts):
                out_smem.at[:, pl.ds(i * bf, bf)].T[...] = part.astype(out_smem.dtype)
            out_block = ref["o"].at[:, pl.ds(f0, 2 * bf)]
        elif plan.features_major:
            out_smem[...] = h.astype(out_smem.dtype)
            out_block = ref["o"].at[pl.ds(f0, bf)]
        else:
            out_smem.T[...] = h.astype(out_smem.dtype)  # [block_f, 8] stored as rows of x's layout
            out_block = ref["o"].at[:, pl.ds(f0, bf)]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_block)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        x_ref, w_ref = ref["x"], ref["w"]

        def load_x(j, slot):
            cols = pl.ds(j * bk, bk)
            plgpu.copy_gmem_to_smem(x_ref.at[:, cols], x_ring.at[slot], ref["x_full"].at[slot])
            if in_kernel_norm:  # a second, plain copy for the statistic
                plgpu.copy_gmem_to_smem(x_ref.at[:, cols], ref["xp_ring"].at[slot], ref["xp_full"].at[slot])

        hd = plan.rope_head_dim

        def load_w(j, slot):
            cols = pl.ds(j * bk, bk)
            for i, (ring, full) in enumerate(zip(w_rings, w_fulls)):
                # half i: rows [i * n, (i + 1) * n) (gate, up); with RoPE the CTA's rows [i * bf, (i + 1) * bf)
                start = f0 + i * bf if hd else i * plan.n + f0
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(start, bf), cols], ring.at[slot], full.at[slot])

        first = 0
        if plan.pdl:  # the weights do not depend on the previous kernel: fill the ring with them first,
            first = min(stages, steps)  # then wait for that kernel's writes (x, r, the residual) to be visible
            for j in range(first):
                load_w(j, j)
            plgpu.griddepcontrol_wait()
            for j in range(first):
                load_x(j, j)
        if plan.norm == "given":
            plgpu.copy_gmem_to_smem(ref["r8"], ref["r_smem"], ref["r_full"])
        if plan.residual:
            plgpu.copy_gmem_to_smem(ref["res"].at[:, pl.ds(f0, bf)], ref["res_smem"], ref["res_full"])
        if hd:  # the rotation's tables; v's rows: the second entry (cos 1, sin 0)
            place = jnp.where(f0 < plan.rope_rows, 0, 1)
            plgpu.copy_gmem_to_smem(ref["cs"].at[place], ref["cs_smem"], ref["cs_full"])

        @pl.loop(first, steps)
        def _fetch(j):
            slot = lax.rem(j, stages)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])
            load_x(j, slot)
            load_w(j, slot)

        if plan.pdl:  # every load is issued: the next kernel may start on the SMs this grid frees
            plgpu.griddepcontrol_launch_dependents()

        @pl.loop(max(steps - stages, 0), steps)
        def _drain(j):  # observe the last releases: every barrier phase is waited on once
            plgpu.barrier_wait(free.at[lax.rem(j, stages)])


def _project(x8, w, *, n: int, halves: int, r8=None, norm_eps=None, res=None, out_dtype, blocks, interpret, pdl,
             what: str, features_major: bool = False, cs=None, rope_head_dim: int = 0, rope_rows: int = 0):
    """The shared launcher: checks, the plan, shared memory, the grid."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    blocks = blocks or DEFAULT_BLOCKS
    if x8.ndim != 2 or x8.shape[0] != ROWS:
        raise ValueError(f"{what}: x8 must be [{ROWS}, K] (the batch padded to {ROWS} rows), got {x8.shape}")
    k = x8.shape[1]
    if w.shape != ((1 if rope_head_dim else halves) * n, k):
        raise ValueError(f"{what}: w {w.shape} must be [{'2F' if halves == 2 else 'N'}, K={k}]")
    if x8.dtype != w.dtype or x8.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"{what}: x8 and w must share a 16-bit dtype, got {x8.dtype} and {w.dtype}")
    if res is not None and (res.shape != (ROWS, n) or res.dtype != x8.dtype):
        raise ValueError(f"{what}: r8 must be [{ROWS}, N={n}] in {x8.dtype}, got {res.dtype} {res.shape}")
    norm = "given" if r8 is not None else "kernel" if norm_eps is not None else "none"
    out_itemsize = jnp.dtype(out_dtype).itemsize
    reason = unsupported_reason(k, n, blocks, in_kernel_norm=norm == "kernel", halves=halves,
                                out_itemsize=out_itemsize, residual=res is not None, rope=bool(rope_head_dim))
    if reason:
        raise ValueError(f"{what}: {reason}")
    params = interpret_params(interpret or jax.default_backend() == "cpu")
    pdl = DEFAULT_PDL if pdl is None else bool(pdl)
    plan = _Plan(blocks=blocks, k=k, n=n, halves=halves, norm=norm,
                 norm_eps=None if norm_eps is None else float(norm_eps), residual=res is not None,
                 features_major=features_major, interpret=params is not None, pdl=pdl and params is None,  # the interpreter has no griddepcontrol
                 rope_head_dim=rope_head_dim, rope_rows=rope_rows)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    bf, bk, stages = blocks.block_f, blocks.block_k, blocks.stages
    ring = lambda rows, **kw: plgpu.SMEM((stages, rows, bk), x8.dtype, **kw)  # noqa: E731
    scratch = [ring(ROWS, transforms=tiled), *[ring(bf, transforms=tiled) for _ in range(halves)]]
    if norm == "kernel":
        scratch.append(ring(ROWS))  # the plain x copies
    if norm == "given":
        scratch.append(plgpu.SMEM((ROWS,), jnp.float32))
    if res is not None:
        scratch.append(plgpu.SMEM((ROWS, bf), x8.dtype))
    if rope_head_dim:
        scratch.append(plgpu.SMEM((2, bf, ROWS), jnp.float32))  # cos and the signed sin
    scratch.append(plgpu.SMEM((bf, ROWS) if features_major else (ROWS, 2 * bf if rope_head_dim else bf), out_dtype))
    scratch += [plgpu.Barrier(num_barriers=stages) for _ in range(halves + 2)]  # x, weights landed; slot free
    if norm == "kernel":
        scratch.append(plgpu.Barrier(num_barriers=stages))  # plain x landed
    scratch += [plgpu.Barrier() for _ in range((norm == "given") + (res is not None) + bool(rope_head_dim))]
    operands = [x8, *([r8] if norm == "given" else []), w, *([res] if res is not None else []),
                *([cs] if rope_head_dim else [])]
    return plgpu.kernel(
        functools.partial(_kernel, plan=plan),
        out_type=jax.ShapeDtypeStruct((n, ROWS) if features_major else (ROWS, n), out_dtype),
        scratch_types=tuple(scratch),
        grid=(n // (2 * bf if rope_head_dim else bf),),
        grid_names=("f",),
        num_threads=2,
        thread_name="wg",
        interpret=params,
    )(*operands)


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
    if (r8 is None) == (norm_eps is None):
        raise ValueError("give exactly one of r8 (the statistic, row_rsqrt) and norm_eps (taken in the kernel)")
    if r8 is not None and (r8.shape != (ROWS,) or r8.dtype != jnp.float32):
        raise ValueError(f"r8 must be float32 [{ROWS}] (row_rsqrt), got {r8.dtype} {r8.shape}")
    if wgu.ndim != 2 or wgu.shape[0] % 2:
        raise ValueError(f"gate_up_swiglu_tma: wgu {wgu.shape} must be [2F, D]")
    return _project(x8, wgu, n=wgu.shape[0] // 2, halves=2, r8=r8, norm_eps=norm_eps, out_dtype=x8.dtype,
                    blocks=blocks, interpret=interpret, pdl=pdl, what="gate_up_swiglu_tma")


def rope_row_order(rows: int, head_dim: int, block_f: int = 64):
    """The row order qkv_rope_tma takes its weights in and writes its output in: per block of
    2 block_f rows (2 block_f / head_dim heads), the first halves of the block's heads, then their
    second halves, each half in head order. Rotate half (layers.apply_rope) pairs feature j < H/2 of
    a head with j + H/2, so a feature and its partner land at the same place of the CTA's two
    accumulators. The identity when head_dim = 2 block_f. Returns an int32 index array: w[order]."""
    per_block = 2 * block_f
    if head_dim % 2 or per_block % head_dim or rows % per_block:
        raise ValueError(f"rope_row_order: head_dim {head_dim} must be even and divide 2 * block_f = {per_block}, "
                         f"which must divide the rows ({rows})")
    half = head_dim // 2
    j = jnp.arange(per_block)
    head, within = (j % block_f) // half, j % half  # place in the block: half (j // block_f), head, feature
    in_block = head * head_dim + (j // block_f) * half + within
    return (jnp.arange(rows // per_block)[:, None] * per_block + in_block[None, :]).reshape(-1).astype(jnp.int32)


def from_rope_order(y, head_dim: int, block_f: int = 64):
    """qkv_rope_tma's output [..., rows] back in the natural row order (an XLA gather)."""
    order = rope_row_order(y.shape[-1], head_dim, block_f)
    return jnp.take(y, jnp.argsort(order), axis=-1)


def rope_tables(pos8, inv_freq, head_dim: int, block_f: int = 64):
    """The RoPE tables qkv_rope_tma reads: [2, 2, block_f, 8] f32, [0] for the q and k rows (cos,
    sin of the frequency of first-half feature i of the CTA's heads, in rope_row_order, for row
    b at position pos8[b]), [1] for v (cos 1, sin 0). pos8 [8] int32 (padding rows: any
    position); inv_freq [head_dim / 2] f32."""
    i = jnp.arange(block_f) % (head_dim // 2)
    angles = inv_freq[i][:, None] * pos8.astype(jnp.float32)[None, :]  # [block_f, 8]
    rot = jnp.stack([jnp.cos(angles), jnp.sin(angles)])
    ident = jnp.stack([jnp.ones_like(angles), jnp.zeros_like(angles)])
    return jnp.stack([rot, ident])


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "head_dim", "norm_eps", "blocks",
                                             "interpret", "pdl"))
def qkv_rope_tma(x8, wqkv_r, cs, *, num_heads: int, num_kv_heads: int, head_dim: int, norm_eps: float,
                 blocks: TmaBlocks | None = None, interpret=False, pdl: bool | None = None):
    """q, k and v with RoPE on q and k, for up to 8 rows: x8 [8, D] (the padded residual stream),
    wqkv_r = fold_norm(Wqkv, attention norm scale)[rope_row_order(...)] ([(N + 2K) H, D]),
    cs = rope_tables(positions, inv_freq, H). The norm statistic is taken in the kernel. Returns
    [8, (N + 2K) H] in x8's dtype, its columns in rope_row_order (from_rope_order restores q, k,
    v heads in order). Each CTA takes 2 block_f rows: the first halves of its heads in one ring,
    their rotary partners in the other, so the rotation is elementwise in the accumulators'
    layout. The cache write is not in this kernel (an experiment: docs/decoding.md, "Eleventh
    session")."""
    blocks = blocks or DEFAULT_BLOCKS
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    per_cta = 2 * blocks.block_f
    if head_dim % 2 or per_cta % head_dim or ((num_heads + num_kv_heads) * head_dim) % per_cta:
        raise ValueError(f"qkv_rope_tma: head_dim {head_dim} must be even and divide 2 * block_f = {per_cta}, which "
                         f"must divide the q and k rows ({(num_heads + num_kv_heads) * head_dim})")
    if wqkv_r.ndim != 2 or wqkv_r.shape[0] != rows:
        raise ValueError(f"qkv_rope_tma: wqkv_r {wqkv_r.shape} must be [(N + 2K) H = {rows}, D]")
    want = (2, 2, blocks.block_f, ROWS)
    if cs.shape != want or cs.dtype != jnp.float32:
        raise ValueError(f"qkv_rope_tma: cs must be float32 {want} (rope_tables), got {cs.dtype} {cs.shape}")
    return _project(x8, wqkv_r, n=rows, halves=2, norm_eps=norm_eps, out_dtype=x8.dtype, blocks=blocks,
                    interpret=interpret, pdl=pdl, what="qkv_rope_tma", cs=cs, rope_head_dim=head_dim,
                    rope_rows=(num_heads + num_kv_heads) * head_dim)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "pdl"))
def matmul_residual_tma(a8, w, r8, *, blocks: TmaBlocks | None = None, interpret=False, pdl: bool | None = None):
    """r8 + a8 Wᵀ: a8 [8, K], w [N, K] (output-major), r8 [8, N] (the residual stream, padded to
    8 rows). Returns [8, N] in r8's dtype; every row is computed (padding rows of zeros stay
    zeros). One CTA per block_f outputs, no K split (docs/decoding.md, "Tenth session": the 7b's
    output projection gains without one, the 1b's small projections do not). blocks, interpret,
    pdl: as for gate_up_swiglu_tma."""
    return _project(a8, w, n=w.shape[0], halves=1, res=r8, out_dtype=r8.dtype, blocks=blocks, interpret=interpret,
                    pdl=pdl, what="matmul_residual_tma")


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret", "pdl"))
def norm_matmul_tma(x8, w, *, eps: float, blocks: TmaBlocks | None = None, interpret=False, pdl: bool | None = None):
    """n(x8) Wᵀ in f32 (the output head): x8 [8, D], w [V, D] = fold_norm(head, final norm scale),
    the statistic taken in the kernel. Returns [8, V] f32: the kernel writes [V, 8] (Mosaic GPU
    in jax 0.11.2 finds no layout for an f32 tile stored transposed) and XLA transposes it, which
    it can fuse into what reads the logits. blocks, interpret, pdl: as for gate_up_swiglu_tma."""
    return _project(x8, w, n=w.shape[0], halves=1, norm_eps=eps, out_dtype=jnp.float32, blocks=blocks,
                    interpret=interpret, pdl=pdl, what="norm_matmul_tma", features_major=True).T
