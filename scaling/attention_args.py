"""The calls every attention implementation refuses, checked in one place.

Imported by the dispatcher (`scaling.attention`) and the pure-jnp reference
(`scaling.kernels.reference`), so every core and the reference refuse the same calls with the same
words, before anything is traced. Kept apart from both because `scaling.kernels` imports the
Pallas kernels and the XLA core must not need them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def check_attention_args(q, k, v, *, causal: bool, segment_ids) -> None:
    """Raise ValueError for ranks and shapes, TypeError for a causal flag that is not a bool, for
    q/k/v that are not arrays of one floating dtype, and for segment ids that are not integer arrays.

    q [B, T, H, D]; k and v [B, S, KV, D], the same shape, with H a multiple of KV. causal needs
    T == S: the cores disagreed on where the diagonal lies otherwise (the XLA core bottom-right,
    jax.nn.dot_product_attention behind the cuDNN core top-left). Segment ids: None, one [B, T]
    array (needs T == S) or a (q [B, T], kv [B, S]) pair of integer arrays.
    """
    # The flash kernels refused these; the xla core read causal="no" or None by truthiness.
    if not (isinstance(causal, (bool, np.bool_)) or (isinstance(causal, int) and causal in (0, 1))):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    for name, x, layout in (("q", q, "[B, T, H, D]"), ("k", k, "[B, S, KV, D]"), ("v", v, "[B, S, KV, D]")):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array {layout}, got {type(x).__name__}")
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D {layout}, got shape {getattr(x, 'shape', None)}")
    # The xla core rounded an int32 result silently and promoted mixed dtypes, which the cuDNN
    # and Pallas cores refuse: one rule for all.
    if not jnp.issubdtype(q.dtype, jnp.floating) or not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one floating dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, S, KV, D], got {k.shape} and {v.shape}")
    b, t, h, d = q.shape
    kb, s, kv, kd = k.shape
    if kb != b:  # einsum would broadcast a batch-1 k/v over q's rows silently
        raise ValueError(f"k/v batch {kb} must equal q batch {b} (q {q.shape}, k {k.shape})")
    if kd != d:
        raise ValueError(f"k/v head dim {kd} must equal q head dim {d} (q {q.shape}, k {k.shape})")
    if kv < 1 or h % kv:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {kv} (GQA groups)")
    if causal and t != s:
        raise ValueError(f"causal attention needs equal q and kv lengths, got q length {t} and kv length {s}; "
                         "use causal=False for cross attention")
    if segment_ids is None:
        return
    if isinstance(segment_ids, (tuple, list)):
        # A nested list of ids ([[0, 0, 1], [0, 1, 1]] for B=2) is no pair of arrays: it was read
        # as one and named "q_segment_ids must have shape ..., got None".
        if any(not hasattr(x, "shape") for x in segment_ids):
            kinds = ", ".join(type(x).__name__ for x in segment_ids)
            raise TypeError(f"segment_ids must be None, one integer array [B, T] or a (q [B, T], kv [B, S]) pair of "
                            f"arrays, got a {type(segment_ids).__name__} of {kinds or 'nothing'}; "
                            f"wrap Python lists of ids in jnp.asarray")
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids pair must have 2 arrays (q [B, T], kv [B, S]), got {len(segment_ids)}")
        named = (("q_segment_ids", segment_ids[0], (b, t), "[B, T]"), ("kv_segment_ids", segment_ids[1], (b, s), "[B, S]"))
    elif t != s:
        raise ValueError(f"a single segment_ids array needs equal q and kv lengths, got {t} and {s}; "
                         "pass a (q_segment_ids, kv_segment_ids) pair")
    else:
        if not hasattr(segment_ids, "shape"):  # (a dict or an int was "got None" below)
            raise TypeError(f"segment_ids must be None, one integer array [B, T] or a (q [B, T], kv [B, S]) pair of "
                            f"arrays, got {type(segment_ids).__name__}")
        named = (("segment_ids", segment_ids, (b, t), "[B, T]"),)
    for name, ids, want, layout in named:
        shape = getattr(ids, "shape", None)
        if shape is None or tuple(shape) != want:
            raise ValueError(f"{name} must have shape {layout}={want}, got {shape}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name}.dtype={ids.dtype} must be an integer type (int32)")
