"""KV-cached decoding: prefill, a fixed-shape decode step, sampling, generate.

The shape of gpt-fast's generate.py, in JAX:

    prefill        the prompts (right-padded to a length bucket) through every layer in one
                   call; K/V written into the cache at positions [0, T); first token sampled
                   from each row's last real position
    decode_chunk   `chunk` decode steps under one lax.scan: embed the last token, per layer
                   write its K/V at the row's own position (in place, donated buffers) and
                   attend over the cache up to that position, sample the next token

Both compile once per (batch bucket, cache length) and are reused across calls. The cache is
preallocated: per layer, K and V of shape [B, S, K, H] (the L x B x S x K x H cache, kept as
one buffer per layer so each layer's write is an in-place update of its own buffer, and the
attention kernel reads it without a slice copy). Its dtype defaults to the model's compute
dtype: bf16 on GPU, f32 on CPU (tests).

Weights are re-laid-out once per `Decoder` for the memory-bound step: per layer, q/k/v fused
into one [D, (N + 2K) H] matrix and gate/up into one [D, 2F] matrix (gpt-fast's `wqkv`), cast
to the compute dtype, one buffer per layer. A decode step then reads each weight byte once in
a few large matmuls instead of many small ones.

Ragged batches: row b has its own position `pos[b]` (tokens already in its cache); its
queries use RoPE at that position and attend to [0, pos[b]] only, so a short prompt next to a
long one neither attends to padding nor wastes the Pallas kernel's reads on it.

Sampling (per row, f32): greedy when temperature == 0, else softmax(logits / temperature)
restricted to the top-k tokens and then to the smallest set whose probability reaches
top-p. Row r's key at its n-th new token is fold_in(fold_in(key(seed), r), n): the same seed
gives the same tokens. Log-probs are those of the model's own distribution (log_softmax of
the raw logits), whatever the sampling settings.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scaling import layers
from scaling.attention import attention_core, resolve_impl
from scaling.config import AttentionImpl, ModelConfig
from scaling.kernels import decode_gemv, decode_megakernel, decode_tma, sample as sample_kernel
from scaling.kernels.flash_attention import is_hopper
from scaling.kernels.decode_attention import (
    combine_in_kernel_reason,
    decode_attention,
    decode_attention_fused,
    decode_attention_grouped,
    decode_attention_reference,
    decode_attention_rotated,
    fused_supported,
    prime_lowering,
    rotated_supported,
)
from scaling.model import Transformer

KV_BLOCK = 64  # cache length is rounded up to whole tiles of the decode kernel
LEN_BUCKET = 128  # default cache length: prompt + new tokens rounded up to this
MIN_PROMPT_BUCKET = 16  # prompts are right-padded to a power of two at least this long
DEFAULT_CHUNK = 32  # decode steps per compiled call (one host sync per chunk)
# Prompt tokens one prefill call takes at most (whole rows, at least one). It bounds the prefill's
# activations (the 7b's gate, up and their product over 16k tokens: ~1.1 GB in bf16); 16k-token
# calls prefilled the 7b's 64 prompts of 2048 tokens at ~0.6 PFLOP/s on an H200 (docs/benchmarks.md,
# issue 8, thirty-second session).
PREFILL_TOKENS = 16384
SAMPLERS = ("auto", "xla", "pallas")  # Decoder(sampler=...)


def sample_kernel_runs(sampler: str, *, top_k: int | None, use_top_p: bool, backend: str | None = None) -> bool:
    """Whether sampled tokens are drawn by scaling.kernels.sample (else by `sample`'s sorts).
    "auto": on a GPU with top-k or top-p, where the kernel was measured faster than the sorts in
    every case (an H200, batches 1, 8 and 64, vocabularies 32,000 and 128,256, flat and peaked
    logits: top-p 2.2-8.7x, top-k 1.45-3.2x, both 1.1-2.5x; docs/benchmarks.md, thirty-fourth
    session). Temperature alone stays with XLA: one pass, 1.4-2.1x faster than the kernel's."""
    if sampler == "auto":
        return (backend or jax.default_backend()) == "gpu" and (use_top_p or top_k is not None)
    return sampler == "pallas"


# On the GPU, XLA lowers a [1, D] x [D, X] dot to multiply + reduce fusions that reach half
# the bandwidth of the gemm kernels it emits for M >= 8: padding batch 1 to 8 rows took the
# 1b decode step from 1.29 to 0.90 ms on an H200 (experiments/decode_variants.py,
# docs/decoding.md). The cost: 8x the KV cache of a batch-1 call.
GPU_MIN_BATCH = 8
# The Pallas layer kernels (scaling.kernels.decode_gemv) take any power-of-two batch (CUDA-core
# products below 16 rows, tensor-core dots from 16), so they need no padding rows; above
# PALLAS_MAX_BATCH rows a step is a real gemm and XLA's are the better kernels.
PALLAS_MIN_BATCH = 1
PALLAS_MAX_BATCH = 64
# layers="auto" on the GPU: the Pallas layers' vector path up to this many rows. On an H100
# (docs/decoding.md) a 1b step at batch 1 took 0.935 ms against 1.095 ms for XLA's layers padded
# to 8 rows, and the llama2_7b 5.20 against 5.41 ms; at 2 rows it was 2% slower than XLA's
# (1.117 vs 1.096 ms), at 4 rows 1.6x slower: its CUDA-core products grow with the rows.
AUTO_PALLAS_MAX_BATCH = 1
# layers="auto" on a Hopper GPU: those steps with the TMA kernels (layers="pallas_tma", the
# projections decode_tma.projections_by_grid picks) from this hidden size. Batch 1, prompt 128
# (eleventh session, docs/decoding.md): the llama2_7b shape (4096) ran 2.8% faster on an H200
# (4.051 against 4.166 ms) and 1.4% on an H100 (5.213 against 5.286); the 1b (2048) 0.7% faster
# on the H200 and 2.8% slower on the H100, so it keeps the Triton kernels.
AUTO_TMA_MIN_HIDDEN = 4096
HEAD_ROWS = 256  # the Pallas layout pads the head's rows to a multiple of this (any block_n <= 256)


class DecodeAttentionImpl(str, enum.Enum):
    xla = "xla"  # reads the whole cache and masks; reference
    pallas = "pallas"  # flash-decoding kernel; reads only the filled part
    # The kernel with RoPE and the cache write folded in: 13% fewer launches, but its CUDA-core
    # dot products make the kernel itself 2x slower; no faster on an H200 (docs/decoding.md).
    fused = "fused"
    # The flash-decoding kernel with the splits' combine done by the last program of each
    # (row, KV head) instead of an XLA kernel of its own (one kernel fewer per layer); on the
    # Pallas layer path with a power-of-two group size, else as `pallas`. Measured 1.2% (1b)
    # and 0.4% (7b) slower per step than `pallas` on an H200 (docs/decoding.md): opt-in.
    pallas_combined = "pallas_combined"
    auto = "auto"  # pallas on GPU, xla elsewhere


class DecodeLayerImpl(str, enum.Enum):
    xla = "xla"  # XLA's gemms and fusions (~15 kernels per layer)
    # scaling.kernels.decode_gemv: RMSNorm, RoPE, the cache write, SwiGLU and the residual adds
    # folded into the four weight reads (4 kernels + attention per layer), and the output head
    # with the final norm; batches up to PALLAS_MAX_BATCH
    pallas = "pallas"
    # pallas, with the gate/up + SwiGLU (and the projections decode_tma.TmaSettings names)
    # streamed by TMA (scaling.kernels.decode_tma; Mosaic GPU, Hopper; batches up to
    # decode_tma.ROWS); docs/decoding.md
    pallas_tma = "pallas_tma"
    # on the GPU pallas for small batches (AUTO_PALLAS_MAX_BATCH), pallas_tma there instead on a
    # Hopper GPU for 16-bit models from AUTO_TMA_MIN_HIDDEN wide; else xla. Batch-1 steps on a
    # Hopper GPU as `megakernel` where it runs the model and its weight copy fits
    # (auto_megakernel_reason)
    auto = "auto"
    # batch-1 steps as one persistent kernel for the whole step (scaling.kernels.decode_megakernel;
    # Mosaic GPU, Hopper; Pallas' interpreter on the CPU), other batches as `auto`. Keeps a second,
    # unit-major copy of the weights. docs/decoding.md, "Sixteenth session". `auto` takes it on a
    # Hopper GPU wherever auto_megakernel_reason finds nothing against it
    megakernel = "megakernel"


def layer_blocks(cfg: ModelConfig, batch: int,
                 blocks: decode_gemv.LayerBlocks | None = None) -> decode_gemv.LayerBlocks:
    """The Pallas layer kernels' tiles for a step of `batch` rows: the given ones, else the defaults."""
    return blocks or decode_gemv.default_blocks(batch, cfg.resolved_head_dim, hidden=cfg.hidden_size)


def pallas_layers_reason(cfg: ModelConfig, batch: int, blocks: decode_gemv.LayerBlocks | None = None) -> str | None:
    """Why a step of `batch` rows cannot run the Pallas layer kernels (None: it can)."""
    if batch > PALLAS_MAX_BATCH:
        return f"batch {batch} > {PALLAS_MAX_BATCH} (a real gemm: XLA's kernels are the better ones)"
    return decode_gemv.unsupported_reason(cfg.hidden_size, cfg.mlp_dim, cfg.num_heads, cfg.resolved_head_dim,
                                          _round_up(cfg.vocab_size, HEAD_ROWS), batch, layer_blocks(cfg, batch, blocks))


def resolve_layer_impl(impl: DecodeLayerImpl | str, cfg: ModelConfig, attn: DecodeAttentionImpl,
                       blocks: decode_gemv.LayerBlocks | None = None, min_batch: int = 1,
                       tma: decode_tma.TmaSettings | None = None) -> DecodeLayerImpl:
    """The layer implementation `impl` names, checked against the model (ValueError naming why
    not). tma: the TMA kernels' settings for pallas_tma (None: decode_tma.settings())."""
    try:
        impl = DecodeLayerImpl(impl)
    except ValueError:
        raise ValueError(f"layers={impl!r}: allowed {[x.value for x in DecodeLayerImpl]}") from None
    if impl in (DecodeLayerImpl.pallas, DecodeLayerImpl.pallas_tma):
        reason = pallas_layers_reason(cfg, min_batch, blocks)
        if reason:
            raise ValueError(f"layers='{impl.value}' cannot run this model at batch {min_batch}: {reason}; "
                             "use layers='xla' or other gemv_blocks")
        if attn == DecodeAttentionImpl.fused:
            raise ValueError(f"layers='{impl.value}' writes the cache itself; combine it with attention 'pallas' or "
                             "'xla', not 'fused'")
        if impl == DecodeLayerImpl.pallas_tma:
            reason = decode_tma.projections_reason(cfg, _round_up(cfg.vocab_size, HEAD_ROWS), tma)
            if jax.default_backend() == "gpu" and not is_hopper():
                reason = "the TMA kernels need a Hopper GPU (sm_90)"
            if reason:
                raise ValueError(f"layers='pallas_tma' cannot run this model: {reason}; use layers='pallas'")
        return impl
    if impl == DecodeLayerImpl.megakernel:
        if jax.default_backend() == "gpu" and not is_hopper():
            raise ValueError("layers='megakernel' needs a Hopper GPU (sm_90); use layers='auto'")
        try:
            megakernel_plan(cfg, MEGAKERNEL_CHECK_LEN).check()
        except ValueError as e:
            raise ValueError(f"layers='megakernel' cannot run this model: {e}; use layers='auto'") from None
    return impl


# Caches (or steps, megakernel_plan's reach) of at least this many positions split a KV head's
# positions within fuse_out's groups (`_measured_plan`; the H200's crossover: the H100's is nearer
# 640, where it costs at most ~1.5% up to 767; docs/benchmarks.md, twenty-ninth session)
GROUPS_FROM = 768
# A long cache's first steps, up to this many positions, on the plan of a cache that short
# (megakernel_plan's reach), where the cache's own splits its positions within fuse_out's groups:
# its attention without the exchange between CTAs (the 1b on the H200 in a cache of 2304: 1.09x at
# start 128, 1.035x at 448, 1.024x at 640; docs/decoding.md, twenty-ninth session)
MEGAKERNEL_SHORT_REACH = GROUPS_FROM - 1
MEGAKERNEL_CHECK_LEN = 256  # a cache length every megakernel plan takes (whole tiles of 64 or 128 positions)
# layers="auto" runs batch-1 steps on the megakernel on a Hopper GPU (the decoder's 1b at batch 1:
# 1.29x the per-layer kernels on the H100, 1.43-1.45x on the H200; the 7b 1.10x and 1.17x;
# docs/benchmarks.md, issue 8) where its unit-major copy of the weights takes at most this share of
# the device memory still free: the rest is left for the caches and larger batches' steps.
AUTO_MEGAKERNEL_MEMORY_SHARE = 0.5


def megakernel_copy_bytes(weights: dict) -> int:
    """Bytes of the megakernel's unit-major copy of prepare_weights(rows=True)'s weights: every
    layer's projections and the head (the embedding table is shared, not copied)."""
    layer_bytes = sum(w[k].nbytes for w in weights["layers"] for k in ("wqkv_xd", "wo_dx", "wgu_xd", "wdown_df"))
    return layer_bytes + weights["head_xd"].nbytes


def free_device_bytes() -> int | None:
    """Bytes the first device's allocator can still hand out (None where it does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def auto_megakernel_reason(cfg: ModelConfig, dtype, *, hopper: bool, copy_bytes: int,
                           free_bytes: int | None, cache_dtype=None) -> str | None:
    """Why layers="auto" does not run this model's batch-1 steps on the megakernel (None: it does).
    copy_bytes: megakernel_copy_bytes; free_bytes: free_device_bytes (None: not known, not checked);
    cache_dtype: the KV cache's (None: the weights')."""
    if not hopper:
        return "it needs a Hopper GPU (sm_90)"
    if jnp.dtype(dtype).itemsize != 2:
        return f"it runs 16-bit models (its tensor-core tiles), not {jnp.dtype(dtype).name}"
    if cache_dtype is not None and jnp.dtype(cache_dtype) != jnp.dtype(dtype):
        return (f"its cache tiles share the weights' ring, so the cache must be {jnp.dtype(dtype).name}, "
                f"not {jnp.dtype(cache_dtype).name}")
    try:
        megakernel_plan(cfg, MEGAKERNEL_CHECK_LEN).check()
    except ValueError as e:
        return f"its plan cannot run this model: {e}"
    if free_bytes is not None and copy_bytes > AUTO_MEGAKERNEL_MEMORY_SHARE * free_bytes:
        return (f"its copy of the weights ({copy_bytes / 2**30:.1f} GiB) would take more than "
                f"{AUTO_MEGAKERNEL_MEMORY_SHARE:.0%} of the {free_bytes / 2**30:.1f} GiB the device has free")
    return None


# MegaPlan's fields that follow from the model, the cache and the GPU: the rest are the kernel's
# choices, which `Decoder(megakernel_options=...)` may set
MEGAKERNEL_SHAPE_FIELDS = frozenset({"layers", "hidden", "heads", "kv_heads", "head_dim", "mlp", "vocab_rows",
                                     "max_len", "eps", "ctas"})


def parse_megakernel_options(options) -> tuple[tuple[str, int | bool], ...]:
    """Validated plan options ({field: value}) as a sorted, hashable tuple: a static argument of
    the compiled steps. Each must be a MegaPlan field of the kernel's choosing, with a bool or int
    value of its type."""
    fields = {f.name: f.type for f in dataclasses.fields(decode_megakernel.MegaPlan)}
    allowed = sorted(set(fields) - MEGAKERNEL_SHAPE_FIELDS)
    out = []
    for name, value in dict(options or {}).items():
        if name not in allowed:
            raise ValueError(f"megakernel_options: {name!r} is not one of the plan's options; allowed {allowed}")
        if fields[name] in (bool, "bool"):
            if value not in (0, 1) or isinstance(value, float):
                raise ValueError(f"megakernel_options: {name} must be a bool (or 0/1), got {value!r}")
            value = bool(value)
        elif isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"megakernel_options: {name} must be an int, got {value!r}")
        out.append((name, value if isinstance(value, bool) else int(value)))
    return tuple(sorted(out))


def megakernel_plan(cfg: ModelConfig, max_len: int, options: tuple = (),
                    reach: int | None = None) -> decode_megakernel.MegaPlan:
    """The megakernel's plan for a step over a cache of max_len positions: one CTA per SM on the
    GPU, one CTA in the CPU's interpreter. options (`parse_megakernel_options`): fields set over the
    measured choices below, with the deepest ring that fits unless they set `stages` (the plan's
    check then says whether it runs). reach: the most positions the steps attend (their last
    position + 1), where fewer than max_len: the plan measured for a cache that short, over this
    cache (any position still runs correctly on it, only slower past reach)."""
    if not options:
        return _measured_plan(cfg, max_len, reach)
    given = dict(options)
    plan = dataclasses.replace(_measured_plan(cfg, max_len, reach), **given)
    if "stages" in given or plan.smem_bytes() <= decode_megakernel.SMEM_BYTES:
        return plan
    # (options that take shared memory, as group_splits' partials: the deepest ring that fits)
    for stages in range(plan.stages - 1, 1, -1):
        hold = plan.hold_slots if "hold_slots" in given else min(plan.hold_slots, stages)
        shallower = dataclasses.replace(plan, stages=stages, hold_slots=hold)
        if shallower.smem_bytes() <= decode_megakernel.SMEM_BYTES:
            return shallower
    return plan


def _measured_plan(cfg: ModelConfig, max_len: int, reach: int | None = None) -> decode_megakernel.MegaPlan:
    gpu = jax.default_backend() == "gpu"
    ctas = (getattr(jax.devices()[0], "core_count", None) or 132) if gpu else 1
    return _measured_plan_on(cfg, max_len, reach, gpu, ctas)


# (cached: a stream call asks for its plans before its prefill, 0.17-0.27 ms each for the 1b on the
# host, on the way to the first token; the key holds the backend and the SMs, which pick the plan)
@functools.lru_cache(maxsize=256)
def _measured_plan_on(cfg: ModelConfig, max_len: int, reach: int | None, gpu: bool,
                      ctas: int) -> decode_megakernel.MegaPlan:
    x_stages = 8 if gpu else 4
    plan = decode_megakernel.plan_for(cfg, max_len, vocab_rows=_round_up(cfg.vocab_size, HEAD_ROWS), ctas=ctas,
                                      x_stages=x_stages)
    # Measured (docs/benchmarks.md, issue 8, "Seventeenth session"): splitting each KV head's
    # positions over several units takes a 2048-position step from 83% to 92% of the copy
    # bandwidth (7b, H100, 4 splits) and the 1b's from 53% to 63% (H200, 8 splits), and costs <1%
    # at 128 positions. So a split per 256 positions of the cache, as many as the x stages and the
    # CTAs hold. (norm_prefetch: level with paired positions, so left off.) Those the steps read:
    # a long cache's early steps read as few as a short one's (`reach`).
    span = min(max_len, reach) if reach else max_len
    splits = max(1, min(span // 256, x_stages, max(1, ctas // cfg.num_kv_heads)))
    # Without splits, attention and the output projection as one phase where a KV head's q heads
    # are whole K steps of W_o (the 1b at prompt 128: 1.08x on the H200, 1.06x on the H100;
    # docs/benchmarks.md, eighteenth session)
    # gate/up and down as one phase where the MLP's 64-wide slices spread evenly over the CTAs (the
    # 1b: 128 on 132 SMs; not the 7b's 172), with a deeper weight ring (the 1b at prompt 128 on the
    # H200: 1.05x; then 4 ring slots against 3 1.02x, 5 against 4 ~1.006x, each in its own run;
    # docs/benchmarks.md, nineteenth session). It fixes W_down's layout, so it depends on the model
    # only, not on max_len.
    # Also wherever the slices take one wave, however many CTAs that leaves idle (the decoder on the
    # H200 with the options that come with it below, against the unfused plan: tinyllama_1.1b's 88
    # slices on 132 SMs 1.14-1.18x at prompt 128 and 1.15-1.20x at 2048; the 350m's 44 1.03x, the
    # 125m's 32 and the 25m's 16 level; thirtieth session). The x stages then hold all of h1 (16
    # chunks at tinyllama's block_k 128).
    slices = cfg.mlp_dim // decode_megakernel.BLOCK_F
    waves = -(-slices // ctas)
    if waves == 1 or waves * ctas <= 1.05 * slices:
        # (the CPU's interpreter plans keep their 4 x stages: fused only where h1 fits them, as before)
        stages_for_h1 = max(plan.x_stages, cfg.hidden_size // plan.block_k) if gpu else plan.x_stages
        try:
            dataclasses.replace(plan, fuse_mlp=True, x_stages=stages_for_h1).check()
            plan = dataclasses.replace(plan, fuse_mlp=True, x_stages=stages_for_h1)
        except ValueError:
            pass
    # Each phase's last 2 ring slots freed only after its signal, whose release fence otherwise
    # waits for the TMA loads the producer issues into them (H200: the 1b 1.025x, the 7b 1.027x,
    # the 1b at prompt 2048 1.04x; docs/benchmarks.md, nineteenth session)
    plan = dataclasses.replace(plan, hold_slots=2)
    fused = dataclasses.replace(plan, fuse_out=True)
    # Long caches: attention fused with the output projection too, each KV head's positions split
    # over its group's CTAs, which merge their partials behind a group semaphore, instead of
    # attn_splits' combine phase and its two grid barriers (the decoder's 1b at prompt 2048: 0.642
    # against 0.705 ms on the H200, 0.812-0.817 against 0.862-0.874 on the H100 in three runs;
    # docs/benchmarks.md, twenty-third session). The 7b's q heads are no K step of W_o: it keeps
    # attn_splits. There one slot held per phase, not 2 (the decoder's 1b at prompt 2048 on the
    # H200: 0.627-0.630 against 0.633-0.642 ms in three alternating pairs, 1.016x; the kernel
    # alone 1.01x; 3 held 0.669 against 0.650-0.656; twenty-sixth session)
    grouped = dataclasses.replace(fused, group_splits=min(fused.out_group, decode_megakernel.MAX_GATHERED), hold_slots=1)
    # A KV head's q heads over several K steps of W_o (`out_ksteps`; fused since the thirty-sixth
    # session) only with the MLP fused: tinyllama_1.1b's kernel on the H200 1.055-1.07x at prompt
    # 128 and 1.04-1.08x at 2048 (three alternating pairs each); llama3_8b, whose MLP is not
    # fused, level (3.895 against 3.887 ms at 128); docs/benchmarks.md, thirty-sixth session
    if fused.out_ksteps > 1 and not plan.fuse_mlp:
        fused = grouped = None
    # Below GROUPS_FROM positions every member of a group reads all of its head's positions
    # instead, with no exchange (the 1b: 1.09x at 128, 1.035x at 448-511, 1.024x at 640, level
    # at 768, 0.99x at 896 on the H200; twenty-ninth session). Models without fuse_out (the 7b,
    # whose split is faster already at 448) keep their splits from 512.
    candidates = ((fused, plan) if splits == 1 else
                  (grouped, dataclasses.replace(plan, attn_splits=splits), plan))
    if splits > 1 and span < GROUPS_FROM:
        candidates = (fused,) + candidates
    candidates = tuple(p for p in candidates if p is not None)
    # With the MLP fused, one operand slot makes room for a sixth ring slot (the 1b at prompt 128 on
    # the H200: 1.017-1.028x in two runs; one operand alone at 5 slots level; docs/benchmarks.md,
    # twenty-first session); else the deepest ring that fits
    # (the grouped split's partials take a slot's shared memory: 5 slots with one operand slot, level
    # with 6 at prompt 2048 on the H200, twenty-third session; tinyllama_1.1b's 16 KiB slots: 10
    # level with 6, thirtieth session).
    # Without the fused MLP, the deepest ring up to 6 slots too (the decoder at prompt 128 on the H200
    # against the 3 slots it had, measured while they were unfused: tinyllama_1.1b 1.017x, 1.026x at
    # prompt 2048, the 350m 1.016-1.026x, the 25m and 125m level; thirtieth session). The 7b fits 3,
    # llama3_8b 2: its CTAs take up to 29 K steps of its 14336-wide down projection, whose operand
    # slots leave no room for more.
    rings = ((6, True), (5, True), (5, False), (4, False), (3, False)) if plan.fuse_mlp else tuple(
        (n, False) for n in range(6, 1, -1))
    # With the MLP fused, attention's critical path shortened: its norm statistic computed by every
    # CTA while it waits at the q/k/v barrier, and q/k/v read by plain loads, not TMA copies queued
    # behind the weight tiles (the 1b at prompt 128 on the H200: 1.005-1.03x in two kernel runs, the
    # decoder 0.591-0.595 -> 0.572-0.580 ms; docs/benchmarks.md, twenty-second session)
    shorter = ({"norm_in_qkv": True, "qkv_ld": True}, {}) if plan.fuse_mlp else ({},)
    for candidate, (stages, one_operand), extra in itertools.product(candidates, rings, shorter):
        try:
            candidate = dataclasses.replace(candidate, stages=stages, hold_slots=min(candidate.hold_slots, stages),
                                            one_operand=one_operand, **extra)
            candidate.check()
            return candidate
        except ValueError:
            continue
    return plan  # (its check names what it cannot run)


def _megakernel_step(weights, cache, tokens_b, write_b, *, cfg: ModelConfig, options: tuple = (),
                     reach: int | None = None):
    """A batch-1 step by decode_megakernel: cache {"kv": plan.cache_shape} (megakernel_cache);
    reach: megakernel_plan's."""
    kv = cache["kv"]
    plan = megakernel_plan(cfg, _cache_len(cache, cfg), options, reach)
    # (the kernel reads the token's embedding row and pos's RoPE row itself: no other kernel runs
    # before it; the table of every position is loop-invariant, so XLA computes it once per chunk)
    rope_all = decode_megakernel.rope_tables(plan.max_len, layers.rope_frequencies(cfg))
    logits, _, kv = decode_megakernel.megakernel_token_step(tokens_b[0], write_b[0], weights["embed_vd"], rope_all,
                                                            weights["units"], kv, plan=plan,
                                                            interpret=jax.default_backend() != "gpu")
    return logits[None, : cfg.vocab_size], {"kv": kv}


