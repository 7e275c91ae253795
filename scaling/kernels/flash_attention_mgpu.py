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
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    pingpong: bool = True
    reduction_scratch_bytes: int = 2048


# Per head dim. D=256 uses narrower K/V slots so that Q (2 x 64 x 256) and the ring fit in the
# 227 KiB of shared memory an H100/H200 CTA may use. D=128 and D=64: the best of a small sweep
# on an H200 (docs/attention.md, "Mosaic GPU forward"); D=256 is untuned.
DEFAULT_CONFIGS = {
    64: MosaicConfig(block_q=64, block_kv=128, stages=3),
    128: MosaicConfig(block_q=64, block_kv=128, stages=3, reduction_scratch_bytes=1024),
    256: MosaicConfig(block_q=64, block_kv=64, stages=2),
}


# H100 (80GB HBM3): the sweep of 2026-11-22 (`check_mgpu.py --time-only --fwd-only`, forward
# TFLOP/s, B*T = 16k tokens, H = 32; docs/attention.md, "H100 retune") put 2 stages with
# ping-pong at or near the top everywhere and ahead of the H200 defaults at the short and the
# D=64 shapes: D=128 causal T=1k 226 vs 205, 4k 328 vs 316, 16k 594 vs 551, non-causal 4k 346
# vs 349, GQA 4 462 vs 475; D=64 causal 4k 299 vs 252, non-causal 4k 338 vs 305, causal 1k
# 163 vs 166 (differences under ~8% are within the run-to-run noise seen there).
H100_CONFIGS = {
    64: MosaicConfig(block_q=64, block_kv=128, stages=2, pingpong=True),
    128: MosaicConfig(block_q=64, block_kv=128, stages=2, pingpong=True),
    256: DEFAULT_CONFIGS[256],
}
# device_kind substring -> table; devices not listed (the H200, interpret mode on a CPU) use
# DEFAULT_CONFIGS.
DEVICE_CONFIGS = {"H100": H100_CONFIGS}


