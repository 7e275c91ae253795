"""Flash attention forward pass for Hopper GPUs, written with Pallas' Mosaic GPU backend.

Only the forward pass lives here. It returns the output and the per-row log-sum-exp (log2
domain), which `flash_attention.py` converts to the layout its Triton backward expects, so
`flash_attention(..., backend="mosaic")` pairs this forward with the existing Pallas backward.

Structure of one thread block (CTA). Three warpgroups (128 threads each) share shared memory:

  * warpgroups 0 and 1 ("consumers") each own a 64-row query tile. Per K/V tile they issue
    two warpgroup matmuls (`wgmma`): S = Q Kᵀ with Q and K in shared memory, then O += P V
    with P in registers. The online softmax between them runs on the f32 `wgmma` accumulator
    fragment, in the log2 domain (one FMA and one ex2 per logit).
  * warpgroup 2 ("producer") only issues TMA copies of K and V tiles into a ring of
    `stages` shared-memory slots. It gives most of its registers to the consumers
    (`set_max_registers`).

Four barrier arrays implement the ring: `k_full`/`v_full` (the TMA engine signals that a slot
holds data) and `k_free`/`v_free` (both consumers signal that they are done reading a slot).
K and V have separate barriers so that the Q Kᵀ matmul can start while V is still in flight.

What the two consumers of a CTA share, i.e. which K/V stream they read:
  * `pairing="heads"` (when the GQA group size H / KV is even): both consumers cover the SAME
    token range for two query heads of one GQA group, so each K/V tile fetched by the producer
    serves two query heads and the consumers always run the same number of steps (also under
    the causal mask).
  * `pairing="tokens"` (otherwise, e.g. plain multi-head attention): the consumers cover two
    adjacent 64-row tiles of the same head. Under the causal mask the lower tile needs one
    K/V tile fewer than the upper one; the early finisher still waits on and releases the
    remaining ring slots so that the shared barriers stay in phase.

Persistent grid (`MosaicConfig.persistent`, the default for head dims 64 and 128): one CTA per
SM instead of one per work item (query tile x head slot x batch). CTA c runs items c, c + N,
c + 2N, ... (N CTAs), numbered as the non-persistent grid launches them: tile rank fastest,
heaviest causal tile first, then head slot, then batch, so the CTAs running together share a
few heads' K/V in L2; under the causal mask the unit dealt is a pair of tiles, one heavy and its
light mirror, so that every CTA gets the same amount of work (`item_of`). The producer's ring
runs on across items (it streams the next item's K/V while the consumers finish the current
one), each consumer loads its next Q tile as soon as its last Q Kᵀ has completed, and outputs
are staged in a buffer of their own. This hides the per-CTA
start-up (Q load, ring fill) and epilogue that dominated short rows: on an H100, causal D=128
at T=4k went from 0.70x to 1.01x cuDNN's forward (docs/attention.md, "Persistent forward").

Optional "ping-pong" (`MosaicConfig.pingpong`): a two-party rendezvous barrier makes the two
consumers alternate, so that one runs its softmax (SFU / FMA bound) while the other has its
matmuls on the tensor cores (FlashAttention-3, Shah et al. 2024, section 3.1).

Limits (refused with ValueError; the dispatcher in `flash_attention.py` falls back to Triton):
bf16 / f16 only; head dim 64, 128 or 256; no segment ids; the query length a multiple of the
CTA's rows and the key length a multiple of `block_kv`; causal needs T == S.
Requires an sm_90 (Hopper) GPU when not run in interpret mode.
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

LOG2_E = math.log2(math.e)
HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CONSUMERS = 2  # compute warpgroups per CTA; the producer is warpgroup CONSUMERS


def _div(x, y):
    """Index division in int32. lax.div of an int32 index and a Python int raised a dtype
    mismatch under jax_enable_x64 (the int became int64): every Mosaic call failed there."""
    return lax.div(lax.convert_element_type(x, jnp.int32), lax.convert_element_type(y, jnp.int32))


def _rem(x, y):
    """Index remainder in int32 (as `_div`)."""
    return lax.rem(lax.convert_element_type(x, jnp.int32), lax.convert_element_type(y, jnp.int32))


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiling of the Mosaic forward.

    block_q: query rows per consumer warpgroup (the M of its matmuls; 64 = one wgmma row block).
    block_kv: keys per K/V ring slot (the N of Q Kᵀ, the K of P V); multiple of 64.
    stages: K/V ring depth (TMA copies in flight ahead of the consumers), >= 2.
    pingpong: alternate the two consumers' softmax and matmul phases (see module docstring).
    reduction_scratch_bytes: shared memory Mosaic reserves for cross-warp reductions (its
      default is 2048); D=128 with block_kv=128 and 3 stages is 120 bytes over the 227 KiB
      limit with the default, and fits with 1024.
    persistent: launch one CTA per SM instead of one per query tile; each CTA loops over its
      share of the tiles (numbered head by head, heaviest causal tile first, dealt round-robin,
      in heavy/light pairs under the causal mask: `item_of`), the
      producer streams the next tile's K/V while the consumers finish the current one, and a
      consumer loads its next Q tile as soon as its last Q Kᵀ is done (the output is staged in
      a buffer of its own). Hides the per-CTA start-up and epilogue that dominate short causal
      rows (docs/attention.md, "Persistent forward").
    persistent_ctas: CTAs of the persistent grid; 0 = the device's SM count (tests set a small
      number so that each CTA runs several tiles).
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    pingpong: bool = True
    reduction_scratch_bytes: int = 2048
    persistent: bool = False
    persistent_ctas: int = 0


# Per head dim. D=256 uses narrower K/V slots so that Q (2 x 64 x 256) and the ring fit in the
# 227 KiB of shared memory an H100/H200 CTA may use; it is untuned and not persistent (a second
# Q-sized staging buffer does not fit). D=128 and D=64: 2 stages with ping-pong, persistent
# (seventh session, docs/attention.md, "Persistent forward"): on both GPUs the persistent
# kernel matched or beat every earlier table entry at T <= 8k (H100 causal D=128 4k: 1.01x
# cuDNN against 0.70x; H200: 1.07x against 0.97x), and long causal rows, where it was 3-5%
# slower, launch one CTA per tile instead (`PERSISTENT_MAX_CAUSAL_LEN`).
DEFAULT_CONFIGS = {
    64: MosaicConfig(block_q=64, block_kv=128, stages=2, pingpong=True, persistent=True),
    128: MosaicConfig(block_q=64, block_kv=128, stages=2, pingpong=True, persistent=True),
    256: MosaicConfig(block_q=64, block_kv=64, stages=2),
}
# Causal rows longer than this run the non-persistent grid even when the config asks for
# persistence: at T=16k it measured 1.05x cuDNN against 1.00x (H100) and 1.02x (H200).
PERSISTENT_MAX_CAUSAL_LEN = 8192


# H100 (80GB HBM3): the fifth session's sweep (`check_mgpu.py --time-only --fwd-only`) put 2
# stages with ping-pong at or near the top everywhere, when the H200 table still had 3 stages;
# since the persistent kernel both tables are the same, kept apart for the next retune.
H100_CONFIGS = dict(DEFAULT_CONFIGS)
# device_kind substring -> table; devices not listed (the H200, interpret mode on a CPU) use
# DEFAULT_CONFIGS.
DEVICE_CONFIGS = {"H100": H100_CONFIGS}


def device_kind() -> str:
    return jax.devices()[0].device_kind


def sm_count() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)  # 132: H100 SXM / H200


def persistent_items(total: int, num_ctas: int):
    """How many of `total` work items this CTA of a persistent grid ("c") runs: every
    num_ctas-th from its own index on."""
    return _div(total - lax.axis_index("c") + num_ctas - 1, num_ctas)


def item_of(c, k, *, tiles: int, heads: int, num_ctas: int, paired: bool = False):
    """(tile rank, head, batch) of CTA c's k-th item in a persistent grid of num_ctas CTAs.

    Items are numbered as the plain grid (tile, head, batch) launches its CTAs, tile rank
    fastest, then head, then batch, and dealt round-robin: CTA c runs items c, c + N, ... The
    CTAs running together then work on a few heads' tiles and share what those stream in L2.

    paired (causal, even `tiles`): the dealt unit is a pair of tiles of one head, rank r (heavy)
    and its mirror tiles - 1 - r (light), run one after the other (k even, k odd). Every pair
    costs the same under the causal mask, so the CTAs' shares are equal to within one pair.
    Dealing single tiles lets the stride alias with the tile count: at T=8k, B=1, GQA 4
    (128 tiles per head slot, N=132) CTA c got ranks c, c+4, ..., c+60 only, the heavy half
    for c < 64 and the light half for the others, and the forward ran at 0.79x cuDNN instead
    of 1.10x on one CTA per tile (docs/attention.md).

    Works on Python ints (tests) and traced int32 scalars (kernels): non-negative operands."""
    if paired:
        half = tiles // 2
        w = c + _div(k, 2) * num_ctas
        r = _rem(w, half)
        rank = r + _rem(k, 2) * (tiles - 1 - 2 * r)  # k odd: the mirror tile
        rest = _div(w, half)
    else:
        w = c + k * num_ctas
        rank, rest = _rem(w, tiles), _div(w, tiles)
    return rank, _rem(rest, heads), _div(rest, heads)


def work_item(k, *, tiles: int, heads: int, persistent: bool, num_ctas: int = 1, paired: bool = False,
              names=("t", "h", "b")):
    """(tile rank, head, batch) of this CTA's k-th work item: `item_of` for the persistent grid,
    the grid's own indices `names` for the plain one."""
    if not persistent:
        return tuple(lax.axis_index(n) for n in names)
    return item_of(lax.axis_index("c"), k, tiles=tiles, heads=heads, num_ctas=num_ctas, paired=paired)


