"""Pure-jnp attention: the reference every attention kernel is tested against.

Shapes follow the kernels: q [B, T, H, D], k and v [B, S, KV, D] with H % KV == 0 (grouped-query
attention: query head h reads KV head h // (H // KV), the convention of
`jax.nn.dot_product_attention`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from scaling.attention_args import check_attention_args

SegmentIds = jax.Array | tuple[jax.Array, jax.Array] | None


def split_segment_ids(segment_ids: SegmentIds) -> tuple[jax.Array, jax.Array] | None:
    """None, one [B, T] array (self-attention) or a (q [B, T], kv [B, S]) pair -> pair or None."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        q_seg, kv_seg = segment_ids
        return q_seg, kv_seg
    return segment_ids, segment_ids


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: SegmentIds = None,
    sm_scale: float | None = None,
) -> jax.Array:
    """softmax(q kᵀ · sm_scale + mask) v, computed in f32 (f64 for f64 inputs; q, k and v share a
    floating dtype).

    Returns [B, T, H, D] in the compute dtype (f32 or f64), not the input dtype, so tests can
    compare a low-precision kernel against it without a second rounding. Rows whose every
    key is masked (possible with segment ids) return zeros, and their gradients are zero.

    causal: position t attends to keys s <= t (requires T == S).
    segment_ids: positions attend only to keys with an equal segment id.
    sm_scale: defaults to 1 / sqrt(D).
    """
    check_attention_args(q, k, v, causal=causal, segment_ids=segment_ids)
    b, t, h, d = q.shape
    _, s, kv, _ = k.shape
    compute = jnp.float64 if jnp.float64 in (q.dtype, k.dtype, v.dtype) else jnp.float32
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    group = h // kv

    q_btkgd = q.astype(compute).reshape(b, t, kv, group, d)
    logits_bkgts = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k.astype(compute)) * scale

    mask_bts = jnp.ones((b, t, s), dtype=bool)
    if causal:
        mask_bts &= jnp.tril(jnp.ones((t, s), dtype=bool))[None]
    seg = split_segment_ids(segment_ids)
    if seg is not None:
        q_seg, kv_seg = seg
        mask_bts &= q_seg[:, :, None] == kv_seg[:, None, :]
    mask = mask_bts[:, None, None]  # [B, 1, 1, T, S]

    # Masked logits never reach exp(): a finite stand-in keeps the gradient free of 0 * inf.
    safe = jnp.where(mask, logits_bkgts, 0.0)
    row_max = jnp.max(jnp.where(mask, logits_bkgts, -jnp.inf), axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.where(mask, jnp.exp(safe - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)  # fully masked rows: p = 0, output 0
    out_bkgtd = jnp.einsum("bkgts,bskd->bkgtd", p, v.astype(compute))
    return out_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