@functools.partial(jax.jit, static_argnames="ppr")
def megakernel_cache(cache, ppr: int = 1):
    """A batch-1 cache {"k", "v": per layer [1, S, K, H]} as the megakernel's {"kv": [L, S / ppr,
    K, ppr 2H]} (decode_megakernel.pack_cache: ppr positions per row)."""
    kv = jnp.stack([jnp.concatenate([k[0], v[0]], axis=-1) for k, v in zip(cache["k"], cache["v"])])
    return {"kv": decode_megakernel.pack_cache(kv, ppr)}


def _cache_len(cache, cfg: ModelConfig) -> int:
    """Positions a cache holds (the megakernel's {"kv"} packs ppr per row)."""
    if "kv" in cache:
        kv = cache["kv"]
        return kv.shape[1] * kv.shape[3] // (2 * cfg.resolved_head_dim)
    return cache["k"][0].shape[1]


def _xla_decode(q_bnh, k_bskh, v_bskh, lengths_b):
    return decode_attention_reference(q_bnh, k_bskh, v_bskh, lengths_b)


def _pallas_decode(q_bnh, k_bskh, v_bskh, lengths_b):
    return decode_attention(q_bnh, k_bskh, v_bskh, lengths_b)


DECODE_ATTENTION = {DecodeAttentionImpl.xla: _xla_decode, DecodeAttentionImpl.pallas: _pallas_decode,
                    DecodeAttentionImpl.pallas_combined: _pallas_decode}