def default_config(head_dim: int, kind: str | None = None) -> MosaicConfig | None:
    """Default tiles for `head_dim` on device `kind` (default: the first device's); None when
    the head dim is unsupported."""
    kind = device_kind() if kind is None else kind
    for key, table in DEVICE_CONFIGS.items():
        if key in kind:
            return table.get(head_dim)
    return DEFAULT_CONFIGS.get(head_dim)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static facts of one call, derived from the shapes and the config."""

    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    scale_log2: float  # sm_scale * log2(e): logits times this are log2-domain exponents
    cfg: MosaicConfig
    # True on the GPU: O accumulates inside the P V wgmma (pl.run_state, P from registers).
    # Pallas' GPU interpret mode (jax 0.11.2) runs neither pl.run_state nor a wgmma whose A
    # operand is in registers, so there P V is a jnp.dot of the same operands (V read from
    # its ring slot) added to O; everything else (TMA ring, barriers, Q Kᵀ wgmma, masking,
    # softmax, output and lse stores) is the code the GPU runs.
    in_place: bool = True

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def pairing(self) -> str:
        return "heads" if self.group % 2 == 0 else "tokens"

    @property
    def cta_rows(self) -> int:
        """Query tokens covered by one CTA (both consumers together)."""
        return self.cfg.block_q * (CONSUMERS if self.pairing == "tokens" else 1)

    @property
    def grid(self) -> tuple[int, int, int]:
        """(query tiles, head slots, batch): the work items; the grid itself unless persistent."""
        head_slots = self.heads // CONSUMERS if self.pairing == "heads" else self.heads
        return (self.q_len // self.cta_rows, head_slots, self.batch)

    @property
    def persistent(self) -> bool:
        return self.cfg.persistent and not (self.causal and self.q_len > PERSISTENT_MAX_CAUSAL_LEN)

    @property
    def num_items(self) -> int:
        return math.prod(self.grid)

    @property
    def paired(self) -> bool:
        """Whether the persistent grid deals tiles in heavy/light pairs (`item_of`)."""
        return self.persistent and self.causal and self.grid[0] % 2 == 0

    @property
    def num_ctas(self) -> int:
        """CTAs of the persistent grid (one per SM unless the config says otherwise, never
        more than there are units to deal: items, or pairs of them)."""
        n = self.cfg.persistent_ctas or sm_count()
        return max(1, min(n, self.num_items // 2 if self.paired else self.num_items))


def common_unsupported_reason(q_shape, k_shape, dtype, *, causal: bool, segmented: bool, kernel: str,
                              head_dims=HEAD_DIMS) -> str | None:
    """The checks the Mosaic forward and backward share: dtype, head dim, no segment ids, GQA
    grouping, square causal attention."""
    _, t, h, d = q_shape
    _, s, kv, _ = k_shape
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (the Mosaic {kernel} supports bfloat16 and float16)"
    if d not in head_dims:
        return f"head dim {d} (the Mosaic {kernel} supports {head_dims})"
    if segmented:
        return f"segment ids (not implemented in the Mosaic {kernel})"
    if h % kv:
        return f"{h=} not a multiple of {kv=}"
    if causal and t != s:
        return f"causal with q length {t} != kv length {s}"
    return None


def unsupported_reason(q_shape, k_shape, dtype, *, causal: bool, segmented: bool,
                       config: MosaicConfig | None = None) -> str | None:
    """Why the Mosaic forward cannot take this call (None when it can)."""
    b, t, h, d = q_shape
    _, s, kv, _ = k_shape
    reason = common_unsupported_reason(q_shape, k_shape, dtype, causal=causal, segmented=segmented, kernel="forward")
    if reason:
        return reason
    cfg = config or default_config(d)
    geo_rows = cfg.block_q * (1 if (h // kv) % 2 == 0 else CONSUMERS)
    if t % geo_rows:
        return (f"q length {t} is not a multiple of {geo_rows} (query rows per CTA; "
                f"block_q={cfg.block_q})")
    if s % cfg.block_kv:
        return f"kv length {s} is not a multiple of block_kv={cfg.block_kv}"
    smem = smem_bytes(cfg, d, jnp.dtype(dtype).itemsize)
    if smem + BARRIER_ALLOWANCE > SMEM_BYTES:
        return (f"the forward would need {smem} bytes of shared memory, more than the {SMEM_BYTES} a Hopper "
                f"CTA has ({cfg}; fewer stages fit)")
    return None


SMEM_BYTES = 232448  # dynamic shared memory per CTA on sm_90 (227 KiB)
BARRIER_ALLOWANCE = 1024  # barriers and alignment: D=128, 3 stages measured 632 bytes above `smem_bytes`


def smem_bytes(cfg: MosaicConfig, head_dim: int, itemsize: int) -> int:
    """Shared memory of the forward's scratch: Q (and the persistent output staging) per
    consumer, the K/V ring, the lse staging and Mosaic's reduction scratch (barriers aside)."""
    q_tiles = (2 if cfg.persistent else 1) * CONSUMERS * cfg.block_q * head_dim * itemsize
    ring = 2 * cfg.stages * cfg.block_kv * head_dim * itemsize
    return q_tiles + ring + CONSUMERS * cfg.block_q * 4 + cfg.reduction_scratch_bytes


