"""The attention API used as a demanding user would (interpret mode on the CPU, tiny shapes):
calls that used to crash inside the kernels or run silently wrong, each against an independent
reference (float64 numpy, or the pure-jnp reference evaluated in float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import attention
from scaling.config import AttentionImpl
from scaling.kernels import BlockSizes, attention_reference, flash_attention

CORES = (AttentionImpl.xla, AttentionImpl.pallas, AttentionImpl.auto)


def _qkv(b=1, t=8, s=8, h=4, kv=2, d=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((b, t, h, d), (b, s, kv, d), (b, s, kv, d)))


def _numpy_attention(q, k, v, *, causal, q_seg=None, kv_seg=None):
    """float64 numpy: softmax(q kᵀ / sqrt(D) + mask) v; rows that see no key give 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    k = np.repeat(k, h // kv, axis=2)  # query head i reads KV head i // (H // KV)
    v = np.repeat(v, h // kv, axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
    mask = np.ones((b, 1, t, s), bool)
    if causal:
        mask &= np.tril(np.ones((t, s), bool))
    if q_seg is not None:
        mask &= (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])[:, None]
    logits = np.where(mask, logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.where(mask, np.exp(logits - np.where(np.isfinite(m), m, 0)), 0)
    p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhts,bshd->bthd", p, v)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("impl", CORES)
def test_every_core_takes_a_list_segment_id_pair(impl):
    """check_attention_args, the reference and the kernels take a [q_ids, kv_ids] list; the xla
    core (so `auto` on a CPU, and cuDNN) indexed the list as if it were one array (TypeError)."""
    q, k, v = _qkv(t=8, s=12)
    q_ids = jnp.asarray([[0, 0, 1, 1, 1, 2, 2, 5]], jnp.int32)  # id 5: a query that sees no key
    kv_ids = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]], jnp.int32)
    got = attention.attention_core(impl)(q, k, v, causal=False, segment_ids=[q_ids, kv_ids])
    want = _numpy_attention(q, k, v, causal=False, q_seg=q_ids, kv_seg=kv_ids)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_runs_under_x64(causal):
    """With jax_enable_x64 every causal call failed while tracing its loop bounds (lax.div of an
    int32 index by a Python int, which x64 makes int64). Forward and gradients against the
    reference in float64 (and the forward against float64 numpy)."""
    with jax.enable_x64(True):
        q, k, v = _qkv(b=2, t=21, s=21, h=6, kv=2, d=40)  # ragged length, GQA 3, head dim padded
        do = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v)
        grads = vjp(do)
        f64 = lambda x: x.astype(jnp.float64)
        ref_out, ref_vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=causal), f64(q), f64(k), f64(v))
        ref_grads = ref_vjp(f64(do))
        assert ref_out.dtype == jnp.float64 and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(ref_out), _numpy_attention(q, k, v, causal=causal), atol=1e-12, rtol=0)
        for name, x, r in (("out", out, ref_out), *zip(("dq", "dk", "dv"), grads, ref_grads)):
            assert _rel(x, r) < 2e-5, name


@pytest.mark.parametrize("b,t,s,h,kv,d,causal,dtype,tol", [
    pytest.param(1, 1, 1, 2, 1, 8, True, jnp.float32, 2e-5, id="t1-d8-causal"),
    pytest.param(1, 3, 17, 4, 4, 72, False, jnp.float32, 2e-5, id="tq-lt-tk-d72"),
    pytest.param(2, 19, 5, 6, 2, 40, False, jnp.bfloat16, 1.5e-2, id="tq-gt-tk-gqa3-d40-bf16"),
    pytest.param(1, 37, 37, 12, 4, 8, True, jnp.float16, 2e-3, id="gqa3-d8-f16"),
])
def test_odd_shapes_match_float64_numpy(b, t, s, h, kv, d, causal, dtype, tol):
    """Shapes off every tile: T = 1, lengths that are not multiples of 16, Tq != Tk both ways,
    head dims 8/40/72, an odd GQA ratio; output in the input dtype, against float64 numpy."""
    q, k, v = _qkv(b=b, t=t, s=s, h=h, kv=kv, d=d, dtype=dtype, seed=t + s)
    out = flash_attention(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel(out.astype(jnp.float32), _numpy_attention(q, k, v, causal=causal)) < tol


@pytest.mark.parametrize("shape,match", [
    (dict(b=0), r"batch and head counts must be >= 1, got batch b=0"),  # was: a Pallas slice error
    (dict(h=0), r"batch and head counts must be >= 1, got batch b=1, q heads h=0"),  # was: ZeroDivisionError
    (dict(kv=0), r"must be a multiple of k/v heads kv=0 >= 1"),  # was: ZeroDivisionError
])
def test_flash_attention_refuses_empty_batch_or_heads(shape, match):
    q, k, v = _qkv(**shape)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, causal=True)


@pytest.mark.parametrize("impl", CORES)
def test_cores_refuse_integer_and_mixed_dtypes(impl):
    """The xla core (so `auto` on a CPU) returned int32 q's attention rounded to integers and
    promoted mixed dtypes, where the Pallas and cuDNN cores refuse both."""
    q, k, v = _qkv()
    core = attention.attention_core(impl)
    ints = tuple(x.astype(jnp.int32) for x in (q, k, v))
    with pytest.raises(TypeError, match=r"q, k and v must share one floating dtype, got int32, int32 and int32"):
        core(*ints, causal=True)
    with pytest.raises(TypeError, match=r"must share one floating dtype, got bfloat16, float32 and float32"):
        core(q.astype(jnp.bfloat16), k, v, causal=True)


@pytest.mark.parametrize("impl", CORES)
@pytest.mark.parametrize("causal", [None, "no"])
def test_cores_refuse_a_causal_flag_that_is_not_a_bool(impl, causal):
    """The xla core read causal=None as False and causal="no" as True, silently."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"causal must be True or False, got"):
        attention.attention_core(impl)(q, k, v, causal=causal)


def test_non_array_inputs_are_named():
    """A nested list read "q must be 4-D ..., got shape None"."""
    q, k, v = _qkv()
    as_list = np.asarray(q).tolist()
    with pytest.raises(TypeError, match=r"q must be an array \[B, T, H, D\], got list"):
        attention.xla_attention(as_list, k, v)
    with pytest.raises(TypeError, match=r"q must be an array \[B, T, H, D\], got list"):
        attention_reference(as_list, k, v)


def test_numpy_ints_in_block_sizes_are_named():
    """block_q=np.int64(32) (a sweep over np.arange) read "block_q=32 must be a power of two"."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"block_sizes\.block_q=np\.int64\(32\) must be a Python int, got int64"):
        flash_attention(q, k, v, block_sizes=BlockSizes(block_q=np.int64(32)))
    with pytest.raises(TypeError, match=r"block_sizes\.num_stages_fwd=2\.0 must be a Python int, got float"):
        flash_attention(q, k, v, block_sizes=BlockSizes(num_stages_fwd=2.0))


def test_bools_are_not_numbers_for_scale_or_workspace():
    """sm_scale=True ran as scale 1.0 and bwd_workspace_bytes=True as a 1-byte budget."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"sm_scale must be a finite Python number > 0 or None, got True"):
        flash_attention(q, k, v, sm_scale=True)
    with pytest.raises(ValueError, match=r"bwd_workspace_bytes must be None or an int >= 0 .*got True"):
        flash_attention(q, k, v, bwd_workspace_bytes=True)