def resolve_decode_impl(impl: DecodeAttentionImpl | str, cfg: ModelConfig) -> DecodeAttentionImpl:
    try:
        impl = DecodeAttentionImpl(impl)
    except ValueError:
        raise ValueError(f"attention={impl!r}: allowed {[x.value for x in DecodeAttentionImpl]}") from None
    fused_ok = fused_supported(cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim)
    if impl == DecodeAttentionImpl.fused and not fused_ok:
        raise ValueError(f"attention='fused' needs a power-of-two group size (num_heads / num_kv_heads = "
                         f"{cfg.num_heads} / {cfg.num_kv_heads}) and head_dim ({cfg.resolved_head_dim}); use 'pallas'")
    if impl != DecodeAttentionImpl.auto:
        return impl
    head_dim = cfg.resolved_head_dim
    if jax.default_backend() != "gpu" or head_dim < 16 or head_dim & (head_dim - 1):
        return DecodeAttentionImpl.xla
    return DecodeAttentionImpl.pallas


# ------------------------------------------------------------------------------ weights


def prepare_weights(model: Transformer, dtype, *, rows: bool = False) -> dict:
    """The decode layout of `model`'s parameters, in `dtype`, one buffer per layer.

    rows=False: [in, out] matrices (XLA's layout). rows=True: the Pallas layer kernels'
    output-major [out, in] matrices, each RMSNorm's scale folded into the matrix after it
    (decode_gemv.fold_norm), so the norms keep no scale of their own.
    """
    cfg = model.cfg
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    @jax.jit
    def relayout(p):
        blocks = p["blocks"]
        d, n, k, h, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.num_layers
        per_layer = []
        for i in range(L):
            a, m = blocks["attn"], blocks["mlp"]
            wqkv = jnp.concatenate(
                [a["q_dnh"][i].reshape(d, n * h), a["k_dkh"][i].reshape(d, k * h), a["v_dkh"][i].reshape(d, k * h)],
                axis=1,
            )
            wgu = jnp.concatenate([m["gate_df"][i], m["up_df"][i]], axis=1)
            if rows:
                per_layer.append(
                    {
                        "wqkv_xd": decode_gemv.fold_norm(wqkv, blocks["attn_norm"]["scale"][i]).astype(dtype),
                        "wo_dx": a["o_nhd"][i].reshape(n * h, d).T.astype(dtype),
                        "wgu_xd": decode_gemv.fold_norm(wgu, blocks["mlp_norm"]["scale"][i]).astype(dtype),
                        "wdown_df": m["down_fd"][i].T.astype(dtype),
                    }
                )
                continue
            per_layer.append(
                {
                    "attn_norm": blocks["attn_norm"]["scale"][i],
                    "wqkv_dx": wqkv.astype(dtype),  # x = (N + 2K) H
                    "wo_xd": a["o_nhd"][i].reshape(n * h, d).astype(dtype),
                    "mlp_norm": blocks["mlp_norm"]["scale"][i],
                    "wgu_dx": wgu.astype(dtype),  # x = 2F
                    "wdown_fd": m["down_fd"][i].astype(dtype),
                }
            )
        out = {"layers": tuple(per_layer), "embed_vd": p["embed"]["table_vd"].astype(dtype)}
        head_dv = p["embed"]["table_vd"].T if cfg.tie_embeddings else p["head_dv"]
        if rows:  # the final norm's scale folded into an output-major copy of the head, its rows
            # zero-padded to whole blocks (the logits are sliced back to the vocabulary)
            head_xd = decode_gemv.fold_norm(head_dv, p["final_norm"]["scale"]).astype(dtype)
            out["head_xd"] = jnp.pad(head_xd, ((0, _round_up(cfg.vocab_size, HEAD_ROWS) - cfg.vocab_size), (0, 0)))
            return out
        out["final_norm"] = p["final_norm"]["scale"]
        if not cfg.tie_embeddings:
            out["head_dv"] = head_dv.astype(dtype)
        return out

    return relayout(params)