def _validate_config(cfg: MosaicConfig):
    if cfg.block_q != 64:
        raise ValueError(f"MosaicConfig.block_q={cfg.block_q} must be 64 (one wgmma row block per warpgroup)")
    if cfg.block_kv % 64 or not 64 <= cfg.block_kv <= 256:
        raise ValueError(f"MosaicConfig.block_kv={cfg.block_kv} must be 64, 128, 192 or 256")
    if not isinstance(cfg.stages, int) or cfg.stages < 2:
        raise ValueError(f"MosaicConfig.stages={cfg.stages!r} must be an int >= 2")
    if not isinstance(cfg.persistent_ctas, int) or cfg.persistent_ctas < 0:
        raise ValueError(f"MosaicConfig.persistent_ctas={cfg.persistent_ctas!r} must be an int >= 0 (0: one per SM)")


# ----------------------------------------------------------------------------------------------
# The kernel.


def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref,
            q_smem, k_smem, v_smem, lse_smem, *rest, geo: _Geometry):
    """One CTA: one work item (query tile x head slot x batch), or with `persistent` every
    num_ctas-th item from this CTA's index on. Refs: q/o [B, T, H, D], k/v [B, S, KV, D],
    lse [B, H, T] (all GMEM). Scratch: Q per consumer, the K/V ring, lse staging, (persistent)
    output staging per consumer, then the barriers."""
    cfg = geo.cfg
    if geo.persistent:
        o_smem, q_full, k_full, v_full, k_free, v_free, turn = rest
    else:
        o_smem = None
        q_full, k_full, v_full, k_free, v_free, turn = rest
    bq, bkv, d = cfg.block_q, cfg.block_kv, geo.head_dim
    wg = lax.axis_index("wg")
    num_tiles, head_slots, _ = geo.grid

    if not geo.persistent:
        num_items = 1
    elif geo.paired:
        num_items = 2 * persistent_items(geo.num_items // 2, geo.num_ctas)
    else:
        num_items = persistent_items(geo.num_items, geo.num_ctas)

    def work(k):
        # Ordering by rank first, all heads side by side, measured 4% slower at 8k-16k on an
        # H100: every CTA streamed another head's K/V from HBM (docs/attention.md).
        return work_item(k, tiles=num_tiles, heads=head_slots, persistent=geo.persistent,
                         num_ctas=geo.num_ctas if geo.persistent else 1, paired=geo.paired)

    def item(k):
        """Facts of this CTA's k-th item: (b, head slot, first query row, kv head, K/V steps)."""
        rank, slot_of_head, b = work(k)
        # Heavy causal tiles (high token index) first: the last to start are the short ones.
        tile = num_tiles - 1 - rank if geo.causal else rank
        cta_q0 = tile * geo.cta_rows
        if geo.pairing == "heads":  # an even head; its partner is in the same group
            kv_head = slot_of_head * CONSUMERS // geo.group
        else:
            kv_head = slot_of_head // geo.group
        return b, slot_of_head, cta_q0, kv_head, kv_steps_for(cta_q0 + geo.cta_rows)

    def kv_steps_for(q_end):  # K/V tiles that rows < q_end can see
        if geo.causal:
            return _div(q_end + bkv - 1, bkv)
        return geo.kv_len // bkv

    def rendezvous():  # both consumers arrive, both wait: the ping-pong hand-over point
        if cfg.pingpong:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        my_q = q_smem.at[wg]
        my_o = o_smem.at[wg] if geo.persistent else my_q  # output staging

        def rows_of(k):  # (b, head, q0) of this consumer in item k
            b, slot_of_head, cta_q0, _, _ = item(k)
            if geo.pairing == "heads":
                return b, slot_of_head * CONSUMERS + wg, cta_q0
            return b, slot_of_head, cta_q0 + wg * bq

        def load_q(k):
            b, head, q0 = rows_of(k)
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), head], my_q, q_full.at[wg])

        load_q(0)

        def run_item(k, base):
            """Item k; `base` = ring steps of this CTA's earlier items. Returns the new base."""
            b, head, q0 = rows_of(k)
            cta_steps = item(k)[4]  # what the producer streams
            plgpu.barrier_wait(q_full.at[wg])
            my_steps = kv_steps_for(q0 + bq)
            # K/V tiles entirely at or below the diagonal need no mask.
            unmasked_steps = _div(q0, bkv) if geo.causal else my_steps

            def step(j, carry, *, masked: bool):
                o_acc, m, l = carry
                slot = _rem(base + j, cfg.stages)
                plgpu.barrier_wait(k_full.at[slot])

                def logits(s_ref):
                    plgpu.wgmma(s_ref, my_q, k_smem.at[slot].T)
                    rendezvous()  # hand the tensor cores to the other consumer
                    return s_ref[...]

                s = pl.run_scoped(logits, plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])  # the S matmul has completed: K slot reusable

                if masked:  # only diagonal tiles: row q0 + r sees key j * bkv + c when c + j*bkv <= r + q0
                    rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                    visible = rows + (q0 - j * bkv) >= cols
                    x = jnp.where(visible, s * geo.scale_log2, -jnp.inf)
                    m_new = jnp.maximum(m, x.max(axis=1))
                    p = jnp.exp2(x - lax.broadcast_in_dim(m_new, x.shape, [0]))
                else:  # scale folded into the exponent: one FMA per logit
                    m_new = jnp.maximum(m, s.max(axis=1) * geo.scale_log2)
                    p = jnp.exp2(s * geo.scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                # Step 0 always holds key 0, visible to every row, so m_new is finite from there
                # on and exp2(-inf - finite) = 0 discards the (empty) history.
                correction = jnp.exp2(m - m_new)
                l = l * correction + p.sum(axis=1)
                o_acc = o_acc * lax.broadcast_in_dim(correction, o_acc.shape, [0])
                p_lo = p.astype(q_smem.dtype)
                rendezvous()  # wait for the tensor cores to be ours again
                plgpu.barrier_wait(v_full.at[slot])

                if geo.in_place:  # the running O is the matmul's accumulator; run_state waits for it
                    def accumulate(acc_ref):
                        plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])

                    o_acc = pl.run_state(accumulate)(plgpu.ACC.init(o_acc))
                else:  # interpret mode: a plain dot of the same operands (see `_Geometry.in_place`)
                    o_acc = o_acc + jnp.dot(p_lo, v_smem.at[slot][...], preferred_element_type=jnp.float32)
                plgpu.barrier_arrive(v_free.at[slot])
                return o_acc, m_new, l

            carry = (
                plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            )
            # Ping-pong: consumer 1 starts half a step behind consumer 0 ...
            pl.when(wg == 1)(rendezvous)
            carry = lax.fori_loop(0, unmasked_steps, functools.partial(step, masked=False), carry)
            if geo.causal:
                carry = lax.fori_loop(unmasked_steps, my_steps, functools.partial(step, masked=True), carry)

                # Ring slots this consumer does not need but the producer fills for its partner
                # (token pairing only): wait and release them so every barrier phase completes.
                # Two rendezvous per skipped step keep the ping-pong count equal to the partner's.
                @pl.loop(my_steps, cta_steps)
                def _skip(j):
                    slot = _rem(base + j, cfg.stages)
                    plgpu.barrier_wait(k_full.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_wait(v_full.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    rendezvous()
                    rendezvous()
            if geo.persistent:  # Q is dead: fetch the next item's while this one finishes
                @pl.when(k + 1 < num_items)
                def _():
                    load_q(k + 1)
            # ... and consumer 0 closes with the matching extra arrival.
            pl.when(wg == 0)(rendezvous)

            o_acc, m, l = carry
            inv_l = 1.0 / l
            o = o_acc * lax.broadcast_in_dim(inv_l, o_acc.shape, [0])
            if geo.persistent:  # the previous item's output copies have read the staging buffers
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            my_o[...] = o.astype(q_smem.dtype)  # (not persistent: Q is dead, its buffer stages O)
            lse_smem.at[wg][...] = m + jnp.log2(l)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_o, o_ref.at[b, pl.ds(q0, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, head, pl.ds(q0, bq)])
            return base + cta_steps

        if geo.persistent:
            lax.fori_loop(0, num_items, run_item, jnp.int32(0))
        else:
            run_item(0, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def run_item(k, base):
            """Stream item k's K/V tiles into the ring at steps base, base + 1, ..."""
            b, _, _, kv_head, cta_steps = item(k)

            @pl.loop(0, cta_steps)
            def _fetch(j):
                step = base + j
                slot = _rem(step, cfg.stages)
                rows = (b, pl.ds(j * bkv, bkv), kv_head)

                @pl.when(step >= cfg.stages)  # the slot's previous tile has been released
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_full.at[slot])

                @pl.when(step >= cfg.stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_full.at[slot])

            return base + cta_steps

        total = lax.fori_loop(0, num_items, run_item, jnp.int32(0)) if geo.persistent else run_item(0, 0)

        # Observe the last releases too, so that no barrier ends the CTA with a phase nobody
        # waited for (harmless on the GPU, but it keeps the ring's bookkeeping exact and the
        # interpret mode's barrier checker satisfied).
        @pl.loop(jnp.maximum(total - cfg.stages, 0), total)
        def _drain(j):
            slot = _rem(j, cfg.stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


@functools.partial(jax.jit, static_argnames=("geo", "interpret"))
def _call(q, k, v, geo: _Geometry, interpret: plgpu.InterpretGPUParams | None):
    cfg = geo.cfg
    dtype = q.dtype
    # 128-byte swizzle over (8, 64) tiles: the layout wgmma reads without bank conflicts.
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    o_staging = (plgpu.SMEM((CONSUMERS, cfg.block_q, geo.head_dim), dtype, transforms=tiled),) \
        if geo.persistent else ()
    scratch = (
        plgpu.SMEM((CONSUMERS, cfg.block_q, geo.head_dim), dtype, transforms=tiled),
        plgpu.SMEM((cfg.stages, cfg.block_kv, geo.head_dim), dtype, transforms=tiled),
        plgpu.SMEM((cfg.stages, cfg.block_kv, geo.head_dim), dtype, transforms=tiled),
        plgpu.SMEM((CONSUMERS, cfg.block_q), jnp.float32),
        *o_staging,
        plgpu.Barrier(num_barriers=CONSUMERS),  # q_full
        plgpu.Barrier(num_barriers=cfg.stages),  # k_full
        plgpu.Barrier(num_barriers=cfg.stages),  # v_full
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=cfg.stages),  # k_free
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=cfg.stages),  # v_free
        plgpu.Barrier(num_arrivals=CONSUMERS),  # turn (ping-pong)
    )
    out_type = (
        jax.ShapeDtypeStruct(q.shape, dtype),
        jax.ShapeDtypeStruct((geo.batch, geo.heads, geo.q_len), jnp.float32),
    )
    return plgpu.kernel(
        functools.partial(_kernel, geo=geo),
        out_type=out_type,
        scratch_types=scratch,
        **(dict(grid=(geo.num_ctas,), grid_names=("c",)) if geo.persistent
           else dict(grid=geo.grid, grid_names=("t", "h", "b"))),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             reduction_scratch_bytes=cfg.reduction_scratch_bytes),
        interpret=interpret,
    )(q, k, v)


