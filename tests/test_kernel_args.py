"""The kernels' public functions called as a user would, with arguments they cannot take: each
refuses at the call with a ValueError or TypeError naming the argument (not a crash inside
Pallas, and never a silently wrong result); and what they accept at the edges (empty or
over-long decode rows) agrees with the pure-jnp references and float64 numpy.
Interpret mode on the CPU; shapes tiny."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import attention, decode
from scaling.config import AttentionImpl
from scaling.kernels import BlockSizes, attention_reference, flash_attention
from scaling.kernels import sample as ks
from scaling.kernels.decode_attention import (
    DecodeBlockSizes,
    decode_attention,
    decode_attention_fused,
    decode_attention_grouped,
    decode_attention_reference,
)

BLOCKS = DecodeBlockSizes(block_s=16, min_programs=8)  # 2 splits of one tile for B=2, K=2


def _decode_inputs(b=2, n=4, kh=2, h=16, s=32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n, h)).astype(np.float32)
    k = rng.standard_normal((b, s, kh, h)).astype(np.float32)
    v = rng.standard_normal((b, s, kh, h)).astype(np.float32)
    return q, k, v


def _decode_f64(q, k, v, lengths):
    """float64 numpy: row b attends to positions [0, min(lengths[b], S)); no position: zeros."""
    b, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    out = np.zeros((b, n, h))
    for i in range(b):
        m = int(np.clip(lengths[i], 0, s))
        for j in range(n):
            if m == 0:
                continue
            kk, vv = k[i, :m, j // g].astype(np.float64), v[i, :m, j // g].astype(np.float64)
            logits = kk @ q[i, j].astype(np.float64) / math.sqrt(h)
            p = np.exp(logits - logits.max())
            out[i, j] = (p / p.sum()) @ vv
    return out


def test_decode_lengths_outside_the_cache_agree_with_the_reference():
    """Lengths are traced, so 0, negative or past-the-cache values cannot raise: the kernel reads
    nothing for a row of length <= 0 (zeros) and the whole cache past S. The reference averaged
    every (unwritten) cache position for an empty row instead."""
    q, k, v = _decode_inputs(b=4)
    lengths = np.array([0, -3, 5, 40], np.int32)  # S = 32
    want = _decode_f64(q, k, v, lengths)
    out = decode_attention(q, k, v, jnp.asarray(lengths), blocks=BLOCKS, interpret=True)
    ref = decode_attention_reference(q, k, v, jnp.asarray(lengths))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(ref), want, atol=2e-6, rtol=0)
    assert not np.asarray(ref)[:2].any()  # the empty rows


@pytest.mark.parametrize("lengths,error,match", [
    (np.array([5], np.int32), ValueError, r"lengths must have shape \[B\]=\(2,\) .* got \(1,\)"),  # was: row 1 read lengths[0]
    (np.array([5, 9, 7], np.int32), ValueError, r"lengths must have shape \[B\]=\(2,\) .* got \(3,\)"),  # was: extra ignored
    (np.array([[5], [9]], np.int32), ValueError, r"lengths must have shape \[B\]=\(2,\)"),
    (np.int32(5), ValueError, r"lengths must have shape \[B\]=\(2,\) .* got \(\)"),
    (np.array([5.7, 9.0], np.float32), TypeError, r"lengths\.dtype=float32 must be an integer type"),  # was: 5 vs 6 keys
])
def test_decode_lengths_of_the_wrong_shape_or_dtype_are_refused(lengths, error, match):
    q, k, v = _decode_inputs()
    with pytest.raises(error, match=match):
        decode_attention(q, k, v, jnp.asarray(lengths), blocks=BLOCKS, interpret=True)
    with pytest.raises(error, match=match):
        decode_attention_reference(q, k, v, jnp.asarray(lengths))
    q_grouped = jnp.zeros((2, 2, 16, 16), jnp.float32)
    with pytest.raises(error, match=match):
        decode_attention_grouped(q_grouped, k, v, jnp.asarray(lengths), num_heads=4, blocks=BLOCKS, interpret=True)


def test_decode_fused_position_of_the_wrong_shape_is_refused():
    _, k, v = _decode_inputs()
    qkv = jnp.zeros((2, 4 + 2 * 2, 16), jnp.float32)
    cos = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"pos must have shape \[B\]=\(2,\)"):
        decode_attention_fused(qkv, jnp.asarray([3], jnp.int32), cos, cos, jnp.asarray(k), jnp.asarray(v),
                               num_heads=4, blocks=BLOCKS, interpret=True)


@pytest.mark.parametrize("change,error,match", [
    (dict(blocks=DecodeBlockSizes(block_s=0)), ValueError, r"blocks\.block_s=0 must be a power of two >= 16"),
    (dict(blocks=DecodeBlockSizes(block_s=8)), ValueError, r"blocks\.block_s=8 must be a power of two >= 16"),
    (dict(blocks=DecodeBlockSizes(block_s=16, max_splits=0)), ValueError, r"blocks\.max_splits=0 must be an int >= 1"),
    (dict(blocks=DecodeBlockSizes(block_s=16, num_warps=3)), ValueError, r"blocks\.num_warps=3 must be a power of two"),
    (dict(blocks=(16, 8)), TypeError, r"blocks must be a DecodeBlockSizes, got tuple"),
    (dict(dtype=np.int32), TypeError, r"k\.dtype=int32 must be a floating type"),
    (dict(v_dtype=jnp.bfloat16), TypeError, r"k and v caches must have the same dtype"),
    (dict(q_rank=2), ValueError, r"q must be 3-D \[B, N, H\], got shape \(4, 16\)"),
    (dict(k_rank=3), ValueError, r"k cache must be 4-D \[B, S, K, H\]"),
])
def test_decode_bad_tiles_and_caches_are_refused(change, error, match):
    q, k, v = _decode_inputs()
    dtype = change.get("dtype")
    if dtype is not None:
        q, k, v = (x.astype(dtype) for x in (q, k, v))
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if "v_dtype" in change:
        v = v.astype(change["v_dtype"])
    if change.get("q_rank") == 2:
        q = q[0]
    if change.get("k_rank") == 3:
        k, v = k[0], v[0]
    with pytest.raises(error, match=match):
        decode_attention(q, k, v, jnp.asarray([5, 9], jnp.int32), blocks=change.get("blocks", BLOCKS), interpret=True)


# ---------------------------------------------------------------------------------------- sampler

V = 50


def _rows():
    lg = jnp.asarray(np.random.default_rng(0).normal(size=(3, V)), jnp.float32)
    keys = decode._row_keys(jax.random.key(0), jnp.arange(3, dtype=jnp.int32))
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    return lg, keys, noise


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((1.0, 1.0), dict(top_k=2.5), TypeError, r"top_k must be an int or None, got 2\.5"),  # was: ran as top_k=3
    ((1.0, 1.0), dict(top_k=True), TypeError, r"top_k must be an int or None, got True"),
    ((1.0, 1.0), dict(top_k=jnp.int32(3)), TypeError, r"top_k must be an int or None"),  # was: a Pallas error
    ((1.0, 0.0), dict(use_top_p=True), ValueError, r"top_p=0\.0 must be finite and in \(0, 1\]"),  # was: kept all
    ((1.0, 1.5), dict(use_top_p=True), ValueError, r"top_p=1\.5 must be finite and in \(0, 1\]"),
    ((1.0, float("nan")), dict(use_top_p=True), ValueError, r"top_p=nan must be finite"),
    ((0.0, 1.0), dict(), ValueError, r"temperature=0\.0 must be finite and > 0"),  # was: token 0 every row
    ((-1.0, 1.0), dict(), ValueError, r"temperature=-1\.0 must be finite and > 0"),
    ((jnp.ones(3), 1.0), dict(), ValueError, r"temperature must be a scalar .* got shape \(3,\)"),
    ((1.0, 0.5), dict(use_top_p="yes"), TypeError, r"use_top_p must be True or False"),
    ((1.0, 1.0), dict(max_candidates=-1), ValueError, r"max_candidates=-1 must be an int >= 0"),
])
def test_sampler_bad_settings_are_refused(args, kwargs, error, match):
    lg, _, noise = _rows()
    with pytest.raises(error, match=match):
        ks.sample_rows(lg, noise, *args, **kwargs)


def test_sampler_bad_logits_are_refused():
    lg, _, noise = _rows()
    with pytest.raises(ValueError, match=r"logits must be 2-D \[B, V\], got shape \(50,\)"):
        ks.sample_rows(lg[0], noise[0], 1.0, 1.0)
    with pytest.raises(ValueError, match=r"logits must be 2-D \[B, V\], got shape \(1, 3, 50\)"):
        ks.sample_rows(lg[None], noise[None], 1.0, 1.0)
    with pytest.raises(ValueError, match=r"at least one row and one token, got shape \(3, 0\)"):  # was: ZeroDivisionError
        ks.sample_rows(lg[:, :0], noise[:, :0], 1.0, 1.0)


def test_sampler_takes_numpy_top_k_and_traced_settings():
    """What the checks must let through: a NumPy int top_k (the reference's token), and traced
    temperature / top_p, whose values are only known when the kernel runs."""
    lg, keys, noise = _rows()
    want, _ = decode.sample(lg, keys, jnp.float32(1.0), jnp.float32(1.0), decode.Sampling(greedy=False, top_k=3))
    tok, _ = ks.sample_rows(lg, noise, 1.0, 1.0, top_k=np.int64(3))
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
    out = jax.eval_shape(lambda t, p: ks.sample_rows(lg, noise, t, p, top_k=3, use_top_p=True), 0.0, 0.0)
    assert out[0].shape == (3,) and out[0].dtype == jnp.int32


# ----------------------------------------------------------------------------- attention and cores


def _qkv(b=1, t=8, s=8, n=4, kh=2, d=16, kb=None):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((kb or b, s, kh, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((kb or b, s, kh, d)), jnp.float32)
    return q, k, v


CORE_CASES = [
    # (q, k, v) changes, call kwargs, error, match
    pytest.param(dict(t=8, s=12), dict(causal=True), ValueError, r"causal attention needs equal q and kv lengths",
                 id="causal-t-ne-s"),  # was: the xla core aligned the diagonal bottom-right, cuDNN top-left
    pytest.param(dict(b=2, kb=1), dict(), ValueError, r"k/v batch 1 must equal q batch 2",
                 id="kv-batch-1-broadcast"),  # was: K/V of row 0 silently used for every row
    pytest.param(dict(n=3), dict(), ValueError, r"query heads 3 must be a multiple of KV heads 2", id="gqa-3-on-2"),
    pytest.param(dict(), dict(segment_ids=jnp.zeros((1, 7), jnp.int32)), ValueError,
                 r"segment_ids must have shape \[B, T\]=\(1, 8\)", id="segments-short"),
    pytest.param(dict(), dict(segment_ids=jnp.zeros((1, 8), jnp.float32)), TypeError,
                 r"segment_ids\.dtype=float32 must be an integer", id="segments-float"),  # was: accepted
    pytest.param(dict(), dict(segment_ids=jnp.zeros((8,), jnp.int32)), ValueError,
                 r"segment_ids must have shape \[B, T\]=\(1, 8\)", id="segments-1d"),
]


@pytest.mark.parametrize("shape,kwargs,error,match", CORE_CASES)
def test_cores_refuse_what_no_core_takes(shape, kwargs, error, match):
    q, k, v = _qkv(**shape)
    for impl in (AttentionImpl.xla, AttentionImpl.pallas, AttentionImpl.auto):
        with pytest.raises(error, match=match):
            attention.attention_core(impl)(q, k, v, **{"causal": False, **kwargs})


def test_cores_refuse_wrong_ranks_and_names():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must be 4-D \[B, T, H, D\], got shape \(8, 4, 16\)"):
        attention.xla_attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        attention.xla_attention(q, k, v[:, :4])
    with pytest.raises(ValueError, match=r"attention impl 'flash' must be one of"):  # was: KeyError
        attention.attention_core("flash")
    with pytest.raises(ValueError, match=r"bwd_workspace_mb must be None or an int >= 0, got -1"):
        attention.attention_core(AttentionImpl.pallas, bwd_workspace_mb=-1)


def test_xla_core_still_matches_the_reference():
    """The checks refuse nothing the model runs: GQA, causal and packed segments as before."""
    q, k, v = _qkv(b=2, t=12, s=12, n=6, kh=2)
    seg = jnp.asarray(np.repeat([[0, 1, 2]], 4, axis=1).repeat(2, axis=0), jnp.int32)
    for causal, s_ids in ((True, None), (True, seg), (False, (seg, seg[:, ::-1]))):
        got = attention.xla_attention(q, k, v, causal=causal, segment_ids=s_ids)
        want = attention_reference(q, k, v, causal=causal, segment_ids=s_ids)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)


@pytest.mark.parametrize("shape,kwargs,error,match", [
    (dict(b=2, kb=1), dict(causal=False), ValueError, r"k/v batch 1 must equal q batch 2"),  # was: broadcast
    (dict(), dict(causal=False, v_len=4), ValueError, r"k and v must have the same shape"),
    (dict(), dict(causal=False, q_rank=3), ValueError, r"q must be 4-D \[B, T, H, D\]"),
    (dict(), dict(causal=False, segment_ids=jnp.zeros((8,), jnp.int32)), ValueError,
     r"segment_ids must have shape \[B, T\]=\(1, 8\)"),
    (dict(), dict(causal=False, segment_ids=(jnp.zeros((1, 8), jnp.int32),) * 3), ValueError,
     r"segment_ids pair must have 2 arrays"),
])
def test_reference_refuses_what_the_kernels_refuse(shape, kwargs, error, match):
    q, k, v = _qkv(**shape)
    if kwargs.pop("v_len", None):
        v = v[:, :4]
    if kwargs.pop("q_rank", None):
        q = q[0]
    with pytest.raises(error, match=match):
        attention_reference(q, k, v, **kwargs)


def test_flash_attention_refuses_a_causal_flag_that_is_not_a_bool():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"causal must be True or False, got 'no'"):  # was: ran causal
        flash_attention(q, k, v, causal="no", interpret=True)


def test_flash_attention_refuses_an_interpret_flag_that_is_not_a_bool():
    """`interpret="no"` is truthy: it had run interpret mode (on a GPU, slowly) without a word."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"interpret must be True or False, got 'no'"):
        flash_attention(q, k, v, causal=True, interpret="no")


def test_flash_attention_refuses_more_warps_than_a_cuda_block_holds():
    """num_warps 64 (2,048 threads) passed the check, whose message said 1..16."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"block_sizes.num_warps_fwd=64 must be a power of two in 1..32"):
        flash_attention(q, k, v, causal=True, interpret=True, block_sizes=BlockSizes(num_warps_fwd=64))