def weight_bytes_per_step(weights: dict) -> int:
    """Bytes of weights one decode step reads: everything except the embedding table
    (one row per token), unless the table is also the tied output head."""
    total = sum(x.nbytes for x in jax.tree.leaves(weights))
    if "head_dv" in weights or "head_xd" in weights:
        total -= weights["embed_vd"].nbytes
    return total


# --------------------------------------------------------------------------- the model


def _rms_norm(x, scale, eps):
    """layers.RMSNorm's math on a bare scale vector: f32 statistics, result in x's dtype.
    scale None: the scale is folded into the next matrix (prepare_weights(rows=True))."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(x.dtype)


def _rows(w) -> bool:
    return "wqkv_xd" in w


def _split_qkv(qkv_btx, cfg: ModelConfig):
    b, t, _ = qkv_btx.shape
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    q = qkv_btx[..., : n * h].reshape(b, t, n, h)
    kk = qkv_btx[..., n * h : (n + k) * h].reshape(b, t, k, h)
    v = qkv_btx[..., (n + k) * h :].reshape(b, t, k, h)
    return q, kk, v


def _qkv(w, x_btd, cfg: ModelConfig):
    if _rows(w):
        return jnp.einsum("btd,xd->btx", _rms_norm(x_btd, None, cfg.norm_eps), w["wqkv_xd"])
    return jnp.einsum("btd,dx->btx", _rms_norm(x_btd, w["attn_norm"], cfg.norm_eps), w["wqkv_dx"])


def _out_proj(w, attn_btx, x_btd):
    if _rows(w):
        return x_btd + jnp.einsum("btx,dx->btd", attn_btx, w["wo_dx"])
    return x_btd + jnp.einsum("btx,xd->btd", attn_btx, w["wo_xd"])


def _mlp(w, x_btd, cfg: ModelConfig):
    if _rows(w):
        gu = jnp.einsum("btd,xd->btx", _rms_norm(x_btd, None, cfg.norm_eps), w["wgu_xd"])
    else:
        gu = jnp.einsum("btd,dx->btx", _rms_norm(x_btd, w["mlp_norm"], cfg.norm_eps), w["wgu_dx"])
    gate, up = gu[..., : cfg.mlp_dim], gu[..., cfg.mlp_dim :]
    act = jax.nn.silu(gate) * up
    if _rows(w):
        return x_btd + jnp.einsum("btf,df->btd", act, w["wdown_df"])
    return x_btd + jnp.einsum("btf,fd->btd", act, w["wdown_fd"])


def _head(weights, x_bd, cfg: ModelConfig):
    """Final norm and output head on one position per row: logits [B, V] f32."""
    if "head_xd" in weights:  # prepare_weights(rows=True): the norm's scale is in the matrix
        x_bd = _rms_norm(x_bd, None, cfg.norm_eps)
        w = weights["head_xd"][: cfg.vocab_size]
        return jnp.einsum("bd,vd->bv", x_bd, w, preferred_element_type=jnp.float32)
    x_bd = _rms_norm(x_bd, weights["final_norm"], cfg.norm_eps)
    w = weights["embed_vd"].T if cfg.tie_embeddings else weights["head_dv"]
    return jnp.einsum("bd,dv->bv", x_bd, w, preferred_element_type=jnp.float32)


def _prefill_forward(weights, cache, tokens_bt, lengths_b, *, cfg: ModelConfig, core, row0=0):
    """Prompts [B, T] (right-padded) -> logits at each row's last real token [B, V]; the cache's
    rows row0 .. row0 + B filled (the cache may hold more rows than the prompts)."""
    b, t = tokens_bt.shape
    positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inv_freq = layers.rope_frequencies(cfg)
    x = jnp.take(weights["embed_vd"], tokens_bt, axis=0)  # [B, T, D]
    ks, vs = [], []
    for w, ck, cv in zip(weights["layers"], cache["k"], cache["v"]):
        q, k, v = _split_qkv(_qkv(w, x, cfg), cfg)
        q = layers.apply_rope(q, positions_bt, inv_freq)
        k = layers.apply_rope(k, positions_bt, inv_freq)
        # Causal attention within the prompt: a real token never sees the padding after it.
        attn = core(q, k, v, causal=True, segment_ids=None)
        x = _out_proj(w, attn.reshape(b, t, -1), x)
        x = _mlp(w, x, cfg)
        ks.append(jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (row0, 0, 0, 0)))
        vs.append(jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (row0, 0, 0, 0)))
    x_last = x[jnp.arange(b), lengths_b - 1]  # [B, D]
    return _head(weights, x_last, cfg), {"k": tuple(ks), "v": tuple(vs)}


def _step_forward(weights, cache, tokens_b, pos_b, *, cfg: ModelConfig, attn_impl: DecodeAttentionImpl,
                  layer_impl: DecodeLayerImpl = DecodeLayerImpl.xla, blocks: decode_gemv.LayerBlocks | None = None,
                  tma: decode_tma.TmaSettings | None = None, mk_options: tuple = (), mk_reach: int | None = None):
    """One token per row at position pos[b] -> logits [B, V]; its K/V written in place. tma: the
    TMA kernels' settings (layers="pallas_tma"); mk_options, mk_reach: the megakernel's plan options
    and reach (megakernel_plan)."""
    b = tokens_b.shape[0]
    s = _cache_len(cache, cfg)
    inv_freq = layers.rope_frequencies(cfg)
    rows = jnp.arange(b)
    # Finished rows may sit at the end; never write past it. (Their outputs are discarded.)
    write_b = jnp.minimum(pos_b, s - 1)
    lengths_b = write_b + 1
    if layer_impl == DecodeLayerImpl.megakernel:
        return _megakernel_step(weights, cache, tokens_b, write_b, cfg=cfg, options=mk_options, reach=mk_reach)
    if layer_impl in (DecodeLayerImpl.pallas, DecodeLayerImpl.pallas_tma):
        return _pallas_step(weights, cache, tokens_b, write_b, cfg=cfg, attn_impl=attn_impl, inv_freq=inv_freq,
                            blocks=layer_blocks(cfg, b, blocks),
                            tma=(tma or decode_tma.TmaSettings()) if layer_impl == DecodeLayerImpl.pallas_tma else None)
    fused = attn_impl == DecodeAttentionImpl.fused
    if fused:  # RoPE at each row's position, once per step for every layer
        angles_bf = write_b[:, None].astype(jnp.float32) * inv_freq
        cos_bf, sin_bf = jnp.cos(angles_bf), jnp.sin(angles_bf)
    x = jnp.take(weights["embed_vd"], tokens_b, axis=0)[:, None, :]  # [B, 1, D]
    ks, vs = [], []
    for w, ck, cv in zip(weights["layers"], cache["k"], cache["v"]):
        qkv = _qkv(w, x, cfg)
        if fused:
            heads = cfg.num_heads + 2 * cfg.num_kv_heads
            attn, ck, cv = decode_attention_fused(qkv.reshape(b, heads, -1).astype(ck.dtype), write_b, cos_bf, sin_bf,
                                                  ck, cv, num_heads=cfg.num_heads)
        else:
            q, k, v = _split_qkv(qkv, cfg)
            q = layers.apply_rope(q, write_b[:, None], inv_freq)
            k = layers.apply_rope(k, write_b[:, None], inv_freq)
            ck = ck.at[rows, write_b].set(k[:, 0].astype(ck.dtype))  # [B, S, K, H], in place
            cv = cv.at[rows, write_b].set(v[:, 0].astype(cv.dtype))
            attn = DECODE_ATTENTION[attn_impl](q[:, 0], ck, cv, lengths_b)  # [B, N, H]
        x = _out_proj(w, attn.reshape(b, 1, -1), x)
        x = _mlp(w, x, cfg)
        ks.append(ck)
        vs.append(cv)
    return _head(weights, x[:, 0], cfg), {"k": tuple(ks), "v": tuple(vs)}


def _pallas_step(weights, cache, tokens_b, write_b, *, cfg: ModelConfig, attn_impl: DecodeAttentionImpl, inv_freq,
                 blocks: decode_gemv.LayerBlocks, tma: decode_tma.TmaSettings | None = None):
    """_step_forward with the Pallas layer kernels: per layer qkv_rope (norm, projection, RoPE,
    cache write), attention, out projection + residual, norm + gate/up + SwiGLU, down + residual.
    tma: the gate/up + SwiGLU by decode_tma, which takes the norm statistic itself; the residual
    stream then stays padded to its 8 rows through the step (padded once, after the embedding:
    the other kernels compute the batch rows and pass the padding rows through)."""
    b = tokens_b.shape[0]
    eps = cfg.norm_eps
    x = jnp.take(weights["embed_vd"], tokens_b, axis=0)  # [B, D]
    if tma:  # zeros: they stay zeros (norm of 0 is finite, SwiGLU of 0 is 0) and are never read back
        x = jnp.pad(x, ((0, decode_tma.ROWS - b), (0, 0)))
    # beyond the gate/up, the projections the settings name (TmaSettings.projections; an experiment)
    tma_projections = set(tma.projections) if tma else set()
    tma_kw = dict(blocks=tma.blocks, pdl=tma.pdl) if tma else {}
    # The flash-decoding kernel takes q in its own tile layout, written so by qkv_rope.
    grouped = (attn_impl in (DecodeAttentionImpl.pallas, DecodeAttentionImpl.pallas_combined)
               and cfg.num_heads // cfg.num_kv_heads <= decode_gemv.MIN_ROWS)
    combined = (grouped and attn_impl == DecodeAttentionImpl.pallas_combined
                and combine_in_kernel_reason(cfg.num_heads, cfg.num_kv_heads) is None)
    # the in-kernel combine's counters, one set for every layer of the step (each call adds its splits)
    tickets = jnp.zeros((b, cfg.num_kv_heads, 1), jnp.int32) if combined else None
    tma_qkv = decode_tma.QKV in tma_projections
    if tma_qkv:  # q/k/v rotated by the TMA kernel; the attention kernel writes the cache
        n, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        cs = decode_tma.rope_tables(jnp.pad(write_b, (0, decode_tma.ROWS - b)), inv_freq, hd, tma.blocks.block_f)
        no_turn = jnp.ones((b, hd // 2), jnp.float32), jnp.zeros((b, hd // 2), jnp.float32)
        # tensor-core attention where the heads allow its 16-row q tiles; else the CUDA-core fused kernel
        rotated_ok = rotated_supported(n, kv, hd) is None
    ks, vs = [], []
    for w, ck, cv in zip(weights["layers"], cache["k"], cache["v"]):
        if tma_qkv:
            qkv8 = decode_tma.qkv_rope_tma(x, w["wqkv_xd"], cs, num_heads=n, num_kv_heads=kv, head_dim=hd,
                                           norm_eps=eps, **tma_kw)
            qkv = qkv8[:b].reshape(b, n + 2 * kv, hd)
            if rotated_ok:
                attn, ck, cv = decode_attention_rotated(qkv, write_b, ck, cv, num_heads=n)
            else:
                attn, ck, cv = decode_attention_fused(qkv, write_b, *no_turn, ck, cv, num_heads=n)
        else:
            q, ck, cv = decode_gemv.qkv_rope(x, w["wqkv_xd"], inv_freq, write_b, ck, cv, num_heads=cfg.num_heads,
                                             eps=eps, blocks=blocks.qkv, q_layout="groups" if grouped else "heads")
            if combined:
                attn, tickets = decode_attention_grouped(q, ck, cv, write_b + 1, num_heads=cfg.num_heads,
                                                         tickets=tickets)
            elif grouped:
                attn = decode_attention_grouped(q, ck, cv, write_b + 1, num_heads=cfg.num_heads)
            else:
                attn = DECODE_ATTENTION[attn_impl](q, ck, cv, write_b + 1)  # [B, N, H]
        attn = attn.reshape(b, -1)
        if "out" in tma_projections:  # attention's rows padded too (XLA; it can fuse the pad into the combine)
            padded = jnp.pad(attn, ((0, decode_tma.ROWS - b), (0, 0)))
            x = decode_tma.matmul_residual_tma(padded, w["wo_dx"], x, **tma_kw)
        else:
            x = decode_gemv.matmul_residual(attn, w["wo_dx"], x, blocks=blocks.out, rows=b)
        if tma:  # the down kernel reads the batch rows of h8
            h = decode_tma.gate_up_swiglu_tma(x, None, w["wgu_xd"], norm_eps=eps, **tma_kw)
        else:
            h = decode_gemv.gate_up_swiglu(x, w["wgu_xd"], eps=eps, blocks=blocks.gate_up)
        if "down" in tma_projections:
            x = decode_tma.matmul_residual_tma(h, w["wdown_df"], x, **tma_kw)
        else:
            x = decode_gemv.matmul_residual(h, w["wdown_df"], x, blocks=blocks.down, rows=b)
        ks.append(ck)
        vs.append(cv)
    if "head" in tma_projections:
        logits = decode_tma.norm_matmul_tma(x, weights["head_xd"], eps=eps, **tma_kw)[:b]
    else:
        logits = decode_gemv.norm_matmul(x[:b], weights["head_xd"], eps=eps, blocks=blocks.head)
    return logits[:, : cfg.vocab_size], {"k": tuple(ks), "v": tuple(vs)}


# ---------------------------------------------------------------------------- sampling


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The static part of the sampling settings (what changes the compiled program)."""

    greedy: bool = True
    top_k: int | None = None
    use_top_p: bool = False
    kernel: bool = False  # sampled rows by scaling.kernels.sample (no sort), the same tokens