def mosaic_forward(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                   config: MosaicConfig | None = None, interpret: bool | plgpu.InterpretGPUParams = False):
    """(out [B, T, H, D], lse [B, H, T] f32): attention forward and its log2-domain log-sum-exp.

    lse[b, h, t] = log2(sum_s exp2(q_t · k_s · sm_scale · log2 e)) over the visible keys s.
    Raises ValueError for what this kernel does not support (see `unsupported_reason`).
    interpret: run under Pallas' GPU interpret mode (CPU; slow, for tests); True for the default
      `plgpu.InterpretGPUParams()`, or the params themselves (e.g. `detect_races=True`).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D, got {q.shape=}, {k.shape=}, {v.shape=}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must be [B, S, KV, D] matching q [B, T, H, D]: {q.shape=}, {k.shape=}, {v.shape=}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    cfg = config if config is not None else default_config(q.shape[-1])
    reason = unsupported_reason(q.shape, k.shape, q.dtype, causal=causal, segmented=False, config=cfg)
    if reason is not None:
        raise ValueError(f"Mosaic flash attention forward does not support this call: {reason}")
    _validate_config(cfg)
    b, t, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    geo = _Geometry(batch=b, q_len=t, kv_len=k.shape[1], heads=h, kv_heads=k.shape[2], head_dim=d,
                    causal=bool(causal), scale_log2=scale * LOG2_E, cfg=cfg, in_place=not interpret)
    return _call(q, k, v, geo, interpret_params(interpret))


def interpret_params(interpret: bool | plgpu.InterpretGPUParams) -> plgpu.InterpretGPUParams | None:
    """The GPU interpret-mode params for an `interpret` argument (None: compile for the GPU)."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None
