"""Flash attention BACKWARD pass for Hopper GPUs, written with Pallas' Mosaic GPU backend.

The companion of `flash_attention_mgpu.py` (the forward): it consumes the forward's output O
and its log2-domain log-sum-exp L [B, H, T] and returns dQ, dK, dV. The algorithm is
FlashAttention-2's Algorithm 2 (Dao 2023, arXiv:2307.08691): P is recomputed from L, so
nothing of size T x S need be stored. The backward runs as two kernels plus one XLA reduction:

  delta = rowsum(dO * O)            [B, H, T] f32, a fused XLA reduction (memory bound, small)
  dK/dV kernel                      grid (S / (2 * block_kv_dkv), KV, B)
  dQ kernel                         grid (T / (2 * block_q_dq), H, B)

dK/dV kernel, one CTA per K/V tile of one KV head. Three warpgroups:
  * two consumers, each owning `block_kv_dkv` key rows: K and V stay in shared memory, dK and
    dV accumulate in registers (the f32 wgmma accumulator) across the whole loop;
  * one producer that streams (Q, dO, L, delta) tiles of every query head of the KV head's GQA
    group into a `stages_dkv`-deep shared-memory ring by TMA. Both consumers read every slot,
    so each Q/dO tile fetched serves 2 * block_kv_dkv keys, and the GQA sum over the group
    happens in the accumulators (nothing is repeated or materialised per query head).
  Per ring slot a consumer issues two wgmmas with shared-memory operands, Sᵀ = K Qᵀ and
  dPᵀ = V dOᵀ, waits once, computes Pᵀ = exp2(Sᵀ c − L) and dSᵀ = Pᵀ ∘ (dPᵀ − delta) on the
  accumulator fragments, and issues dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ and dSᵀ as register A
  operands (the transposed formulation of FlashAttention-2/3, which keeps dK/dV as
  row-major accumulators; Shah et al. 2024 use the same layout in FlashAttention-3).

dQ kernel, one CTA per pair of 64-row query tiles of one head (token pairing, as the forward's
MHA path): the consumers keep Q, dO, L and delta on chip, the producer streams K/V tiles (the
same ring as the forward), and per tile a consumer computes S = Q Kᵀ and dP = dO Vᵀ (two
shared-memory wgmmas, one wait), dS = P ∘ (dP − delta), and dQ += dS K (register A).

Why a separate dQ kernel rather than FlashAttention-3's in-kernel dQ (dS K accumulated into an
f32 dQ in HBM with atomic TMA reduce-adds): it is deterministic, it needs no f32 dQ buffer, and
jax 0.11.2's GPU interpret mode (our CPU tests) does not implement TMA reductions. It costs two
recomputed matmuls per tile pair (7 instead of 5).

dQ from the stored dS (`MosaicBwdConfig.dq_from_ds`, the default for multi-head D=128 since the
twelfth session): the dK/dV kernel also copies each dSᵀ tile it computes (already rounded to
the input dtype for dK += dSᵀ Q) to a workspace in global memory, and a third kernel streams
those tiles with K to form dQ = dS K: 5 matmuls per tile pair instead of 7, still deterministic,
for an O(T·S) workspace (B·H·T·S bytes in bf16, about half when causal, run in chunks of batch
rows or KV heads of at most `ds_workspace_max_bytes`). So this path does store something of size
T x S, for the length of one backward call; the split kernels above stay for GQA and on request.

Causal: a K/V tile skips every q tile entirely above the diagonal (the producer starts at the
first q tile that can see it); only tiles crossing the diagonal build the mask. The dQ kernel
skips K/V tiles past the diagonal the same way. Causal CTAs of the dQ kernel run longest-first.

Persistent grids (opt-in, `MosaicBwdConfig.persistent` / `persistent_dq`; forward+backward
2-6% slower than the split kernels on the H100 each, 4-10% both, docs/benchmarks.md, "Persistent
backward kernels"): one CTA per SM loops over every N-th work item of its kernel, numbered as the
plain grid launches them; the producer's ring runs on across items, the next item's stationary
tiles load while the current outputs are stored from buffers of their own (the forward's scheme,
`flash_attention_mgpu.py`).

Limits (refused by `unsupported_reason`; `flash_attention` then uses the Triton backward):
bf16 / f16; head dim 64 or 128 (at D=256 the two f32 accumulators dK, dV of one 64-row tile
alone need 256 registers per thread); no segment ids; T a multiple of 2 * block_q_dq and of
block_q_dkv, S a multiple of 2 * block_kv_dkv and of block_kv_dq; causal needs T == S.

Interpret mode (CPU tests): as in the forward (`_Geometry.in_place`), jax 0.11.2's interpreter
runs neither `pl.run_state` nor a wgmma with a register A operand, so the two register-A
products are `jnp.dot`s of the same operands there; the TMA ring, barriers, shared-memory
wgmmas, masking and stores are the code the GPU runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from scaling.kernels.flash_attention_mgpu import (LOG2_E, _div, _rem, common_unsupported_reason, interpret_params,
                                                  persistent_items, sm_count, work_item)

HEAD_DIMS = (64, 128)
FUSED_HEAD_DIM = 128  # fused_dq splits dS K's columns over the consumers in 64-column tiles
CONSUMERS = 2  # compute warpgroups per CTA; the producer is warpgroup CONSUMERS


@dataclasses.dataclass(frozen=True)
class MosaicBwdConfig:
    """Tiling of the Mosaic backward.

    block_q_dkv: query rows per ring slot of the dK/dV kernel (N of Sᵀ = K Qᵀ, K of dV += Pᵀ dO).
    block_kv_dkv: key rows per consumer of the dK/dV kernel (M of all its matmuls; 64 or 128).
      A CTA covers 2 * block_kv_dkv keys.
    stages_dkv: depth of the (Q, dO, L, delta) ring, >= 2.
    block_q_dq: query rows per consumer of the dQ kernel (64: one wgmma row block). A CTA
      covers 2 * block_q_dq queries.
    block_kv_dq: keys per ring slot of the dQ kernel (N of S = Q Kᵀ, K of dQ += dS K).
    stages_dq: depth of the K/V ring of the dQ kernel, >= 2.
    delta_in_dq: compute delta = rowsum(dO ∘ O) inside the dQ kernel (its consumers hold dO
      already and load their O tile too), which then writes delta out for the dK/dV kernel,
      launched after it; False: one XLA reduction before both kernels.
    persistent: the dK/dV kernel launches one CTA per SM, each looping over every N-th
      (K/V tile, KV head, batch) item, as the persistent forward does (flash_attention_mgpu.py):
      the (Q, dO, L, delta) ring runs on across items, a consumer loads its next K/V tile as
      soon as its last products are done, and dK/dV are staged in buffers of their own. Not
      with fused_dq. Off by default: 2-6% slower forward+backward on the H100 (docs/benchmarks.md).
    persistent_dq: the same for the dQ kernel (items: 128-query tile, head, batch; dQ staged in
      a buffer of its own). Not with delta_in_dq. Off by default: 2-4% slower on the H100.
    persistent_ctas: CTAs of the persistent grids; 0 = the device's SM count.
    fused_dq: no dQ kernel: the dK/dV kernel also computes dQ (FlashAttention-3's scheme; 5
      matmuls per tile pair instead of 7). Per ring slot both consumers store their dSᵀ rows to
      shared memory, meet at a barrier, and each computes one half of the head dim of
      dQ_tile = dS K over all 2 * block_kv_dkv keys of the CTA (so each tile is reduced once per
      CTA, not once per consumer), then adds it into an f32 dQ in global memory with a TMA
      reduce-add. The order of the f32 additions varies from run to run, so dQ is not bitwise
      reproducible. Head dim 128 only (the split needs whole 64-column swizzle tiles). The
      block_q_dq, block_kv_dq, stages_dq and delta_in_dq fields are then unused. Off by default
      (docs/attention.md, "Fused dQ").
    dq_stage_buffers: with fused_dq, f32 staging tiles per consumer for its dQ half (1 or 2).
      With 1, a consumer waits, before each store, until the TMA reduce-add of the previous step
      has read the tile; with 2 it alternates, so it waits only for the one two steps back
      (32 KB more shared memory). Timed on an H200 (eleventh session): 10-12% slower than 1.
    dq_stage_swizzle: with fused_dq, the staging tiles' shared-memory swizzle in bytes (128, 64,
      32; 0: none, row-major). The seventh session measured the f32 staging store as the fused
      kernel's largest cost; this tries the store's bank pattern. Timed on an H200 (eleventh
      session): 0 and 64 within 2% of 128, the fused kernel still 4-10% behind the split ones.
    dq_from_ds: 5 matmuls per tile pair, deterministic, at the price of an O(T²) workspace. The
      dK/dV kernel also writes each dSᵀ tile it computes (already rounded to the input dtype for
      dK += dSᵀ Q) to a workspace in global memory, and a third kernel computes dQ = dS K from it:
      one matmul per tile pair instead of the dQ kernel's three, plus streaming the dS tiles.
      Workspace: the visible [block_kv_dkv, block_q_dkv] tiles of every (batch, head), packed
      (`ds_workspace_bytes`: B·H·T·S·itemsize, about half that when causal). Needs
      block_q_dkv == block_kv_dkv; not with fused_dq, delta_in_dq or the persistent grids. Off
      by default (docs/attention.md, twelfth session).
    ds_workspace_max_bytes: with dq_from_ds, the most workspace one chunk may take. Larger calls
      run in chunks of whole batch rows, or of a row's KV heads (at least one per chunk), each
      chunk's two kernels before the next chunk's.
    ds_dq_tiles: with dq_from_ds, query tiles (of block_kv_dkv rows) per CTA of its dQ kernel, 2
      or 4 (each consumer then keeps two accumulators). Every tile of a CTA shares its K tiles,
      so 4 halves the K bytes each dS byte costs; its K and dSᵀ ring then fits 3 stages.
      Timed on an H200 (twelfth session): no faster than 2, so 2 stays the default.
    ds_dq_head_major: with dq_from_ds, launch each head's dQ CTAs together (the tile axis varies
      fastest), so the K tiles they all stream come from L2 after the first read; False
      launches every head's heaviest tile first. Timed on an H100 (thirteenth session): the dQ
      kernel 38-55% slower (2.02 -> 2.79 ms at 8k, 3.64 -> 5.26 at 16k), so K reads were not
      what held it back.
    dkv_head_major: the same launch order for the multi-head dK/dV kernel. Timed with
      ds_dq_head_major (thirteenth session): 15-30% slower at 4k, level at 16k.
    """

    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    stages_dkv: int = 2
    block_q_dq: int = 64
    block_kv_dq: int = 64
    stages_dq: int = 2
    delta_in_dq: bool = False
    fused_dq: bool = False
    persistent: bool = False
    persistent_dq: bool = False
    persistent_ctas: int = 0
    dq_stage_buffers: int = 1
    dq_stage_swizzle: int = 128
    dq_from_ds: bool = False
    ds_workspace_max_bytes: int = 4 << 30
    ds_dq_tiles: int = 2
    ds_dq_head_major: bool = False
    dkv_head_major: bool = False


# Per head dim, from experiments/check_mgpu_bwd.py on an H100 (docs/attention.md, "Mosaic GPU
# backward"): D=64 with 128-row q slots and 128-key dQ slots ran 2.2 ms against 2.5 ms for 64/64
# (B4 T4k H32 causal); D=128 has no register room for 128-row q slots (dK, dV, Sᵀ, dPᵀ would take
# 256 registers per thread), and 128-key dQ slots or a third dK/dV stage were within noise.
DEFAULT_CONFIGS = {
    64: MosaicBwdConfig(block_q_dkv=128, block_kv_dq=128),
    128: MosaicBwdConfig(),
}
# Long rows at D=128 take 128-key dQ slots: forward+backward 0.96 vs 0.94 (H100, eighth session)
# and 0.95 vs 0.94 (H200, ninth session) of cuDNN at T=16k, the dQ kernel 4% faster in both
# runs; at 8k they were 1-2% slower on both GPUs (docs/benchmarks.md).
LONG_KV_DQ = (16384, MosaicBwdConfig(block_kv_dq=128))
# D=128 takes dQ from the stored dSᵀ. Twelfth session, multi-head, causal, forward+backward
# against cuDNN: H100 1.10 / 0.97 / 0.97 at T = 4k / 8k / 16k against the split kernels' 1.03 /
# 0.93 / 0.93. Thirteenth session, chunks written in place and even: bench_attention.py, H200 1.13 /
# 1.07 / 1.04, H100 1.10 / 1.03 / 0.99; with GQA 4 (check_mgpu_bwd.py) at 8k / 16k H100 1.07 / 0.97
# against the split kernels' 1.03-1.05 / 0.97-0.98, H200 1.11 / 1.01 against 1.01 / 0.95-0.96
# (docs/benchmarks.md, issue 5). One chunk (a workspace budget above the 8.6 GB that 16k needs at
# 32 query heads) adds 3-5% at 16k.
D128_FROM_DS = MosaicBwdConfig(dq_from_ds=True, stages_dq=4)


def default_config(head_dim: int, kv_len: int | None = None, workspace_bytes: int | None = None) -> MosaicBwdConfig:
    """The tiles for this head dim (and key length, where it matters; kv_len None: a short row).
    workspace_bytes: the most a dq_from_ds workspace may take per chunk (None: `D128_FROM_DS`'s;
    0: no workspace, the split kernels). Grouped heads take the same tiles (thirteenth session)."""
    if head_dim == 128 and workspace_bytes != 0:
        if workspace_bytes is None:
            return D128_FROM_DS
        return dataclasses.replace(D128_FROM_DS, ds_workspace_max_bytes=workspace_bytes)
    min_len, long_cfg = LONG_KV_DQ
    if head_dim == 128 and kv_len is not None and kv_len >= min_len:
        return long_cfg
    return DEFAULT_CONFIGS[head_dim]


def unsupported_reason(q_shape, k_shape, dtype, *, causal: bool, segmented: bool,
                       config: MosaicBwdConfig | None = None) -> str | None:
    """Why the Mosaic backward cannot take this call (None when it can)."""
    b, t, h, d = q_shape
    _, s, kv, _ = k_shape
    reason = common_unsupported_reason(q_shape, k_shape, dtype, causal=causal, segmented=segmented, kernel="backward",
                                       head_dims=HEAD_DIMS)
    if reason:
        return reason
    cfg = config or default_config(d, s)
    if cfg.fused_dq and d != FUSED_HEAD_DIM:
        return f"fused_dq needs head dim {FUSED_HEAD_DIM} (its dQ product splits D into 64-column halves), got {d}"
    dq = not (cfg.fused_dq or cfg.dq_from_ds)  # the dQ kernel's tiles count too
    multiples = [(t, "q length", CONSUMERS * cfg.block_q_dq)] * dq + [(t, "q length", cfg.block_q_dkv),
                 (s, "kv length", CONSUMERS * cfg.block_kv_dkv)] + [(s, "kv length", cfg.block_kv_dq)] * dq
    if cfg.dq_from_ds:  # its dQ kernel's CTAs take ds_dq_tiles q tiles of block_q_dkv rows
        multiples.append((t, "q length", cfg.ds_dq_tiles * cfg.block_q_dkv))
    for length, name, multiple in multiples:
        if length % multiple:
            return f"{name} {length} is not a multiple of {multiple} (Mosaic backward tiles {cfg})"
    itemsize = jnp.dtype(dtype).itemsize
    for kernel, smem in (("dK/dV", dkv_smem_bytes(cfg, d, itemsize)),
                         ("dQ", 0 if cfg.fused_dq else dq_smem_bytes(cfg, d, itemsize))):
        if smem > SMEM_BYTES:
            return (f"the {kernel} kernel would need {smem} bytes of shared memory, more than the {SMEM_BYTES} "
                    f"a Hopper CTA has (tiles {cfg}; fewer stages or smaller tiles fit)")
    return None


SMEM_BYTES = 232448  # dynamic shared memory per CTA on sm_90 (227 KiB)


def dkv_smem_bytes(cfg: MosaicBwdConfig, head_dim: int, itemsize: int) -> int:
    """Shared memory of the dK/dV kernel's scratch (barriers aside), as `_dkv_call` allocates it."""
    kv_tiles = 2 * CONSUMERS * cfg.block_kv_dkv * head_dim * itemsize  # K, V
    ring = cfg.stages_dkv * (2 * cfg.block_q_dkv * head_dim * itemsize + 2 * cfg.block_q_dkv * 4)  # Q, dO, L, delta
    fused = kv_tiles if cfg.persistent else 0  # dK, dV staging
    if cfg.dq_from_ds:  # each consumer's dSᵀ staging tile
        fused = CONSUMERS * cfg.block_kv_dkv * cfg.block_q_dkv * itemsize
    if cfg.fused_dq:  # dSᵀ of the CTA's keys, double-buffered; each consumer's f32 dQ half tile(s)
        fused = (2 * CONSUMERS * cfg.block_kv_dkv * cfg.block_q_dkv * itemsize
                 + cfg.dq_stage_buffers * CONSUMERS * cfg.block_q_dkv * (head_dim // CONSUMERS) * 4)
    return kv_tiles + ring + fused


def dq_smem_bytes(cfg: MosaicBwdConfig, head_dim: int, itemsize: int) -> int:
    """Shared memory of the dQ kernel's scratch (barriers aside), as `_dq_call` (or, with
    dq_from_ds, `_dq_from_ds_call`) allocates it."""
    if cfg.dq_from_ds:  # K and dSᵀ ring, dQ staging
        tile, tiles = cfg.block_kv_dkv, cfg.ds_dq_tiles
        return (cfg.stages_dq * (tile * head_dim + tiles * tile * tile) + tiles * tile * head_dim) * itemsize
    rows = CONSUMERS * cfg.block_q_dq
    q_do_o = (3 if cfg.delta_in_dq or cfg.persistent_dq else 2) * rows * head_dim * itemsize  # Q, dO, O or dQ
    stats = 2 * rows * 4  # L, delta
    ring = 2 * cfg.stages_dq * cfg.block_kv_dq * head_dim * itemsize  # K, V
    return q_do_o + stats + ring


def validate_config(cfg: MosaicBwdConfig):
    if not isinstance(cfg, MosaicBwdConfig):
        raise TypeError(f"Mosaic backward config must be a MosaicBwdConfig, got {type(cfg).__name__}")
    if cfg.fused_dq and cfg.delta_in_dq:
        raise ValueError("MosaicBwdConfig.delta_in_dq needs the dQ kernel; it cannot be combined with fused_dq")
    if cfg.fused_dq and cfg.persistent:
        raise ValueError("MosaicBwdConfig.persistent is not implemented with fused_dq")
    if cfg.dq_stage_buffers not in (1, 2) or (cfg.dq_stage_buffers == 2 and not cfg.fused_dq):
        raise ValueError(f"MosaicBwdConfig.dq_stage_buffers={cfg.dq_stage_buffers!r} must be 1, or 2 with fused_dq")
    if cfg.dq_stage_swizzle not in (0, 32, 64, 128) or (cfg.dq_stage_swizzle != 128 and not cfg.fused_dq):
        raise ValueError(f"MosaicBwdConfig.dq_stage_swizzle={cfg.dq_stage_swizzle!r} must be 128, or 0, 32 or 64 "
                         "with fused_dq")
    if cfg.dq_from_ds and (cfg.fused_dq or cfg.delta_in_dq or cfg.persistent or cfg.persistent_dq):
        raise ValueError("MosaicBwdConfig.dq_from_ds replaces the dQ kernel; it cannot be combined with fused_dq, "
                         "delta_in_dq, persistent or persistent_dq")
    if cfg.ds_dq_tiles not in (2, 4):
        raise ValueError(f"MosaicBwdConfig.ds_dq_tiles={cfg.ds_dq_tiles!r} must be 2 or 4")
    if not isinstance(cfg.ds_workspace_max_bytes, int) or cfg.ds_workspace_max_bytes < 1:
        raise ValueError(f"MosaicBwdConfig.ds_workspace_max_bytes={cfg.ds_workspace_max_bytes!r} must be an int >= 1")
    if cfg.dq_from_ds and cfg.block_q_dkv != cfg.block_kv_dkv:
        raise ValueError(f"MosaicBwdConfig.dq_from_ds needs block_q_dkv == block_kv_dkv (square dS tiles), got "
                         f"{cfg.block_q_dkv} and {cfg.block_kv_dkv}")
    if cfg.delta_in_dq and cfg.persistent_dq:
        raise ValueError("MosaicBwdConfig.persistent_dq is not implemented with delta_in_dq")
    if cfg.ds_dq_head_major and not cfg.dq_from_ds:
        raise ValueError("MosaicBwdConfig.ds_dq_head_major orders the dq_from_ds kernel; set dq_from_ds too")
    if not isinstance(cfg.persistent_ctas, int) or cfg.persistent_ctas < 0:
        raise ValueError(f"MosaicBwdConfig.persistent_ctas={cfg.persistent_ctas!r} must be an int >= 0 (0: one per SM)")
    if cfg.block_q_dq != 64:
        raise ValueError(f"MosaicBwdConfig.block_q_dq={cfg.block_q_dq} must be 64 (one wgmma row block)")
    if cfg.block_kv_dkv not in (64, 128):
        raise ValueError(f"MosaicBwdConfig.block_kv_dkv={cfg.block_kv_dkv} must be 64 or 128")
    for name in ("block_q_dkv", "block_kv_dq"):
        size = getattr(cfg, name)
        if size % 64 or not 64 <= size <= 256:
            raise ValueError(f"MosaicBwdConfig.{name}={size} must be 64, 128, 192 or 256")
    for name in ("stages_dkv", "stages_dq"):
        stages = getattr(cfg, name)
        if not isinstance(stages, int) or stages < 2:
            raise ValueError(f"MosaicBwdConfig.{name}={stages!r} must be an int >= 2")


@dataclasses.dataclass(frozen=True)
class _Geometry:
    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    sm_scale: float
    cfg: MosaicBwdConfig
    in_place: bool = True  # False under interpret mode: register-A products as jnp.dot (docstring)
    # dq_from_ds runs in chunks of (batch rows, KV heads) to bound its workspace (`_ds_chunks`):
    # batch/heads/kv_heads are then the chunk's, and these its offsets into the inputs.
    batch0: int = 0
    kv_head0: int = 0
    # dq_from_ds chunks write their part of dK, dV and dQ at their offsets into full-size
    # buffers (the first chunk's outputs, passed to the later ones as Refs), so no concatenation
    # copies the chunks' outputs together afterwards.
    full_outputs: bool = False

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def input_batch(self, b):
        return b + self.batch0 if self.batch0 else b

    def input_kv_head(self, kv_head):
        return kv_head + self.kv_head0 if self.kv_head0 else kv_head

    def input_head(self, head):
        return head + self.kv_head0 * self.group if self.kv_head0 else head

    @property
    def scale_log2(self) -> float:  # logits times this are log2-domain exponents, like L
        return self.sm_scale * LOG2_E

    @property
    def dkv_items(self) -> int:  # (K/V tile, KV head, batch) work items of the dK/dV kernel
        return self.kv_len // (CONSUMERS * self.cfg.block_kv_dkv) * self.kv_heads * self.batch

    @property
    def dkv_ctas(self) -> int:  # CTAs of the persistent dK/dV grid
        return max(1, min(self.cfg.persistent_ctas or sm_count(), self.dkv_items))

    @property
    def dq_items(self) -> int:  # (query tile, head, batch) work items of the dQ kernel
        return self.q_len // (CONSUMERS * self.cfg.block_q_dq) * self.heads * self.batch

    @property
    def dq_ctas(self) -> int:  # CTAs of the persistent dQ grid
        return max(1, min(self.cfg.persistent_ctas or sm_count(), self.dq_items))


def ds_workspace_tiles(q_len: int, kv_len: int, tile: int, causal: bool) -> int:
    """dSᵀ tiles per (batch, head) in the dq_from_ds workspace: the visible ones, packed. Causal
    (q_len == kv_len): q tile i sees key tiles 0..i, n(n + 1) / 2 in all."""
    nq, nk = q_len // tile, kv_len // tile
    return nq * (nq + 1) // 2 if causal else nq * nk


def ds_workspace_bytes(q_shape, k_shape, itemsize: int, *, causal: bool, cfg: MosaicBwdConfig) -> int:
    """Bytes of global memory the dq_from_ds workspace takes for this call ([B, T, H, D] queries,
    [B, S, KV, D] keys): B·H tiles of block_kv_dkv² elements per visible tile."""
    b, t, h, _ = q_shape
    tile = cfg.block_kv_dkv
    return b * h * ds_workspace_tiles(t, k_shape[1], tile, causal) * tile * tile * itemsize


def _ds_row(geo: "_Geometry", i, j):
    """First workspace row of the dSᵀ tile of q tile i and key tile j (tiles of block_kv_dkv):
    q-tile-major, so the dQ kernel reads each q tile's key tiles in one contiguous run."""
    if geo.causal:
        index = _div(i * (i + 1), 2) + j
    else:
        index = i * (geo.kv_len // geo.cfg.block_kv_dkv) + j
    return index * geo.cfg.block_kv_dkv


def _bcast(x, shape, dim: int):
    """A [n] row/column statistic broadcast over a [m, n] or [n, m] tile along `dim`."""
    return lax.broadcast_in_dim(x, shape, [dim])


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _two_scores(a1, b1, a2, b2, shape):
    """(a1 @ b1, a2 @ b2) as f32 wgmmas with shared-memory operands, issued together, one wait."""

    def issue(acc1, acc2):
        plgpu.wgmma(acc1, a1, b1)
        plgpu.wgmma(acc2, a2, b2)
        return acc1[...], acc2[...]

    return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _accumulate(geo: _Geometry, accs, lhs, rhs_refs):
    """acc_i += lhs_i @ rhs_i for each i, lhs in registers (16-bit), rhs in shared memory."""
    if geo.in_place:  # the accumulators are the wgmma accumulators; run_state waits for them
        def issue(acc_refs):
            for acc_ref, a, b in zip(acc_refs, lhs, rhs_refs):
                plgpu.wgmma(acc_ref, a, b)

        return pl.run_state(issue)(tuple(plgpu.ACC.init(a) for a in accs))
    return tuple(acc + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
                 for acc, a, b in zip(accs, lhs, rhs_refs))


def _zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


# ----------------------------------------------------------------------------------------------
# dK / dV.


def _dkv_kernel(*refs, geo: _Geometry):
    """One CTA: 2 * block_kv_dkv keys of one KV head. q/do [B, T, H, D], k/v [B, S, KV, D],
    lse/delta [B, H, T] f32, dk/dv [B, S, KV, D].

    With `fused_dq` a seventh input is the f32 dQ accumulator (a Ref, zeroed by the caller):
    [B, T, H, D] on the GPU, where the consumers reduce-add their dQ half tiles into it, or, in
    interpret mode (which has no TMA reductions), [S / (2 * block_kv_dkv), B, T, H, D], one
    private slice per CTA (its steps cover distinct q tiles and its consumers distinct columns),
    stored plainly and summed by XLA. Scratch gains dSᵀ of the CTA's 2 * block_kv_dkv keys
    (two buffers, alternating per ring step), each consumer's f32 dQ half tile, and the barrier
    at which both consumers' dSᵀ rows are complete; K and V are then stored as one
    [2 * block_kv_dkv, D] tile each (the dQ product reads every key of the CTA)."""
    fused = geo.cfg.fused_dq
    if fused:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref,
         k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem, dq_smem,
         k_full, v_full, q_full, do_full, lse_full, delta_full, slot_free, ds_ready) = refs
    elif geo.cfg.persistent:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
         k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, dk_stage, dv_stage,
         k_full, v_full, q_full, do_full, lse_full, delta_full, slot_free) = refs
    elif geo.cfg.dq_from_ds:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, ds_ref,
         k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_stage,
         k_full, v_full, q_full, do_full, lse_full, delta_full, slot_free) = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
         k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring,
         k_full, v_full, q_full, do_full, lse_full, delta_full, slot_free) = refs
    cfg = geo.cfg
    persistent = cfg.persistent
    bq, bkv, stages = cfg.block_q_dkv, cfg.block_kv_dkv, cfg.stages_dkv
    wg = lax.axis_index("wg")
    num_q = geo.q_len // bq
    s_tiles = geo.kv_len // (CONSUMERS * bkv)
    if persistent:
        num_items = persistent_items(geo.dkv_items, geo.dkv_ctas)

    def item(k):
        """(b, kv head, K/V tile, first key, first q tile, ring steps per head, ring steps) of
        this CTA's k-th work item (`work_item`; K/V tile 0, the heaviest under the causal mask,
        comes first)."""
        s_tile, kv_head, b = work_item(k, tiles=s_tiles, heads=geo.kv_heads, persistent=persistent,
                                       num_ctas=geo.dkv_ctas if persistent else 1, names=("s", "h", "b"))
        cta_s0 = s_tile * (CONSUMERS * bkv)
        # Causal: q tiles wholly above this CTA's first key see none of its keys (FA2 section 3.1.1).
        first = _div(cta_s0, bq) if geo.causal else 0
        per_head = num_q - first  # ring steps per query head of the group (>= 1)
        return b, kv_head, s_tile, cta_s0, first, per_head, geo.group * per_head

    def wait_slot(slot):
        for bar in (q_full, do_full, lse_full, delta_full):
            plgpu.barrier_wait(bar.at[slot])

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(240, action="increase")
        if fused:
            my_k, my_v = k_smem.at[pl.ds(wg * bkv, bkv)], v_smem.at[pl.ds(wg * bkv, bkv)]
        else:
            my_k, my_v = k_smem.at[wg], v_smem.at[wg]

        def kv_rows(k, inputs=False):  # this consumer's keys in item k (in the inputs: + the chunk's offsets)
            b, kv_head, _, cta_s0, *_ = item(k)
            if inputs:
                b, kv_head = geo.input_batch(b), geo.input_kv_head(kv_head)
            return b, pl.ds(cta_s0 + wg * bkv, bkv), kv_head

        def load_kv(k):
            rows = kv_rows(k, inputs=True)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], my_k, k_full.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], my_v, v_full.at[wg])

        load_kv(0)

        def run_item(k, ib):
            """Item k, its ring steps numbered from `ib` on; returns the next item's `ib`."""
            b, kv_head, s_tile, cta_s0, first, per_head, total = item(k)
            s0 = cta_s0 + wg * bkv
            rows = kv_rows(k, inputs=geo.full_outputs)
            plgpu.barrier_wait(k_full.at[wg])
            plgpu.barrier_wait(v_full.at[wg])
            half = geo.head_dim // CONSUMERS

            def dq_half(c, ds_all, i, g, parity):
                """Consumer c's columns [c * half, (c + 1) * half) of dQ[q tile i of head g] += dS K
                over the CTA's keys; dSᵀ [2 * bkv, bq] is complete in `ds_all`. Static c: the column
                slices of the swizzled K tile and of dQ stay static. parity: the ring step's, which
                picks the staging tile when there are two."""
                cols = pl.ds(c * half, half)
                k_cols = k_smem.at[:, cols]
                if geo.in_place:
                    def issue(acc):
                        plgpu.wgmma(acc, ds_all.T, k_cols)  # A = (dSᵀ)ᵀ, read transposed from shared memory
                        return acc[...]

                    dq = pl.run_scoped(issue, plgpu.ACC((bq, half), jnp.float32))
                else:
                    dq = jnp.dot(ds_all[...].T, k_cols[...], preferred_element_type=jnp.float32)
                if geo.cfg.dq_stage_buffers == 2:  # alternate per ring step: the reduce-add that last
                    my_dq = dq_smem.at[parity, c]  # read this tile was two steps back
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                else:
                    my_dq = dq_smem.at[c]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduce-add has read my_dq
                my_dq[...] = dq
                plgpu.commit_smem()
                out_rows = (b, pl.ds(i * bq, bq), kv_head * geo.group + g, cols)
                if geo.in_place:
                    plgpu.copy_smem_to_gmem(my_dq, dq_ref.at[out_rows], reduction_op="add")
                else:
                    plgpu.copy_smem_to_gmem(my_dq, dq_ref.at[(s_tile, *out_rows)])

            def step(i, carry, *, base, masked, g=None):
                dk, dv = carry
                slot = _rem(base + i, stages)
                wait_slot(slot)
                q_s, do_s = q_ring.at[slot], do_ring.at[slot]
                st, dpt = _two_scores(my_k, q_s.T, my_v, do_s.T, (bkv, bq))  # Sᵀ = K Qᵀ, dPᵀ = V dOᵀ
                lse = plgpu.load(lse_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                delta = plgpu.load(delta_ring.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                x = st * geo.scale_log2 - _bcast(lse, st.shape, 1)
                if masked:  # key s0 + r is visible to query i * bq + c when i * bq + c >= s0 + r
                    visible = _iota(st.shape, 1) + (i * bq - s0) >= _iota(st.shape, 0)
                    x = jnp.where(visible, x, -jnp.inf)
                pt = jnp.exp2(x)  # Pᵀ recomputed from L (FA2 Algorithm 2, line 13)
                dst = pt * (dpt - _bcast(delta, st.shape, 1))  # dSᵀ = Pᵀ ∘ (dPᵀ − delta)
                dtype = q_ring.dtype
                pt_lo, dst_lo = pt.astype(dtype), dst.astype(dtype)
                if not fused:
                    def store_ds():  # dq_from_ds: dSᵀ out to the workspace, read by _dq_from_ds_kernel
                        my_ds = ds_stage.at[wg]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile has left
                        my_ds[...] = dst_lo
                        plgpu.commit_smem()
                        ds_rows = pl.ds(_ds_row(geo, i, _div(s0, bkv)), bkv)
                        plgpu.copy_smem_to_gmem(my_ds, ds_ref.at[b, kv_head * geo.group + g, ds_rows])

                    if geo.cfg.dq_from_ds and geo.in_place:
                        # The store runs while dV += Pᵀ dO does (dSᵀ is not yet an operand): the dK/dV
                        # kernel's overhead from the store fell from 15% to 5% at T=16k (H100, 12th session).
                        def products(acc_refs):
                            plgpu.wgmma(acc_refs[0], pt_lo, do_s)
                            store_ds()
                            plgpu.wgmma(acc_refs[1], dst_lo, q_s)

                        dv, dk = pl.run_state(products)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                    else:
                        if geo.cfg.dq_from_ds:
                            store_ds()
                        dv, dk = _accumulate(geo, (dv, dk), (pt_lo, dst_lo), (do_s, q_s))
                    plgpu.barrier_arrive(slot_free.at[slot])  # both products have completed
                    return dk, dv
                # Both consumers run every ring step in lockstep (a fully masked step gives dSᵀ = 0),
                # so ring step j uses dSᵀ buffer j % 2: a consumer rewrites a buffer only after the
                # next step's barrier, which its partner reaches after finishing its dS K reads.
                parity = _rem(base + i, 2)
                ds_all = ds_smem.at[parity]
                ds_all.at[pl.ds(wg * bkv, bkv)][...] = dst_lo  # this consumer's keys of dSᵀ
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[parity])

                def products(acc_refs):  # dV, dK issued first; the partner is awaited while they run
                    if geo.in_place:
                        for acc_ref, a, b_ref in zip(acc_refs, (pt_lo, dst_lo), (do_s, q_s)):
                            plgpu.wgmma(acc_ref, a, b_ref)
                    plgpu.barrier_wait(ds_ready.at[parity])  # the partner's dSᵀ rows are in place
                    for c in range(CONSUMERS):
                        pl.when(wg == c)(functools.partial(dq_half, c, ds_all, i, g, parity))

                if geo.in_place:
                    dv, dk = pl.run_state(products)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                else:
                    products(None)
                    dv, dk = _accumulate(geo, (dv, dk), (pt_lo, dst_lo), (do_s, q_s))
                plgpu.barrier_arrive(slot_free.at[slot])  # the ring slot's Q and dO are read
                return dk, dv

            def skip(i, carry, *, base):  # a slot the partner consumer needs but this one does not
                slot = _rem(base + i, stages)
                wait_slot(slot)
                plgpu.barrier_arrive(slot_free.at[slot])
                return carry

            def head(g, carry):  # one query head of the group: its q tiles first .. num_q - 1
                base = ib + g * per_head - first  # ring step of q tile i is base + i
                part = lambda fn, **kw: functools.partial(fn, base=base, **kw)
                step_g = functools.partial(step, g=g)
                if not geo.causal:
                    return lax.fori_loop(0, num_q, part(step_g, masked=False), carry)
                # first q tile holding a query >= s0; fused: none skipped, the partner needs this dSᵀ
                skip_end = first if fused else _div(s0, bq)
                mask_end = jnp.minimum(_div(s0 + bkv - 1 + bq - 1, bq), num_q)  # first with t0 >= s0 + bkv - 1
                carry = lax.fori_loop(first, skip_end, part(skip), carry)
                carry = lax.fori_loop(skip_end, mask_end, part(step_g, masked=True), carry)
                return lax.fori_loop(mask_end, num_q, part(step_g, masked=False), carry)


            dk, dv = lax.fori_loop(0, geo.group, head, (_zeros((bkv, geo.head_dim)), _zeros((bkv, geo.head_dim))))
            if persistent:  # K and V are dead: fetch the next item's while this one's outputs go out
                @pl.when(k + 1 < num_items)
                def _():
                    load_kv(k + 1)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous outputs have left staging
                out_k, out_v = dk_stage.at[wg], dv_stage.at[wg]
            else:
                if fused:  # the partner's last dS K reads every key of K: one more ds_ready phase first
                    last = _rem(ib + total, 2)
                    plgpu.barrier_arrive(ds_ready.at[last])
                    plgpu.barrier_wait(ds_ready.at[last])
                out_k, out_v = my_k, my_v  # K, V are dead: stage the outputs there
            out_k[...] = (dk * geo.sm_scale).astype(out_k.dtype)
            out_v[...] = dv.astype(out_v.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_k, dk_ref.at[rows], commit_group=False)
            plgpu.copy_smem_to_gmem(out_v, dv_ref.at[rows], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            return ib + total

        if persistent:
            lax.fori_loop(0, num_items, run_item, jnp.int32(0))
        else:
            run_item(0, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(24, action="decrease")

        def fetcher(k):
            b, kv_head, _, _, first, per_head, total = item(k)
            b, kv_head = geo.input_batch(b), geo.input_kv_head(kv_head)

            def fetch(j, slot):
                head = kv_head * geo.group + _div(j, per_head)
                t = pl.ds((first + _rem(j, per_head)) * bq, bq)
                plgpu.copy_gmem_to_smem(q_ref.at[b, t, head], q_ring.at[slot], q_full.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[b, head, t], lse_ring.at[slot], lse_full.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[b, t, head], do_ring.at[slot], do_full.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[b, head, t], delta_ring.at[slot], delta_full.at[slot])

            return fetch, total

        if persistent:
            _produce_items(fetcher, num_items, slot_free, stages)
        else:
            fetch, total = fetcher(0)
            _produce(fetch, slot_free, total, stages)


def _produce(fetch, free, total, stages: int, max_steps: int | None = None):
    """The producer's ring protocol: fill, refill each slot once both consumers released it,
    then observe the last releases (so every barrier phase is waited on exactly once).
    max_steps: a static bound on `total`; the fill stops there (a static tile index past the
    end of an input fails at trace time, even under pl.when)."""
    for j in range(stages if max_steps is None else min(stages, max_steps)):
        @pl.when(j < total)
        def _():
            fetch(j, j)

    @pl.loop(stages, jnp.maximum(total, stages))
    def _refill(j):
        slot = _rem(j, stages)
        plgpu.barrier_wait(free.at[slot])
        fetch(j, slot)

    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _drain(j):
        plgpu.barrier_wait(free.at[_rem(j, stages)])


def _produce_items(fetcher, num_items, free, stages: int):
    """`_produce` for a persistent CTA: the ring runs on across its items. fetcher(k) gives
    (fetch(j, slot), steps) of item k; ring step numbers continue from item to item."""

    def run_item(k, base):
        fetch, steps = fetcher(k)

        @pl.loop(0, steps)
        def _(j):
            slot = _rem(base + j, stages)

            @pl.when(base + j >= stages)  # the slot's previous tile has been released
            def _():
                plgpu.barrier_wait(free.at[slot])
            fetch(j, slot)

        return base + steps

    total = lax.fori_loop(0, num_items, run_item, jnp.int32(0))

    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _drain(j):
        plgpu.barrier_wait(free.at[_rem(j, stages)])


def _grid(dims: dict[str, int], *, tiles_outermost: bool) -> dict:
    """plgpu.kernel's grid and grid_names from {name: size}, the tile axis first in `dims`.

    CUDA launches CTAs with the first grid axis varying fastest. With the tile axis first, each
    (head, batch) launches its tiles together, heavy causal tiles first: L2 shares the Q/dO (or
    K/V) every tile of that head streams, but the launch order over the whole grid is a sawtooth
    of heavy and light tiles. With the tile axis last, the heaviest tiles of every head go first
    (longest-processing-time order, a short tail). Measured on an H100 (docs/attention.md,
    "Launch order"): tiles last made the MHA dQ kernel 21% faster at T=4k (and equal at 8k and
    for GQA 4), the MHA dK/dV kernel 11% faster at 4k and 3% at 8k, but the GQA 4 dK/dV kernel
    12% slower (its CTAs stream 4 heads' Q/dO, so the shared L2 matters more)."""
    names = list(dims)
    if tiles_outermost:
        names = names[1:] + names[:1]
    return dict(grid=tuple(dims[n] for n in names), grid_names=tuple(names))


def _f32_swizzled(swizzle: int) -> tuple:
    """Shared-memory transforms of an f32 tile: `swizzle`-byte swizzle over (8, swizzle / 4)
    tiles (one swizzle span per tile row); () for none."""
    return (plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle)) if swizzle else ()


def _dkv_call(q, k, v, do, lse, delta, geo: _Geometry, interpret: plgpu.InterpretGPUParams | None, dq_acc=None,
              out_refs=()):
    """(dk, dv); with `fused_dq` the kernel also reduce-adds into the Ref `dq_acc`; with
    `dq_from_ds` (dk, dv, dSᵀ workspace [B, H, tiles * block_kv_dkv, block_q_dkv]). With
    `geo.full_outputs` dk and dv are full-size and only the chunk's part is written, or, given
    `out_refs` (full-size Refs), the chunk writes into those and only the workspace is returned."""
    cfg = geo.cfg
    d, dtype = geo.head_dim, q.dtype
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    stages = cfg.stages_dkv
    kv_tile = (CONSUMERS, cfg.block_kv_dkv, d)
    dq_scratch, dq_barrier = (), ()
    if cfg.fused_dq:
        kv_tile = (CONSUMERS * cfg.block_kv_dkv, d)  # one tile: the dQ product reads all keys
        dq_scratch = (
            plgpu.SMEM((2, CONSUMERS * cfg.block_kv_dkv, cfg.block_q_dkv), dtype, transforms=tiled),  # dSᵀ x 2
            plgpu.SMEM((*((2,) if cfg.dq_stage_buffers == 2 else ()), CONSUMERS, cfg.block_q_dkv, d // CONSUMERS),
                       jnp.float32, transforms=_f32_swizzled(cfg.dq_stage_swizzle)),  # dQ halves
        )
        dq_barrier = (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=2),)  # ds_ready
    if cfg.persistent:  # dK, dV staging: the next item's K, V load while these are copied out
        dq_scratch = (plgpu.SMEM(kv_tile, dtype, transforms=tiled), plgpu.SMEM(kv_tile, dtype, transforms=tiled))
    # a dq_from_ds chunk's rows and heads, or (full_outputs) the whole of dK, dV, of which the
    # chunk writes its part
    out = jax.ShapeDtypeStruct(k.shape if geo.full_outputs else (geo.batch, geo.kv_len, geo.kv_heads, d), dtype)
    out_type = (out, out)
    if cfg.dq_from_ds:  # each consumer's dSᵀ staging tile; the workspace is a third output
        dq_scratch = (plgpu.SMEM((CONSUMERS, cfg.block_kv_dkv, cfg.block_q_dkv), dtype, transforms=tiled),)
        rows = ds_workspace_tiles(geo.q_len, geo.kv_len, cfg.block_kv_dkv, geo.causal) * cfg.block_kv_dkv
        workspace = jax.ShapeDtypeStruct((geo.batch, geo.heads, rows, cfg.block_q_dkv), dtype)
        out_type = (workspace,) if out_refs else (out, out, workspace)
    scratch = (
        plgpu.SMEM(kv_tile, dtype, transforms=tiled),  # K
        plgpu.SMEM(kv_tile, dtype, transforms=tiled),  # V
        plgpu.SMEM((stages, cfg.block_q_dkv, d), dtype, transforms=tiled),  # Q ring
        plgpu.SMEM((stages, cfg.block_q_dkv, d), dtype, transforms=tiled),  # dO ring
        plgpu.SMEM((stages, cfg.block_q_dkv), jnp.float32),  # L ring
        plgpu.SMEM((stages, cfg.block_q_dkv), jnp.float32),  # delta ring
        *dq_scratch,
        plgpu.Barrier(num_barriers=CONSUMERS),  # k_full
        plgpu.Barrier(num_barriers=CONSUMERS),  # v_full
        plgpu.Barrier(num_barriers=stages),  # q_full
        plgpu.Barrier(num_barriers=stages),  # do_full
        plgpu.Barrier(num_barriers=stages),  # lse_full
        plgpu.Barrier(num_barriers=stages),  # delta_full
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # slot_free
        *dq_barrier,
    )
    return plgpu.kernel(
        functools.partial(_dkv_kernel, geo=geo),
        out_type=out_type,
        scratch_types=scratch,
        **(dict(grid=(geo.dkv_ctas,), grid_names=("c",)) if cfg.persistent else _grid(
            {"s": geo.kv_len // (CONSUMERS * cfg.block_kv_dkv), "h": geo.kv_heads, "b": geo.batch},
            # fused: same-head CTAs side by side would reduce-add into the same dQ rows at once
            tiles_outermost=cfg.fused_dq or (geo.group == 1 and not cfg.dkv_head_major))),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, do, lse, delta, *(() if dq_acc is None else (dq_acc,)), *out_refs)


# ----------------------------------------------------------------------------------------------
# dQ.


def _dq_kernel(*refs, geo: _Geometry):
    """One CTA: 2 * 64 queries of one head (with `persistent_dq`, every N-th such item from the
    CTA's index on). Refs as in `_dkv_kernel`; dq [B, T, H, D].

    With `delta_in_dq` the sixth input is O [B, T, H, D] instead of delta, delta [B, H, T] is a
    second output, and an O tile buffer joins the scratch (its TMA signals `delta_full`). With
    `persistent_dq` a dQ staging buffer per consumer joins the scratch after the K/V ring."""
    fused = geo.cfg.delta_in_dq
    persistent = geo.cfg.persistent_dq
    if fused:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, o_ref, dq_ref, delta_ref,
         q_smem, do_smem, lse_smem, delta_smem, o_smem, k_ring, v_ring,
         q_full, do_full, lse_full, delta_full, k_full, v_full, k_free, v_free) = refs
    elif persistent:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
         q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, dq_stage,
         q_full, do_full, lse_full, delta_full, k_full, v_full, k_free, v_free) = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
         q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring,
         q_full, do_full, lse_full, delta_full, k_full, v_full, k_free, v_free) = refs
    cfg = geo.cfg
    bq, bkv, stages = cfg.block_q_dq, cfg.block_kv_dq, cfg.stages_dq
    wg = lax.axis_index("wg")
    num_tiles = geo.q_len // (CONSUMERS * bq)
    if persistent:
        num_items = persistent_items(geo.dq_items, geo.dq_ctas)

    def kv_steps(q_end):  # K/V tiles that rows < q_end can see
        return _div(q_end + bkv - 1, bkv) if geo.causal else geo.kv_len // bkv

    def item(k):
        """(b, head, kv head, first query row, K/V steps) of this CTA's k-th item (`work_item`)."""
        rank, head, b = work_item(k, tiles=num_tiles, heads=geo.heads, persistent=persistent,
                                  num_ctas=geo.dq_ctas if persistent else 1)
        # Heavy causal tiles (high token index) first: the last to start are the short ones.
        tile = num_tiles - 1 - rank if geo.causal else rank
        cta_q0 = tile * (CONSUMERS * bq)
        return b, head, _div(head, geo.group), cta_q0, kv_steps(cta_q0 + CONSUMERS * bq)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        my_q, my_do = q_smem.at[wg], do_smem.at[wg]

        def rows_of(k):
            b, head, _, cta_q0, _ = item(k)
            q0 = cta_q0 + wg * bq
            return (b, pl.ds(q0, bq), head), (b, head, pl.ds(q0, bq)), q0

        def load(k):  # this consumer's Q, dO, L and delta (or O) tiles of item k
            rows, stats, _ = rows_of(k)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], my_q, q_full.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], my_do, do_full.at[wg])
            plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[wg], lse_full.at[wg])
            if fused:
                plgpu.copy_gmem_to_smem(o_ref.at[rows], o_smem.at[wg], delta_full.at[wg])
            else:
                plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[wg], delta_full.at[wg])

        load(0)

        def run_item(k, ib):
            """Item k, its K/V ring steps numbered from `ib` on; returns the next item's `ib`."""
            rows, stats, q0 = rows_of(k)
            cta_steps = item(k)[4]
            for bar in (q_full, do_full, lse_full, delta_full):
                plgpu.barrier_wait(bar.at[wg])
            lse = plgpu.load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            if fused:  # delta = rowsum(dO ∘ O) of this consumer's rows, written out for the dK/dV kernel
                o_t = plgpu.load(o_smem.at[wg], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                do_t = plgpu.load(my_do, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                delta = (o_t * do_t).sum(axis=1)
                delta_smem.at[wg][...] = delta
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(delta_smem.at[wg], delta_ref.at[stats])  # awaited with dQ's store
            else:
                delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            my_steps = kv_steps(q0 + bq)
            unmasked_steps = _div(q0, bkv) if geo.causal else my_steps  # tiles wholly at or below the diagonal

            def step(j, dq, *, masked):
                slot = _rem(ib + j, stages)
                plgpu.barrier_wait(k_full.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                k_s, v_s = k_ring.at[slot], v_ring.at[slot]
                s, dp = _two_scores(my_q, k_s.T, my_do, v_s.T, (bq, bkv))  # S = Q Kᵀ, dP = dO Vᵀ
                plgpu.barrier_arrive(v_free.at[slot])
                x = s * geo.scale_log2 - _bcast(lse, s.shape, 0)
                if masked:  # row q0 + r sees key j * bkv + c when j * bkv + c <= q0 + r
                    visible = _iota(s.shape, 0) + (q0 - j * bkv) >= _iota(s.shape, 1)
                    x = jnp.where(visible, x, -jnp.inf)
                p = jnp.exp2(x)
                ds = p * (dp - _bcast(delta, s.shape, 0))  # dS = P ∘ (dP − delta)
                (dq,) = _accumulate(geo, (dq,), (ds.astype(q_smem.dtype),), (k_s,))  # dQ += dS K
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            dq = lax.fori_loop(0, unmasked_steps, functools.partial(step, masked=False), _zeros((bq, geo.head_dim)))
            if geo.causal:
                dq = lax.fori_loop(unmasked_steps, my_steps, functools.partial(step, masked=True), dq)

                @pl.loop(my_steps, cta_steps)  # the partner's extra tile: wait and release it
                def _skip(j):
                    slot = _rem(ib + j, stages)
                    plgpu.barrier_wait(k_full.at[slot])
                    plgpu.barrier_wait(v_full.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])

            if persistent:  # Q and dO are dead: fetch the next item's while this dQ goes out
                @pl.when(k + 1 < num_items)
                def _():
                    load(k + 1)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous dQ has left staging
                out = dq_stage.at[wg]
            else:
                out = my_q  # Q is dead: stage dQ there
            out[...] = (dq * geo.sm_scale).astype(out.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, dq_ref.at[rows])
            return ib + cta_steps

        if persistent:
            lax.fori_loop(0, num_items, run_item, jnp.int32(0))
        else:
            run_item(0, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def load_v(rows, slot):
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_ring.at[slot], v_full.at[slot])

        def load_k(rows, slot):
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_ring.at[slot], k_full.at[slot])

        if persistent:  # the ring runs on across items; V slots are released first (after dP)
            def run_item(k, base):
                b, _, kv_head, _, cta_steps = item(k)

                @pl.loop(0, cta_steps)
                def _(j):
                    step, rows = base + j, (b, pl.ds(j * bkv, bkv), kv_head)
                    slot = _rem(step, stages)
                    pl.when(step >= stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                    load_v(rows, slot)
                    pl.when(step >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                    load_k(rows, slot)

                return base + cta_steps

            total = lax.fori_loop(0, num_items, run_item, jnp.int32(0))
        else:
            b, _, kv_head, _, total = item(0)

            # Fill the ring; static j past the last K/V tile would be an out-of-bounds slice at
            # trace time (e.g. S = block_kv_dq), even under pl.when.
            for j in range(min(stages, geo.kv_len // bkv)):
                @pl.when(j < total)
                def _():
                    rows = (b, pl.ds(j * bkv, bkv), kv_head)
                    load_k(rows, j)
                    load_v(rows, j)

            @pl.loop(stages, jnp.maximum(total, stages))
            def _refill(j):  # K and V slots are released separately: V first (after dP)
                slot = _rem(j, stages)
                rows = (b, pl.ds(j * bkv, bkv), kv_head)
                plgpu.barrier_wait(v_free.at[slot])
                load_v(rows, slot)
                plgpu.barrier_wait(k_free.at[slot])
                load_k(rows, slot)

        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(j):
            slot = _rem(j, stages)
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.barrier_wait(k_free.at[slot])


def _dq_call(q, k, v, do, lse, delta_or_o, geo: _Geometry, interpret: plgpu.InterpretGPUParams | None):
    """dq, or (dq, delta) with `delta_in_dq` (then `delta_or_o` is O)."""
    cfg = geo.cfg
    d, dtype = geo.head_dim, q.dtype
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    stages = cfg.stages_dq
    o_tile = (plgpu.SMEM((CONSUMERS, cfg.block_q_dq, d), dtype, transforms=tiled),) if cfg.delta_in_dq else ()
    scratch = (
        plgpu.SMEM((CONSUMERS, cfg.block_q_dq, d), dtype, transforms=tiled),  # Q
        plgpu.SMEM((CONSUMERS, cfg.block_q_dq, d), dtype, transforms=tiled),  # dO
        plgpu.SMEM((CONSUMERS, cfg.block_q_dq), jnp.float32),  # L
        plgpu.SMEM((CONSUMERS, cfg.block_q_dq), jnp.float32),  # delta
        *o_tile,  # O (delta_in_dq)
        plgpu.SMEM((stages, cfg.block_kv_dq, d), dtype, transforms=tiled),  # K ring
        plgpu.SMEM((stages, cfg.block_kv_dq, d), dtype, transforms=tiled),  # V ring
        *((plgpu.SMEM((CONSUMERS, cfg.block_q_dq, d), dtype, transforms=tiled),) if cfg.persistent_dq else ()),  # dQ
        plgpu.Barrier(num_barriers=CONSUMERS),  # q_full
        plgpu.Barrier(num_barriers=CONSUMERS),  # do_full
        plgpu.Barrier(num_barriers=CONSUMERS),  # lse_full
        plgpu.Barrier(num_barriers=CONSUMERS),  # delta_full
        plgpu.Barrier(num_barriers=stages),  # k_full
        plgpu.Barrier(num_barriers=stages),  # v_full
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # k_free
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # v_free
    )
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    if cfg.delta_in_dq:
        out_type = (out_type, jax.ShapeDtypeStruct((geo.batch, geo.heads, geo.q_len), jnp.float32))
    return plgpu.kernel(
        functools.partial(_dq_kernel, geo=geo),
        out_type=out_type,
        scratch_types=scratch,
        **(dict(grid=(geo.dq_ctas,), grid_names=("c",)) if cfg.persistent_dq else _grid(
            {"t": geo.q_len // (CONSUMERS * cfg.block_q_dq), "h": geo.heads, "b": geo.batch}, tiles_outermost=True)),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, do, lse, delta_or_o)


# ----------------------------------------------------------------------------------------------
# dQ from the stored dSᵀ (dq_from_ds).


def _dq_from_ds_kernel(ds_ref, k_ref, dq_ref, k_ring, ds_ring, dq_stage, k_full, ds_full, free, *, geo: _Geometry):
    """One CTA: `ds_dq_tiles` query tiles of one head; consumer c takes tiles t0 + c,
    t0 + c + CONSUMERS, ... (interleaved, so the consumers' causal work differs by a step or
    two), one f32 accumulator each. ds [B, H, rows, tile] (the dK/dV kernel's workspace,
    `_ds_row`), k [B, S, KV, D], dq [B, T, H, D]. The producer streams K tiles, shared by every
    tile of the CTA (the more tiles per CTA, the less K each dS byte costs), and the tiles' dSᵀ
    per ring slot; a consumer adds (dSᵀ)ᵀ K, A read transposed from shared memory, into each
    accumulator whose tile sees the slot's keys. Under the causal mask q tile i reads key tiles
    0..i, so a consumer's accumulators drop out one by one (`phases`), and the CTA's last slots
    serve only its last tiles."""
    tile, stages = geo.cfg.block_kv_dkv, geo.cfg.stages_dq
    per = geo.cfg.ds_dq_tiles // CONSUMERS  # accumulators per consumer
    wg = lax.axis_index("wg")
    num_tiles = geo.q_len // (geo.cfg.ds_dq_tiles * tile)
    rank, head, b = work_item(0, tiles=num_tiles, heads=geo.heads, persistent=False)
    cta_tile = num_tiles - 1 - rank if geo.causal else rank  # heavy causal tiles first
    kv_head = geo.input_kv_head(_div(head, geo.group))  # K is read from the full input

    def q_tile(c, a):
        return cta_tile * geo.cfg.ds_dq_tiles + c + CONSUMERS * a

    def steps(c, a):  # key tiles q tile (c, a) sees
        return q_tile(c, a) + 1 if geo.causal else geo.kv_len // tile

    def ds_barrier(slot, c, a):
        return ds_full.at[(slot * CONSUMERS + c) * per + a]

    total = steps(CONSUMERS - 1, per - 1)

    def phases(c):  # (first step, end, accumulators still running) of consumer c
        if not geo.causal:
            return [(0, steps(c, 0), tuple(range(per)))]
        ends = [steps(c, a) for a in range(per)]
        return [(ends[a - 1] if a else 0, ends[a], tuple(range(a, per))) for a in range(per)]

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        mine = steps(wg, per - 1)

        def operands(j, active):
            slot = _rem(j, stages)
            plgpu.barrier_wait(k_full.at[slot])
            for a in active:
                plgpu.barrier_wait(ds_barrier(slot, wg, a))
            return k_ring.at[slot], [ds_ring.at[slot, wg, a] for a in active]

        if geo.in_place:
            def products(*acc_refs):  # slot j - 1 is released once slot j's products are issued
                for lo, hi, active in phases(wg):
                    def step(j, carry, active=active):
                        k_s, ds_s = operands(j, active)
                        for a, ds_a in zip(active, ds_s):
                            plgpu.wgmma(acc_refs[a], ds_a.T, k_s)
                        plgpu.wgmma_wait(len(active))

                        @pl.when(j > 0)
                        def _():
                            plgpu.barrier_arrive(free.at[_rem(j + stages - 1, stages)])
                        return carry

                    lax.fori_loop(lo, hi, step, None)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(free.at[_rem(mine - 1, stages)])  # mine >= 1
                return tuple(acc[...] for acc in acc_refs)

            dqs = pl.run_scoped(products, *[plgpu.ACC((tile, geo.head_dim), jnp.float32)] * per)
        else:
            dqs = tuple(_zeros((tile, geo.head_dim)) for _ in range(per))
            for lo, hi, active in phases(wg):
                def step(j, dqs, active=active):
                    k_s, ds_s = operands(j, active)
                    dqs = list(dqs)
                    for a, ds_a in zip(active, ds_s):
                        dqs[a] = dqs[a] + jnp.dot(ds_a[...].T, k_s[...], preferred_element_type=jnp.float32)
                    plgpu.barrier_arrive(free.at[_rem(j, stages)])
                    return tuple(dqs)

                dqs = lax.fori_loop(lo, hi, step, dqs)

        @pl.loop(mine, total)  # the partner's extra tiles: wait for them and release them
        def _skip(j):
            slot = _rem(j, stages)
            plgpu.barrier_wait(k_full.at[slot])
            plgpu.barrier_arrive(free.at[slot])

        for a, dq in enumerate(dqs):
            out = dq_stage.at[wg, a]
            out[...] = (dq * geo.sm_scale).astype(out.dtype)
        plgpu.commit_smem()
        for a in range(per):
            out_rows = (geo.input_batch(b), pl.ds(q_tile(wg, a) * tile, tile), geo.input_head(head)) \
                if geo.full_outputs else (b, pl.ds(q_tile(wg, a) * tile, tile), head)
            plgpu.copy_smem_to_gmem(dq_stage.at[wg, a], dq_ref.at[out_rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(j, slot):
            k_rows = (geo.input_batch(b), pl.ds(j * tile, tile), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[k_rows], k_ring.at[slot], k_full.at[slot])
            for c in range(CONSUMERS):
                for a in range(per):
                    @pl.when(j < steps(c, a))
                    def _():
                        rows = pl.ds(_ds_row(geo, q_tile(c, a), j), tile)
                        plgpu.copy_gmem_to_smem(ds_ref.at[b, head, rows], ds_ring.at[slot, c, a],
                                                ds_barrier(slot, c, a))

        _produce(fetch, free, total, stages, max_steps=geo.kv_len // tile)


def _dq_from_ds_call(ds, k, geo: _Geometry, interpret: plgpu.InterpretGPUParams | None, out_ref=None):
    """dQ from the workspace. With `geo.full_outputs`: a full-size dQ of which the chunk writes its
    part, or nothing returned and the part written into the full-size Ref `out_ref`."""
    cfg = geo.cfg
    tile, stages, d, dtype = cfg.block_kv_dkv, cfg.stages_dq, geo.head_dim, k.dtype
    per = cfg.ds_dq_tiles // CONSUMERS
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (
        plgpu.SMEM((stages, tile, d), dtype, transforms=tiled),  # K ring
        plgpu.SMEM((stages, CONSUMERS, per, tile, tile), dtype, transforms=tiled),  # dSᵀ ring
        plgpu.SMEM((CONSUMERS, per, tile, d), dtype, transforms=tiled),  # dQ staging
        plgpu.Barrier(num_barriers=stages),  # k_full
        plgpu.Barrier(num_barriers=stages * CONSUMERS * per),  # ds_full
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # free
    )
    return plgpu.kernel(
        functools.partial(_dq_from_ds_kernel, geo=geo),
        out_type=() if out_ref is not None else jax.ShapeDtypeStruct(
            (k.shape[0], geo.q_len, k.shape[2] * geo.group, d) if geo.full_outputs
            else (geo.batch, geo.q_len, geo.heads, d), dtype),
        scratch_types=scratch,
        **_grid({"t": geo.q_len // (cfg.ds_dq_tiles * tile), "h": geo.heads, "b": geo.batch},
                tiles_outermost=not cfg.ds_dq_head_major),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(ds, k, *(() if out_ref is None else (out_ref,)))


def _even_runs(total: int, most: int, unit: int = 1) -> list[tuple[int, int]]:
    """(first, size) of the fewest runs of at most `most` that cover range(total), their sizes
    differing by at most `unit` (15 + 15 + 2 would leave the last chunk's kernels a few CTAs) and,
    where `unit` divides `total` and `most` allows it, multiples of `unit`."""
    if unit > 1 and total % unit == 0 and most >= unit:
        return [(first * unit, size * unit) for first, size in _even_runs(total // unit, most // unit)]
    n = -(-total // max(1, most))
    sizes = [total // n + (i < total % n) for i in range(n)]
    return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]


def _ds_chunks(geo: _Geometry, itemsize: int) -> list[tuple[int, int, int, int]]:
    """(first batch row, rows, first KV head, KV heads) of each dq_from_ds chunk: whole batch
    rows while a row's workspace fits `ds_workspace_max_bytes`, else runs of a row's KV heads
    (at least one, whatever the budget); as few chunks as the budget allows, of even sizes.

    Runs of KV heads hold an even number of heads where the count and the budget allow, even at
    the price of more chunks: on an H100 at T = 16k the dK/dV kernel takes as long for an odd
    number of heads as for one more (fourteenth session, `profile_mgpu_bwd.py`: 2.45 ms for 11
    heads, 2.49 for 12, 2.08 for 10). So 32 heads under a 15-head budget run as 12 + 10 + 10, not
    11 + 11 + 10 (9.82 against 10.26 ms for the whole backward), and GQA 4's 8 KV heads under a
    3-head budget as 2 + 2 + 2 + 2, not 3 + 3 + 2 (10.39 against 10.76 ms)."""
    per_kv_head = (geo.group * ds_workspace_tiles(geo.q_len, geo.kv_len, geo.cfg.block_kv_dkv, geo.causal)
                   * geo.cfg.block_kv_dkv ** 2 * itemsize)
    budget = geo.cfg.ds_workspace_max_bytes
    if per_kv_head * geo.kv_heads <= budget:
        return [(b0, rows, 0, geo.kv_heads)
                for b0, rows in _even_runs(geo.batch, budget // (per_kv_head * geo.kv_heads))]
    runs = _even_runs(geo.kv_heads, budget // per_kv_head, unit=2)
    return [(b0, 1, h0, heads) for b0 in range(geo.batch) for h0, heads in runs]


def _backward_from_ds(q, k, v, do, lse, delta, geo: _Geometry, interpret):
    """dq_from_ds: per chunk (`_ds_chunks`), the dK/dV kernel writes the chunk's dSᵀ workspace
    and the dQ kernel reads it. With several chunks, each writes its rows and heads of dQ, dK
    and dV into full-size buffers: the first chunk's kernels return them (only its part
    written), the later ones write theirs into them as Refs. (Concatenating chunk-sized outputs
    instead cost 2-4% of forward+backward at 8k and 16k on an H100, thirteenth session.) The
    next chunk's inputs pass an optimization barrier with one element of the dQ just written,
    so its dK/dV kernel (and workspace) cannot start before that dQ: XLA holds one workspace at
    a time."""
    chunks = _ds_chunks(geo, q.dtype.itemsize)
    if len(chunks) == 1:
        dk, dv, ds = _dkv_call(q, k, v, do, lse, delta, geo, interpret)
        return _dq_from_ds_call(ds, k, geo, interpret), dk, dv
    for n, (b0, rows, kv0, kv_heads) in enumerate(chunks):
        g = dataclasses.replace(geo, batch=rows, kv_heads=kv_heads, heads=kv_heads * geo.group, batch0=b0,
                                kv_head0=kv0, full_outputs=True)
        if n == 0:  # full-size outputs, this chunk's part written: the later chunks fill in the rest
            dk, dv, ds = _dkv_call(q, k, v, do, lse, delta, g, interpret)
            dq_ref, dk_ref, dv_ref = (jax.new_ref(x) for x in (_dq_from_ds_call(ds, k, g, interpret), dk, dv))
        else:
            (ds,) = _dkv_call(q, k, v, do, lse, delta, g, interpret, out_refs=(dk_ref, dv_ref))
            _dq_from_ds_call(ds, k, g, interpret, out_ref=dq_ref)
        if n + 1 < len(chunks):
            _, q, k, v, do, lse, delta = lax.optimization_barrier(
                (dq_ref[b0, 0, kv0 * geo.group, 0], q, k, v, do, lse, delta))
    return dq_ref[...], dk_ref[...], dv_ref[...]


def output_row_dot(o, do):
    """delta = rowsum(dO ∘ O) as [B, H, T] f32 from [B, T, H, D] inputs (FA2 Algorithm 2, line 4).
    One XLA kernel: 0.09 ms at B·T = 16k, H = 32, D = 128 on an H100 inside the backward, by the
    profiler (thirteenth session, `profile_mgpu_bwd.py`). Timed alone from the host it shows
    0.23-0.6 ms, mostly dispatch: a Pallas kernel written for it (thirteenth session) gained
    nothing measurable, so it was dropped."""
    return jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))


# ----------------------------------------------------------------------------------------------
# Public entry point.


@functools.partial(jax.jit, static_argnames=("geo", "interpret"))
def _backward(q, k, v, o, lse, do, geo: _Geometry, interpret: plgpu.InterpretGPUParams | None):
    # delta_i = rowsum(dO_i ∘ O_i) (FA2 Algorithm 2, line 4), [B, H, T]: inside the dQ kernel,
    # which then runs first, or one fused XLA reduction.
    if geo.cfg.delta_in_dq:
        dq, delta = _dq_call(q, k, v, do, lse, o, geo, interpret)
        dk, dv = _dkv_call(q, k, v, do, lse, delta, geo, interpret)
        return dq, dk, dv
    delta = output_row_dot(o, do)
    if geo.cfg.fused_dq:  # dQ accumulates in f32 inside the dK/dV kernel (docstring of MosaicBwdConfig)
        slices = (geo.kv_len // (CONSUMERS * geo.cfg.block_kv_dkv),) if interpret else ()  # one per CTA
        dq_acc = jax.new_ref(jnp.zeros((*slices, *q.shape), jnp.float32))
        dk, dv = _dkv_call(q, k, v, do, lse, delta, geo, interpret, dq_acc)
        dq = dq_acc[...].sum(0) if interpret else dq_acc[...]
        return (dq * geo.sm_scale).astype(q.dtype), dk, dv
    if geo.cfg.dq_from_ds:  # dSᵀ through a workspace in global memory (docstring of MosaicBwdConfig)
        return _backward_from_ds(q, k, v, do, lse, delta, geo, interpret)
    dk, dv = _dkv_call(q, k, v, do, lse, delta, geo, interpret)
    dq = _dq_call(q, k, v, do, lse, delta, geo, interpret)
    return dq, dk, dv


def mosaic_backward(q, k, v, o, lse, do, *, causal: bool = True, sm_scale: float | None = None,
                    config: MosaicBwdConfig | None = None, interpret: bool | plgpu.InterpretGPUParams = False):
    """(dq, dk, dv) of softmax(q kᵀ · sm_scale + mask) v, given the forward's o and lse.

    q, o, do: [B, T, H, D]; k, v: [B, S, KV, D] (H % KV == 0); lse: [B, H, T] f32, log2 domain,
    as returned by `flash_attention_mgpu.mosaic_forward`. Gradients come back in the input dtype
    (dK, dV summed over each GQA group in f32 before the single rounding).
    Raises ValueError (TypeError for a wrong config type) before any kernel runs for what this
    backward does not support (see `unsupported_reason`).
    interpret: as for `flash_attention_mgpu.mosaic_forward`.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D, got shape {getattr(x, 'shape', None)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must be [B, S, KV, D] matching q [B, T, H, D]: {q.shape=}, {k.shape=}, {v.shape=}")
    if o.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"o and do must have q's shape {q.shape}, got {o.shape=}, {do.shape=}")
    if not q.dtype == k.dtype == v.dtype == o.dtype == do.dtype:
        raise ValueError(f"q, k, v, o, do must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {o.dtype}, {do.dtype}")
    b, t, h, d = q.shape
    if lse.shape != (b, h, t) or lse.dtype != jnp.float32:
        raise ValueError(f"lse must be float32 [B, H, T]={(b, h, t)}, got {lse.dtype} {lse.shape}")
    if d not in HEAD_DIMS:
        raise ValueError(f"Mosaic flash attention backward does not support head dim {d} (only {HEAD_DIMS})")
    cfg = config if config is not None else default_config(d, k.shape[1])
    validate_config(cfg)
    reason = unsupported_reason(q.shape, k.shape, q.dtype, causal=causal, segmented=False, config=cfg)
    if reason is not None:
        raise ValueError(f"Mosaic flash attention backward does not support this call: {reason}")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    geo = _Geometry(batch=b, q_len=t, kv_len=k.shape[1], heads=h, kv_heads=k.shape[2], head_dim=d,
                    causal=bool(causal), sm_scale=scale, cfg=cfg, in_place=not interpret)
    return _backward(q, k, v, o, lse, do, geo, interpret_params(interpret))