# The smallest temperature a step divides by: any smaller one is taken as this. logits / 1e-30
# stays inside f32 for |logits| < 3e8, and its distribution is the argmax's for any two logits
# more than ~1e-28 apart: what every smaller temperature gives, without +-inf ties.
MIN_TEMPERATURE = 1e-30
# The largest temperature a step divides by (f32's largest finite): every larger one draws
# uniformly over the kept tokens just the same, as logits / T rounds to 0 either way.
MAX_TEMPERATURE = float(np.finfo(np.float32).max)


def _chosen_logprob(logits_bv, tok_b):
    """log_softmax(logits)[tok] per row, from the row's max and sum (no [B, V] log-softmax)."""
    m_b1 = jnp.max(logits_bv, axis=-1, keepdims=True)
    lse_b = jnp.log(jnp.sum(jnp.exp(logits_bv - m_b1), axis=-1))
    return (jnp.take_along_axis(logits_bv, tok_b[:, None], axis=-1) - m_b1)[:, 0] - lse_b


def sample(logits_bv, keys_b, temperature, top_p, sampling: Sampling):
    """Next token [B] int32 and its log-prob under the model [B] f32."""
    logits_bv = logits_bv.astype(jnp.float32)
    if sampling.greedy:
        tok_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        return tok_b, _chosen_logprob(logits_bv, tok_b)
    if sampling.kernel:  # (categorical's own noise: the same token below, without the sorts)
        v = logits_bv.shape[-1]
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys_b)
        return sample_kernel.sample_rows(logits_bv, noise, temperature, top_p, top_k=sampling.top_k,
                                         use_top_p=sampling.use_top_p)
    logp_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    z = logits_bv / temperature  # (T >= MIN_TEMPERATURE, the Decoder's floor: z stays finite)
    if sampling.top_k is not None:
        kth = jax.lax.top_k(z, sampling.top_k)[0][:, -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    if sampling.use_top_p:
        z_sorted = -jnp.sort(-z, axis=-1)  # descending
        p_sorted = jax.nn.softmax(z_sorted, axis=-1)
        # Keep a token while the mass before it is < top_p (the first is always kept).
        keep = (jnp.cumsum(p_sorted, axis=-1) - p_sorted) < top_p
        last = jnp.sum(keep, axis=-1, keepdims=True) - 1
        thresh = jnp.take_along_axis(z_sorted, last, axis=-1)
        z = jnp.where(z < thresh, -jnp.inf, z)
    tok_b = jax.vmap(jax.random.categorical)(keys_b, z).astype(jnp.int32)
    return tok_b, jnp.take_along_axis(logp_bv, tok_b[:, None], axis=-1)[:, 0]


def _row_keys(seed_key, count_b):
    rows = jnp.arange(count_b.shape[0])
    return jax.vmap(lambda r, c: jax.random.fold_in(jax.random.fold_in(seed_key, r), c))(rows, count_b)


def _advance(state, tok_b, lp_b, params):
    """Book-keeping after a token is sampled for every active row."""
    active = ~state["done"]
    tok_b = jnp.where(active, tok_b, -1)
    count = state["count"] + active
    pos = jnp.where(active, state["pos"] + 1, state["pos"])
    is_stop = jnp.any(tok_b[:, None] == params["stop_ids"][None, :], axis=-1)
    done = state["done"] | (active & (is_stop | (count >= params["max_new"]) | (pos >= params["max_len"])))
    new_state = dict(state, token=jnp.where(active, tok_b, state["token"]), pos=pos, count=count, done=done)
    return new_state, tok_b, jnp.where(active, lp_b, 0.0)


# ------------------------------------------------------------------- compiled functions


@functools.partial(jax.jit, static_argnames=("cfg", "core_impl"), donate_argnames=("cache",))
def _prefill_rows(weights, cache, tokens_rt, lengths_r, row0, *, cfg, core_impl):
    """The prompts of rows row0 .. row0 + R into the cache; their last tokens' logits [R, V] (f32)."""
    logits, cache = _prefill_forward(weights, cache, tokens_rt, lengths_r, cfg=cfg, core=attention_core(core_impl),
                                     row0=row0)
    return logits.astype(jnp.float32), cache


@functools.partial(jax.jit, static_argnames=("sampling", "mk_ppr"))
def _first_tokens(logits_bv, lengths_b, done_b, params, cache=None, *, sampling, mk_ppr=0):
    """The decode state after the prefill, its first sampled tokens and whether every row is done,
    as one call (each call is a dispatch and a launch on the way to the first token). mk_ppr > 0:
    the state holds the prefill's cache in the megakernel's layout (megakernel_cache), with that
    many positions a row; else cache is None and the state has none (the caller adds the
    prefill's: passed through a call, the cache would be copied or donated)."""
    state = {
        "token": jnp.zeros_like(lengths_b),
        "pos": lengths_b - 1,  # position of the token just fed; _advance moves it to len
        "count": jnp.zeros_like(lengths_b),
        "done": done_b,
    }
    keys = _row_keys(jax.random.wrap_key_data(params["key"]), state["count"])
    tok, lp = sample(logits_bv, keys, params["temperature"], params["top_p"], sampling)
    state, tok, lp = _advance(state, tok, lp, params)
    if mk_ppr:
        state = dict(state, cache=megakernel_cache(cache, ppr=mk_ppr))
    return state, tok, lp, jnp.all(state["done"])


@functools.partial(jax.jit, static_argnames=("shape", "layers", "dtype"))
def _empty_cache(*, shape, layers, dtype):
    """The prefill's cache {"k", "v": per layer [B, S, K, H]}, zeroed, as one call."""
    return {"k": tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
            "v": tuple(jnp.zeros(shape, dtype) for _ in range(layers))}


def prefill_rows_per_call(batch: int, prompt_len: int, token_budget: int) -> int:
    """Rows one prefill call takes: the largest power of two whose prompts fit token_budget
    (at least one row, at most the batch; a power of two divides the power-of-two batch)."""
    rows = 1
    while rows * 2 <= batch and rows * 2 * prompt_len <= token_budget:
        rows *= 2
    return rows


@functools.partial(
    jax.jit, static_argnames=("cfg", "attn_impl", "layer_impl", "blocks", "sampling", "n_steps", "tma", "mk_options",
                     "mk_reach"),
    donate_argnames=("state",)
)
def _decode_chunk(weights, state, params, *, cfg, attn_impl, sampling, n_steps, layer_impl=DecodeLayerImpl.xla,
                  blocks=None, tma=None, mk_options=(), mk_reach=None):
    loop = layer_impl == DecodeLayerImpl.megakernel and sampling.greedy
    if loop and _loop_runs(cfg, _cache_len(state["cache"], cfg), mk_options, mk_reach):  # (one launch for the chunk)
        return _megakernel_greedy_chunk(weights, state, params, cfg=cfg, n_steps=n_steps, options=mk_options,
                                        reach=mk_reach)
    seed_key = jax.random.wrap_key_data(params["key"])

    def step(state, _):
        logits, cache = _step_forward(weights, state["cache"], state["token"], state["pos"], cfg=cfg,
                                      attn_impl=attn_impl, layer_impl=layer_impl, blocks=blocks, tma=tma,
                                      mk_options=mk_options, mk_reach=mk_reach)
        tok, lp = sample(logits, _row_keys(seed_key, state["count"]), params["temperature"], params["top_p"], sampling)
        state, tok, lp = _advance(dict(state, cache=cache), tok, lp, params)
        return state, (tok, lp)

    state, (toks, lps) = jax.lax.scan(step, state, None, length=n_steps)
    return state, toks.T, lps.T  # [B, n_steps]


def _loop_runs(cfg: ModelConfig, max_len: int, options: tuple = (), reach: int | None = None) -> bool:
    """Whether megakernel_loop runs this model's plan (else greedy chunks go step by step)."""
    try:
        decode_megakernel.loop_check(megakernel_plan(cfg, max_len, options, reach))
        return True
    except ValueError:
        return False


def _megakernel_greedy_chunk(weights, state, params, *, cfg, n_steps, options: tuple = (), reach: int | None = None):
    """_decode_chunk's greedy batch-1 steps as one launch of decode_megakernel.megakernel_loop
    (the kernel picks each next token itself), then the chunk's book-keeping at once: the same
    tokens, log-probs and state as n_steps of `sample` and `_advance`. Steps after the row
    finishes run and are discarded, as in the step-by-step chunk."""
    cache = state["cache"]
    plan = megakernel_plan(cfg, _cache_len(cache, cfg), options, reach)
    rope_all = decode_megakernel.rope_tables(plan.max_len, layers.rope_frequencies(cfg))
    pos0 = state["pos"][0]
    toks, raw, r, kv = decode_megakernel.megakernel_loop(
        state["token"][0], jnp.minimum(pos0, plan.max_len - 1), n_steps, weights["embed_vd"], rope_all,
        weights["units"], cache["kv"], plan=plan, vocab=cfg.vocab_size, interpret=jax.default_backend() != "gpu")
    lps = _chosen_logprob(raw[:, : cfg.vocab_size] * r[:, None], toks)  # (the n steps as rows)
    # _advance, step i of the chunk, for a row active since its start: count and pos one further
    i = jnp.arange(1, n_steps + 1, dtype=jnp.int32)
    is_stop = jnp.any(toks[:, None] == params["stop_ids"][None, :], axis=-1)
    stop = is_stop | (state["count"][0] + i >= params["max_new"]) | (pos0 + i >= params["max_len"])
    stopped_before = jnp.cumsum(stop) - stop > 0
    active = ~state["done"][0] & ~stopped_before
    n_active = jnp.sum(active).astype(jnp.int32)
    new_state = dict(
        state, cache={"kv": kv},
        token=jnp.where(n_active > 0, toks[jnp.maximum(n_active - 1, 0)], state["token"][0])[None],
        pos=(pos0 + n_active)[None], count=state["count"] + n_active,
        done=state["done"] | jnp.any(active & stop))
    return new_state, jnp.where(active, toks, -1)[None], jnp.where(active, lps, 0.0)[None]


# ------------------------------------------------------------------------------ the API


def _is_int(x) -> bool:
    """An integer scalar: Python's (not a bool), numpy's, or a 0-d integer array."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, np.integer)):
        return True
    return isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer)


def _is_real(x) -> bool:
    """A real scalar: an integer (_is_int), a float (Python's or numpy's) or a 0-d float array."""
    if _is_int(x) or isinstance(x, (float, np.floating)):
        return True
    return isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.floating)


def _cache_dtype(cache_dtype, compute_dtype) -> jnp.dtype:
    """Decoder(cache_dtype=...) checked: a floating dtype (None: the compute dtype). An integer one
    had failed in the first decode step, after the prefill compiled: the K/V writes would truncate."""
    if cache_dtype is None:
        return jnp.dtype(compute_dtype)
    try:
        dt = jnp.dtype(cache_dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"cache_dtype={cache_dtype!r} must be a floating dtype (bfloat16, float16 or float32), "
                         "or None (the model's compute dtype)")
    return dt


def check_decoder_options(*, max_batch=None, max_len=None, chunk=DEFAULT_CHUNK, min_batch=None,
                          layers="auto", megakernel_short_reach=MEGAKERNEL_SHORT_REACH,
                          prefill_tokens=PREFILL_TOKENS, sampler="auto") -> None:
    """Decoder's options that need no model, checked (ValueError naming the option and what it
    may be). Apart from the Decoder so that a CLI can check its flags before it loads a model."""
    # (a float had been taken as a bound, 0 refused every call with "1 prompts exceed the batch")
    if max_batch is not None and (not _is_int(max_batch) or max_batch < 1):
        raise ValueError(f"{max_batch=} must be an int >= 1, or None (any batch)")
    if max_len is not None and (not _is_int(max_len) or max_len < 1):
        raise ValueError(f"{max_len=} must be an int >= 1")
    if not _is_int(chunk) or chunk < 1:  # (a float failed inside the trace)
        raise ValueError(f"{chunk=} must be an int >= 1")
    if min_batch is not None and (not _is_int(min_batch) or min_batch < 1 or min_batch & (min_batch - 1)):
        raise ValueError(f"{min_batch=} must be a power of two >= 1")
    try:
        DecodeLayerImpl(layers)
    except ValueError:
        raise ValueError(f"layers={layers!r}: allowed {[x.value for x in DecodeLayerImpl]}") from None
    # (_is_int: True had been taken as 1, and numpy's ints refused)
    if not _is_int(megakernel_short_reach) or megakernel_short_reach < 0:
        raise ValueError(f"megakernel_short_reach must be an int >= 0 (0: off), got {megakernel_short_reach!r}")
    if not _is_int(prefill_tokens) or prefill_tokens < 1:
        raise ValueError(f"prefill_tokens must be an int >= 1, got {prefill_tokens!r}")
    if not isinstance(sampler, str) or sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")


def check_sampling(max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=0, *, vocab_size=None) -> None:
    """A call's numbers checked (ValueError naming the argument and its range). vocab_size None
    leaves top_k's upper bound to the call (a CLI checks its flags before the model loads)."""
    # (a float would have run int(max_new_tokens) steps; a float top_k failed inside the compile)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    # (NaN would sample from NaN logits; inf makes every logit 0, so top-k and top-p keep everything)
    if not _is_real(temperature) or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 is greedy)")
    if top_k is not None and (not _is_int(top_k) or top_k < 1 or (vocab_size is not None and top_k > vocab_size)):
        raise ValueError(f"top_k={top_k!r} must be an int in [1, vocab_size"
                         + (f"={vocab_size}]" if vocab_size is not None else "]"))
    if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    # (JAX's key(seed) keeps a seed's low 32 bits: 2**32 would draw what 0 draws, -1 what 2**32 - 1 does)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**32)")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_call(vocab_size: int, max_batch: int | None, prompts, max_new_tokens, temperature=0.0, top_k=None,
               top_p=None, max_len=None, seed=0, stop_tokens=()) -> dict:
    """Every error a call can make, raised before anything compiles. Returns _stream's arguments:
    the prompts as a list of rows, the numbers as Python's, the stop ids, max_len resolved."""
    v = vocab_size
    if isinstance(prompts, (np.ndarray, jax.Array)):  # a [prompts, tokens] array of equal-length prompts
        if prompts.ndim != 2:
            raise ValueError(f"prompts as an array must be 2-D [prompts, tokens], got shape {tuple(prompts.shape)}")
        prompts = list(np.asarray(prompts))
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if max_batch is not None and len(prompts) > max_batch:
        raise ValueError(f"{len(prompts)} prompts exceed the batch this decoder was built for "
                         f"(max_batch={max_batch})")
    longest = 0
    for i, p in enumerate(prompts):
        if _is_int(p):
            raise ValueError("prompts must be a list of token-id lists, one per prompt, not a flat list of ids "
                             "(one prompt is [ids])")
        try:
            arr = np.asarray(p)
        except ValueError:  # (ragged nesting)
            arr = np.asarray(None)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise ValueError(f"prompt {i} must be a flat list of integer token ids")
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = arr[(arr < 0) | (arr >= v)]
        if bad.size:
            raise ValueError(f"prompt {i} has token id {int(bad[0])} outside the vocabulary [0, {v})")
        longest = max(longest, arr.size)
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, vocab_size=v)
    if stop_tokens is None:  # (as transformers' eos_token_id=None: no stop tokens)
        stop_tokens = ()
    # (checked here, not when the generator first runs: an int had raised a TypeError there)
    if _is_int(stop_tokens) or isinstance(stop_tokens, (str, bytes)):
        raise ValueError(f"stop_tokens must be a list of token ids, got {stop_tokens!r} (one id is [id])")
    try:
        stop = list(stop_tokens)
    except TypeError:
        raise ValueError(f"stop_tokens must be a list of token ids, got {type(stop_tokens).__name__}") from None
    for x in stop:
        if not _is_int(x):
            raise ValueError(f"stop_tokens must be integer token ids, got {x!r}")
    stop = sorted({int(x) for x in stop if 0 <= x < v})  # (an id outside the vocabulary is never drawn)
    if max_len is not None and (not _is_int(max_len) or max_len < 1):
        raise ValueError(f"max_len={max_len!r} must be an int >= 1")
    if max_len is None:
        max_len = _round_up(longest + int(max_new_tokens), LEN_BUCKET)
    if longest > max_len:
        raise ValueError(f"a prompt of {longest} tokens is longer than the cache (max_len={max_len})")
    return dict(prompts=prompts, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                top_k=None if top_k is None else int(top_k), top_p=None if top_p is None else float(top_p),
                seed=int(seed), stop_tokens=stop, max_len=int(max_len))


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt (a stop token, when hit, is the last one)
    logprobs: list[list[float]]  # the model's log-prob of each new token
    prefill_s: float = 0.0  # wall time of the prefill (synchronised)
    decode_s: float = 0.0  # wall time of the decode steps
    decode_steps: int = 0  # decode steps run (chunks x chunk size, finished rows included)