def device_kind() -> str:
    return jax.devices()[0].device_kind


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
        head_slots = self.heads // CONSUMERS if self.pairing == "heads" else self.heads
        return (self.q_len // self.cta_rows, head_slots, self.batch)


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
    return None


def _validate_config(cfg: MosaicConfig):
    if cfg.block_q != 64:
        raise ValueError(f"MosaicConfig.block_q={cfg.block_q} must be 64 (one wgmma row block per warpgroup)")
    if cfg.block_kv % 64 or not 64 <= cfg.block_kv <= 256:
        raise ValueError(f"MosaicConfig.block_kv={cfg.block_kv} must be 64, 128, 192 or 256")
    if not isinstance(cfg.stages, int) or cfg.stages < 2:
        raise ValueError(f"MosaicConfig.stages={cfg.stages!r} must be an int >= 2")


# ----------------------------------------------------------------------------------------------
# The kernel.


def _kernel(q_ref, k_ref, v_ref, o_ref, lse_ref,
            q_smem, k_smem, v_smem, lse_smem,
            q_full, k_full, v_full, k_free, v_free, turn, *, geo: _Geometry):
    """One CTA. Refs: q/o [B, T, H, D], k/v [B, S, KV, D], lse [B, H, T] (all GMEM)."""
    cfg = geo.cfg
    bq, bkv, d = cfg.block_q, cfg.block_kv, geo.head_dim
    wg = lax.axis_index("wg")
    b = lax.axis_index("b")
    slot_of_head = lax.axis_index("h")
    # Heavy causal tiles (high token index) first: the last CTAs to start are the short ones.
    num_tiles = geo.grid[0]
    tile = num_tiles - 1 - lax.axis_index("t") if geo.causal else lax.axis_index("t")
    cta_q0 = tile * geo.cta_rows

    if geo.pairing == "heads":
        first_head = slot_of_head * CONSUMERS  # an even head; its partner is in the same group
        kv_head = first_head // geo.group
    else:
        kv_head = slot_of_head // geo.group

    def kv_steps_for(q_end):  # K/V tiles that rows < q_end can see
        if geo.causal:
            return lax.div(q_end + bkv - 1, bkv)
        return geo.kv_len // bkv

    cta_steps = kv_steps_for(cta_q0 + geo.cta_rows)  # what the producer streams

    def rendezvous():  # both consumers arrive, both wait: the ping-pong hand-over point
        if cfg.pingpong:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        if geo.pairing == "heads":
            head, q0 = first_head + wg, cta_q0
        else:
            head, q0 = slot_of_head, cta_q0 + wg * bq
        my_q = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), head], my_q, q_full.at[wg])
        plgpu.barrier_wait(q_full.at[wg])

        my_steps = kv_steps_for(q0 + bq)
        # K/V tiles entirely at or below the diagonal need no mask.
        unmasked_steps = lax.div(q0, bkv) if geo.causal else my_steps

        def step(j, carry, *, masked: bool):
            o_acc, m, l = carry
            slot = lax.rem(j, cfg.stages)
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
            # Step 0 always holds key 0, visible to every row, so m_new is finite from there on
            # and exp2(-inf - finite) = 0 discards the (empty) history.
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
                slot = lax.rem(j, cfg.stages)
                plgpu.barrier_wait(k_full.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                rendezvous()
                rendezvous()
        # ... and consumer 0 closes with the matching extra arrival.
        pl.when(wg == 0)(rendezvous)

        o_acc, m, l = carry
        inv_l = 1.0 / l
        o = o_acc * lax.broadcast_in_dim(inv_l, o_acc.shape, [0])
        my_q[...] = o.astype(q_smem.dtype)  # Q is dead: its buffer stages the output tile
        lse_smem.at[wg][...] = m + jnp.log2(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_q, o_ref.at[b, pl.ds(q0, bq), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, head, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(j, slot):
            rows = (b, pl.ds(j * bkv, bkv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_full.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_full.at[slot])

        for j in range(min(cfg.stages, geo.kv_len // bkv)):  # fill the ring (cta_steps >= 1)
            @pl.when(j < cta_steps)
            def _():
                fetch(j, j)

        @pl.loop(cfg.stages, jnp.maximum(cta_steps, cfg.stages))
        def _refill(j):
            slot = lax.rem(j, cfg.stages)
            plgpu.barrier_wait(k_free.at[slot])
            rows = (b, pl.ds(j * bkv, bkv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_full.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_full.at[slot])

        # Observe the last releases too, so that no barrier ends the CTA with a phase nobody
        # waited for (harmless on the GPU, but it keeps the ring's bookkeeping exact and the
        # interpret mode's barrier checker satisfied).
        @pl.loop(jnp.maximum(cta_steps - cfg.stages, 0), cta_steps)
        def _drain(j):
            slot = lax.rem(j, cfg.stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


@functools.partial(jax.jit, static_argnames=("geo", "interpret"))
def _call(q, k, v, geo: _Geometry, interpret: bool):
    cfg = geo.cfg
    dtype = q.dtype
    # 128-byte swizzle over (8, 64) tiles: the layout wgmma reads without bank conflicts.
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (
        plgpu.SMEM((CONSUMERS, cfg.block_q, geo.head_dim), dtype, transforms=tiled),
        plgpu.SMEM((cfg.stages, cfg.block_kv, geo.head_dim), dtype, transforms=tiled),
        plgpu.SMEM((cfg.stages, cfg.block_kv, geo.head_dim), dtype, transforms=tiled),
        plgpu.SMEM((CONSUMERS, cfg.block_q), jnp.float32),
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
        grid=geo.grid,
        grid_names=("t", "h", "b"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             reduction_scratch_bytes=cfg.reduction_scratch_bytes),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q, k, v)


def mosaic_forward(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                   config: MosaicConfig | None = None, interpret: bool = False):
    """(out [B, T, H, D], lse [B, H, T] f32): attention forward and its log2-domain log-sum-exp.

    lse[b, h, t] = log2(sum_s exp2(q_t · k_s · sm_scale · log2 e)) over the visible keys s.
    Raises ValueError for what this kernel does not support (see `unsupported_reason`).
    interpret: run under Pallas' GPU interpret mode (CPU; slow, for tests).
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
    return _call(q, k, v, geo, bool(interpret))