class Decoder:
    """A model prepared for decoding: weights in the decode layout, compiled steps cached.

    max_batch: the most prompts one call may take (rows are padded to a power of two).
    max_len: cache length (prompt + new tokens); None sizes it per call.
    cache_dtype: the KV cache's dtype, a floating one (None: the model's compute dtype).
    min_batch: rows are padded up to at least this many (padding rows start finished and
        attend to one position). None: steps on the XLA layers pad to GPU_MIN_BATCH on the
        GPU (so small batches take the gemm path of larger ones), steps on the Pallas layers
        are not padded.
    layers: the decode step's layer implementation (DecodeLayerImpl). "pallas": batch buckets
        up to PALLAS_MAX_BATCH that the kernels tile run them, the others XLA, on the same
        weights. "auto": on a Hopper GPU batch-1 steps as one persistent kernel ("megakernel")
        where it runs the model and its copy of the weights fits (`auto_megakernel_reason`, kept
        as the decoder's `auto_megakernel_reason`); else on the GPU the Pallas layers for buckets
        up to AUTO_PALLAS_MAX_BATCH (where they are measured faster; on a Hopper GPU with the TMA
        kernels for models from AUTO_TMA_MIN_HIDDEN wide), XLA above; XLA on other backends.
    gemv_blocks: the Pallas layer kernels' tiles (decode_gemv.LayerBlocks; None: defaults
        per batch, decode_gemv.default_blocks).
    tma: layers="pallas_tma"'s TMA kernels: which projections, PDL, tiles
        (decode_tma.TmaSettings; None: decode_tma.settings(), the module's defaults now, which
        pick the projections by grid width for this model).
    megakernel_options: (layers="megakernel") MegaPlan fields to set over the measured plan,
        e.g. {"qkv_ld": False} (`parse_megakernel_options` says which; the plan's check, which
        values run).
    megakernel_short_reach: chunks whose steps attend at most this many positions run on the plan
        of a cache that short (megakernel_plan's reach), where it differs from the cache's own;
        0: every chunk on the cache's own plan.
    prefill_tokens: prompt tokens one prefill call takes at most; larger batches are prefilled
        a group of rows at a time (at least one row a call, however long its prompt).
    sampler: how sampled (not greedy) tokens are drawn: "xla" (`sample`: top-k and top-p by
        sorting the vocabulary), "pallas" (scaling.kernels.sample: one kernel a step, no sort,
        the same tokens from the same seed) or "auto" (`sample_kernel_runs`: pallas on a GPU for
        top-k or top-p, where it was measured faster; xla for temperature alone and off the GPU).

    The megakernel's unit-major copy of the weights is made at the first batch-1 call, so a
    decoder that only serves larger batches never holds it.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        max_batch: int | None = None,
        max_len: int | None = None,
        cache_dtype=None,
        attention: DecodeAttentionImpl | str = DecodeAttentionImpl.auto,
        chunk: int = DEFAULT_CHUNK,
        min_batch: int | None = None,
        layers: DecodeLayerImpl | str = DecodeLayerImpl.auto,
        gemv_blocks: decode_gemv.LayerBlocks | None = None,
        tma: decode_tma.TmaSettings | None = None,
        megakernel_options: dict | None = None,
        megakernel_short_reach: int = MEGAKERNEL_SHORT_REACH,
        prefill_tokens: int = PREFILL_TOKENS,
        sampler: str = "auto",
    ):
        self.cfg = model.cfg
        self.dtype = model.compute_dtype
        self.cache_dtype = _cache_dtype(cache_dtype, self.dtype)
        check_decoder_options(max_batch=max_batch, max_len=max_len, chunk=chunk, min_batch=min_batch, layers=layers,
                              megakernel_short_reach=megakernel_short_reach, prefill_tokens=prefill_tokens,
                              sampler=sampler)
        self.max_batch = max_batch
        self.max_len = max_len
        self.attn_impl = resolve_decode_impl(attention, self.cfg)
        if self.attn_impl in (DecodeAttentionImpl.pallas, DecodeAttentionImpl.pallas_combined,
                              DecodeAttentionImpl.fused):
            prime_lowering()
        # The prefill's attention core; `auto` is resolved per prompt length (attention.resolve_impl).
        self.core_impl = model.attention_cfg.impl
        prefill_core = resolve_impl(self.core_impl, seq_len=max_len, head_dim=self.cfg.resolved_head_dim, dtype=self.dtype)
        if jnp.dtype(self.dtype) == jnp.float32 and prefill_core == AttentionImpl.cudnn:
            self.core_impl = AttentionImpl.xla  # cuDNN's fused attention takes only 16-bit inputs
        self.prefill_tokens = int(prefill_tokens)
        self.sampler = sampler
        self.chunk = chunk
        gpu = jax.default_backend() == "gpu"
        self.min_batch = min_batch if min_batch is not None else (GPU_MIN_BATCH if gpu else 1)  # XLA steps
        self.pallas_min_batch = min_batch if min_batch is not None else PALLAS_MIN_BATCH
        if tma is not None and not isinstance(tma, decode_tma.TmaSettings):
            raise TypeError(f"tma must be a decode_tma.TmaSettings, got {type(tma).__name__}")
        vocab_rows = _round_up(self.cfg.vocab_size, HEAD_ROWS)
        # a static argument of the compiled step (layers="pallas_tma")
        self.tma = tma or decode_tma.settings(self.cfg, vocab_rows)
        self.layer_impl = resolve_layer_impl(layers, self.cfg, self.attn_impl, gemv_blocks, self.pallas_min_batch,
                                             self.tma)
        # megakernel: batch-1 steps by decode_megakernel, the others as auto
        self.megakernel = self.layer_impl == DecodeLayerImpl.megakernel
        if self.megakernel and jnp.dtype(self.dtype).itemsize != 2:
            raise ValueError(f"layers='megakernel' runs 16-bit models (its tensor-core tiles), got "
                             f"{jnp.dtype(self.dtype)}; use layers='auto'")
        if self.megakernel and self.cache_dtype != jnp.dtype(self.dtype):
            raise ValueError(f"layers='megakernel' reads its cache tiles through the weights' ring: cache_dtype "
                             f"must be {jnp.dtype(self.dtype).name}, got {self.cache_dtype.name}; use layers='auto'")
        if megakernel_options and not self.megakernel:
            raise ValueError(f"megakernel_options set the megakernel's plan: they need layers='megakernel', got "
                             f"layers={self.layer_impl.value!r}")
        self.mk_options = parse_megakernel_options(megakernel_options)
        self.short_reach = int(megakernel_short_reach)
        if self.mk_options:
            try:
                megakernel_plan(self.cfg, MEGAKERNEL_CHECK_LEN, self.mk_options).check()
            except ValueError as e:
                raise ValueError(f"megakernel_options {dict(self.mk_options)}: {e}") from None
        if self.megakernel:
            self.layer_impl = DecodeLayerImpl.auto
        if self.layer_impl == DecodeLayerImpl.auto and not (gpu and self.attn_impl != DecodeAttentionImpl.fused):
            self.layer_impl = DecodeLayerImpl.xla
        # auto's small-batch steps on the TMA kernels (AUTO_TMA_MIN_HIDDEN)
        self.auto_tma = (self.layer_impl == DecodeLayerImpl.auto and is_hopper()
                         and self.cfg.hidden_size >= AUTO_TMA_MIN_HIDDEN
                         and jnp.dtype(self.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
                         and decode_tma.projections_reason(self.cfg, vocab_rows, self.tma) is None)
        self.pallas_max_batch = {DecodeLayerImpl.pallas: PALLAS_MAX_BATCH, DecodeLayerImpl.pallas_tma: decode_tma.ROWS,
                                 DecodeLayerImpl.auto: AUTO_PALLAS_MAX_BATCH}.get(self.layer_impl, 0)
        self.gemv_blocks = gemv_blocks
        self.weights = prepare_weights(model, self.dtype, rows=self.pallas_max_batch > 0 or self.megakernel)
        # auto: batch-1 steps on the megakernel on a Hopper GPU, unless auto_megakernel_reason says why not
        self.auto_megakernel_reason = None
        if self.layer_impl == DecodeLayerImpl.auto and not self.megakernel:
            self.auto_megakernel_reason = auto_megakernel_reason(
                self.cfg, self.dtype, hopper=is_hopper(), copy_bytes=megakernel_copy_bytes(self.weights),
                free_bytes=free_device_bytes(), cache_dtype=self.cache_dtype)  # (rows: auto's batch 1 is Pallas)
            self.megakernel = self.auto_megakernel_reason is None
        self._megakernel_weights = None

    @property
    def megakernel_weights(self) -> dict:
        """The megakernel's unit-major copy of the weights, made at first use from the output-major
        self.weights."""
        if not self.megakernel:
            raise ValueError(f"this decoder runs no megakernel (layers={self.layer_impl.value!r}"
                             + (f"; auto: {self.auto_megakernel_reason}" if self.auto_megakernel_reason else "") + ")")
        if self._megakernel_weights is None:
            plan = megakernel_plan(self.cfg, MEGAKERNEL_CHECK_LEN, self.mk_options)
            self._megakernel_weights = {
                "units": decode_megakernel.prepare(self.weights, plan.block_k, plan.fuse_mlp),
                "embed_vd": self.weights["embed_vd"]}
        return self._megakernel_weights

    def _step_layers(self, batch: int) -> DecodeLayerImpl:
        """The layer implementation a decode step of `batch` rows runs."""
        if self.megakernel and batch == 1:
            return DecodeLayerImpl.megakernel
        if batch <= self.pallas_max_batch and pallas_layers_reason(self.cfg, batch, self.gemv_blocks) is None:
            tma = self.layer_impl == DecodeLayerImpl.pallas_tma or self.auto_tma
            return DecodeLayerImpl.pallas_tma if tma else DecodeLayerImpl.pallas
        return DecodeLayerImpl.xla

    def _chunk_reach(self, max_len: int, bound: int) -> int | None:
        """The megakernel's reach for a chunk whose steps attend at most `bound` positions of a
        cache of max_len: the decoder's short reach where they stay within it and its plan differs
        from the cache's own (one more compile per cache length), else None."""
        if bound > self.short_reach or bound >= max_len:
            return None
        own = megakernel_plan(self.cfg, max_len, self.mk_options)
        short = megakernel_plan(self.cfg, max_len, self.mk_options, self.short_reach)
        # (only a grouped plan's: the 7b's attn_splits, unsplit, are slower already at 448 positions)
        return self.short_reach if own.grouped and short != own else None

    def bucket(self, n_rows: int) -> int:
        """The batch a call of n_rows prompts runs at: a power of two, padded to the minimum of
        the layer implementation that batch runs (the Pallas layers need no padding rows)."""
        b = max(_next_pow2(n_rows), self.pallas_min_batch)
        if self._step_layers(b) != DecodeLayerImpl.xla:
            return b
        return max(_next_pow2(n_rows), self.min_batch)

    # ---------------------------------------------------------------- validation

    def _check(self, prompts, max_new_tokens, temperature, top_k, top_p, max_len, seed=0, stop_tokens=()) -> dict:
        return check_call(self.cfg.vocab_size, self.max_batch, prompts, max_new_tokens, temperature, top_k, top_p,
                          max_len, seed, stop_tokens)

    # ------------------------------------------------------------------ decoding

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        stop_tokens: Sequence[int] | None = (),
        max_len: int | None = None,
        timing: dict | None = None,
    ) -> Iterator[list[tuple[int, list[int], list[float]]]]:
        """Yields, as they are produced, lists of (row, new tokens, their log-probs).

        Bad arguments raise here, at the call, not at the first item (a caller may print the
        prompt between the two)."""
        args = self._check(prompts, max_new_tokens, temperature, top_k, top_p,
                           max_len if max_len is not None else self.max_len, seed, stop_tokens)
        return self._stream(**args, timing=timing)

    def _stream(self, prompts, max_new_tokens, *, temperature, top_k, top_p, seed, stop_tokens, max_len, timing):
        """stream's generator, for the arguments _check returns (max_len resolved, stop_tokens the
        sorted ids in the vocabulary)."""
        cfg = self.cfg
        n_rows = len(prompts)
        b = self.bucket(n_rows)
        # (the megakernel's attention tiles: 64 positions, or 128 with paired positions)
        tile = megakernel_plan(cfg, MEGAKERNEL_CHECK_LEN, self.mk_options).tile_positions if self.megakernel else 0
        s = _round_up(max_len, tile or KV_BLOCK)
        longest = max(len(p) for p in prompts)
        t = min(max(MIN_PROMPT_BUCKET, _next_pow2(longest)), s)

        tokens = np.zeros((b, t), np.int32)
        lengths = np.ones((b,), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            lengths[i] = len(p)
        done = np.arange(b) >= n_rows  # padding rows start finished
        stop = stop_tokens
        stop_ids = np.full((_round_up(max(len(stop), 1), 8),), -1, np.int32)
        stop_ids[: len(stop)] = stop
        greedy = temperature == 0 or top_k == 1
        use_top_p = (not greedy) and top_p is not None and top_p < 1
        sampling = Sampling(greedy=greedy, top_k=None if greedy else top_k, use_top_p=use_top_p,
                            kernel=not greedy and sample_kernel_runs(self.sampler, top_k=top_k, use_top_p=use_top_p))
        # (host values moved to the device in one transfer each, not one eager op per value: on
        # the way to the first token, every call on the host is latency)
        params = jax.device_put({
            # (at least MIN_TEMPERATURE: below it logits / T leaves f32's range for ordinary logits,
            # and the sampler kernel, which divides as it is, drew among tokens tied at +inf)
            # (at most f32's largest: above it the cast gave inf, and an inf logit / inf is NaN)
            "temperature": np.float32(min(max(temperature, MIN_TEMPERATURE), MAX_TEMPERATURE) if temperature > 0
                                      else 1.0),
            "top_p": np.float32(top_p if top_p is not None else 1.0),
            "stop_ids": stop_ids,
            "max_new": np.int32(max_new_tokens),
            "max_len": np.int32(max_len),
            "key": jax.random.key_data(jax.random.key(seed)),
        })
        cache = _empty_cache(shape=(b, s, cfg.num_kv_heads, cfg.resolved_head_dim), layers=cfg.num_layers,
                             dtype=self.cache_dtype)

        t0 = time.perf_counter()
        # Rows in groups of at most prefill_tokens prompt tokens: the activations of 64 long prompts
        # at once would otherwise take more memory than the cache they fill.
        r = prefill_rows_per_call(b, t, self.prefill_tokens)
        logits = []
        for row0 in range(0, b, r):
            lg, cache = _prefill_rows(self.weights, cache, *jax.device_put((tokens[row0:row0 + r],
                                      lengths[row0:row0 + r], np.int32(row0))), cfg=cfg, core_impl=self.core_impl)
            logits.append(lg)
        logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits)
        mk_ppr = megakernel_plan(cfg, s, self.mk_options).ppr if self._step_layers(b) == DecodeLayerImpl.megakernel \
            else 0
        state, tok, lp, all_done = _first_tokens(logits, *jax.device_put((lengths, done)), params,
                                                 cache if mk_ppr else None, sampling=sampling, mk_ppr=mk_ppr)
        if not mk_ppr:
            state = dict(state, cache=cache)
        tok, lp, all_done = jax.device_get((tok, lp, all_done))
        t1 = time.perf_counter()
        if timing is not None:
            timing.update(prefill_s=t1 - t0, decode_s=0.0, decode_steps=0)
        yield [(i, [int(tok[i])], [float(lp[i])]) for i in range(n_rows)]

        # Dispatch chunk k+1 before reading chunk k back, so the host sync overlaps device work;
        # the cost is at most one chunk run after every row has finished.
        finished = bool(all_done)
        steps_left = max_new_tokens - 1
        pending = None
        # (the megakernel: positions the chunk's steps attend at most, the prompt's and the chunks' so far)
        reach_bound = longest
        while True:
            launched = None
            if not finished and steps_left > 0:
                step_layers = self._step_layers(b)
                reach_bound += self.chunk
                weights = self.megakernel_weights if step_layers == DecodeLayerImpl.megakernel else self.weights
                state, toks, lps = _decode_chunk(weights, state, params, cfg=cfg, attn_impl=self.attn_impl,
                                                 layer_impl=step_layers, blocks=self.gemv_blocks,
                                                 sampling=sampling, n_steps=self.chunk,
                                                 tma=self.tma if step_layers == DecodeLayerImpl.pallas_tma else None,
                                                 mk_options=self.mk_options
                                                 if step_layers == DecodeLayerImpl.megakernel else (),
                                                 mk_reach=self._chunk_reach(s, reach_bound)
                                                 if step_layers == DecodeLayerImpl.megakernel else None)
                steps_left -= self.chunk
                launched = (toks, lps, jnp.all(state["done"]))
                if timing is not None:
                    timing["decode_steps"] += self.chunk
            if pending is not None:
                toks_h, lps_h, pending_done = jax.device_get(pending)
                finished = finished or bool(pending_done)
                out = []
                for i in range(n_rows):
                    keep = toks_h[i] >= 0
                    if keep.any():
                        out.append((i, toks_h[i][keep].tolist(), lps_h[i][keep].tolist()))
                if out:
                    yield out
            if launched is None:
                break
            pending = launched
        if timing is not None:
            jax.block_until_ready(state)
            timing["decode_s"] = time.perf_counter() - t1

    def generate(self, prompts, max_new_tokens: int, **kw) -> Generation:
        timing: dict = {}
        items_iter = self.stream(prompts, max_new_tokens, timing=timing, **kw)  # (checks the arguments)
        tokens: list[list[int]] = [[] for _ in range(len(prompts))]
        logprobs: list[list[float]] = [[] for _ in range(len(prompts))]
        for items in items_iter:
            for i, toks, lps in items:
                tokens[i].extend(toks)
                logprobs[i].extend(lps)
        return Generation(tokens, logprobs, **timing)


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = (),
    return_logprobs: bool = False,
    max_len: int | None = None,
):
    """New tokens per prompt (a list of token-id lists, or a [prompts, tokens] integer array), and
    their log-probs on request.

    Greedy when temperature == 0. A row stops after a stop token (included in its output),
    after max_new_tokens, or when its cache (max_len, default prompt + new tokens) is full.
    """
    # (the call's arguments before the Decoder re-lays the weights out: that had come first)
    check_call(model.cfg.vocab_size, None, prompts, max_new_tokens, temperature, top_k, top_p, max_len, seed,
               stop_tokens)
    dec = Decoder(model, max_len=max_len)
    out = dec.generate(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       stop_tokens=stop_tokens)
    return (out.tokens, out.logprobs) if return_logprobs else out.tokens
