"""The model's Python API at its edges: what `model(tokens, positions, segment_ids)` accepts and
refuses, configs built in Python (they skip load_config's validation), the attention dispatch
where cuDNN cannot take a call, and the forward against an independent float64 numpy Llama
with Llama 3 RoPE scaling, packed segments, GQA and either head."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_reference import meta_llama3_inv_freq  # noqa: E402
from test_layers_reference import numpy_llama  # noqa: E402
from scaling import attention
from scaling.config import AttentionConfig, AttentionImpl, ConfigError, DType, ModelConfig, load_config
from scaling.model import build_model

V = 64


def small(**kw) -> ModelConfig:
    base = dict(vocab_size=V, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=48,
                max_seq_len=16, compute_dtype=DType.float32)
    return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model():
    return build_model(small(), seed=0)


def ids(b=2, t=5, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (b, t)), jnp.int32)


# ------------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("tokens,error,message", [
    # was: "indices must have an integer type" from inside jnp.take
    (jnp.ones((2, 5), jnp.float32), TypeError, r"tokens_bt\.dtype=float32 must be an integer type"),
    # was: ran, as ids 0 and 1 (a mask passed for the tokens)
    (jnp.ones((2, 5), bool), TypeError, r"tokens_bt\.dtype=bool must be an integer type"),
    # were: "not enough values to unpack" / "too many values to unpack"
    (jnp.ones((5,), jnp.int32), ValueError, r"tokens_bt must be 2-D \[B, T\], got shape \(5,\)"),
    (jnp.ones((1, 2, 5), jnp.int32), ValueError, r"tokens_bt must be 2-D \[B, T\], got shape \(1, 2, 5\)"),
    # were: NaN logits (>= V) and the last row of the table (-1), without a word
    (jnp.asarray([[1, 2, V]]), ValueError, r"tokens_bt: ids must be in \[0, model\.vocab_size=64\), got min 1, max 64"),
    (jnp.asarray([[-1, 2, 3]]), ValueError, r"tokens_bt: ids must be in \[0, model\.vocab_size=64\), got min -1, max 3"),
], ids=["float", "bool", "rank-1", "rank-3", "id-V", "id-negative"])
def test_bad_tokens_are_refused_naming_the_argument(model, tokens, error, message):
    with pytest.raises(error, match=message):
        model(tokens)


def test_other_integer_arrays_and_lists_give_the_int32_logits(model):
    x = ids()
    want = np.asarray(model(x))
    for other in (np.asarray(x, np.int64), np.asarray(x, np.uint8), np.asarray(x).tolist()):
        np.testing.assert_array_equal(np.asarray(model(other)), want)


def test_under_jit_an_id_out_of_range_gives_nan_logits_in_its_row(model):
    """Traced ids cannot be checked: an id < 0 or >= V gives NaN logits in its row (documented in
    __call__; masked attention's P.V product spreads its NaN values to the whole row), never
    another token's row; the other rows are the clean run's."""
    x = ids(2, 6)
    clean = np.asarray(model(x))
    run = jax.jit(lambda t: model(t))
    for bad in (-1, -V, V, V + 7):
        got = np.asarray(run(x.at[0, 3].set(bad)))
        assert np.isnan(got[0]).all(), bad
        np.testing.assert_allclose(got[1], clean[1], rtol=1e-6, atol=1e-6)


def test_under_jit_a_negative_narrow_id_gives_nan_when_v_does_not_fit_its_dtype():
    """int8 id -1 with V = 512: sent past V in int8, 512 would wrap to row 0."""
    m = build_model(small(vocab_size=512), seed=0)
    got = np.asarray(jax.jit(lambda t: m(t))(jnp.asarray([[1, -1, 3], [1, 2, 3]], jnp.int8)))
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


def test_float_positions_are_refused(model):
    with pytest.raises(TypeError, match=r"positions_bt\.dtype=float32 must be an integer type"):
        model(ids(), jnp.zeros((2, 5), jnp.float32))
    shared = [list(range(5))]  # a [1, T] list: every row's positions
    np.testing.assert_array_equal(np.asarray(model(ids(), shared)), np.asarray(model(ids())))


def test_rows_longer_than_max_seq_len_run(model):
    """Documented: RoPE has no table, so T > max_seq_len runs (the decoder runs past it too)."""
    assert model(ids(1, 20)).shape == (1, 20, V)


# --------------------------------------------------------------- configs built in Python


@pytest.mark.parametrize("overrides,message", [
    # were: ZeroDivisionError at the first call
    (dict(num_heads=0), r"model\.num_heads: must be a positive integer, got 0"),
    (dict(num_layers=0), r"model\.num_layers: must be a positive integer, got 0"),
    # was: "query heads 4 must be a multiple of KV heads 3 (GQA groups)" at the first call
    (dict(num_kv_heads=3), r"model\.num_heads: 4 heads is not divisible by model\.num_kv_heads=3"),
    # was: IndexError from jnp.take
    (dict(vocab_size=0), r"model\.vocab_size: must be a positive integer, got 0"),
    # were: built, with bfloat16 master weights on a GPU (auto) or a KeyError (a jnp type)
    (dict(param_dtype=DType.auto), r"model\.param_dtype: must be float32, bfloat16 or float16 \(not auto\)"),
    (dict(compute_dtype=jnp.bfloat16), r"model\.compute_dtype: .* is not allowed; allowed values: float32, bfloat16, float16, auto"),
    # was: a TypeError from jax.random.normal's shape
    (dict(hidden_size=32.0), r"model\.hidden_size: must be an integer, got 32\.0"),
], ids=["heads-0", "layers-0", "kv-3", "vocab-0", "param-auto", "jnp-dtype", "float-size"])
def test_a_config_built_in_python_is_checked_when_the_model_is_built(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_model(small(**overrides))


def test_an_attention_config_built_in_python_is_checked_when_the_model_is_built():
    with pytest.raises(ConfigError, match=r"attention\.impl: 'flash' is not allowed; allowed values: xla, cudnn, pallas, auto"):
        build_model(small(), attention=AttentionConfig(impl="flash"))
    with pytest.raises(ConfigError, match=r"attention\.bwd_workspace_mb: must be an int >= 0"):
        build_model(small(), attention=AttentionConfig(bwd_workspace_mb=-1))


def test_load_config_and_the_model_give_the_same_words():
    """One set of checks: the file path and the Python path name the same key the same way."""
    for override, kw in (("--model.num_kv_heads=3", dict(num_kv_heads=3)),
                         ("--model.head_dim=7", dict(head_dim=7))):
        with pytest.raises(ConfigError) as from_file:
            load_config(None, [override, "--model.num_heads=4"])
        with pytest.raises(ConfigError) as from_python:
            build_model(small(**kw))
        assert str(from_file.value) == str(from_python.value)


# --------------------------------------------------------------------- attention dispatch


def _gpu(monkeypatch, hopper: bool):
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(importlib.import_module("scaling.kernels.flash_attention"), "is_hopper", lambda: hopper)


def _qkv(dtype, d, t=16):
    return jnp.zeros((1, t, 4, d), dtype), jnp.zeros((1, t, 2, d), dtype), jnp.zeros((1, t, 2, d), dtype)


@pytest.mark.parametrize("dtype,d,message", [
    (jnp.float32, 64, r"q/k/v dtype is float32 \(model\.compute_dtype\); cuDNN takes bfloat16 or float16"),
    (jnp.bfloat16, 12, r"head dim is 12 \(model\.head_dim\); cuDNN takes multiples of 8 up to 128"),
    (jnp.bfloat16, 192, r"head dim is 192 \(model\.head_dim\); cuDNN takes multiples of 8 up to 128"),
], ids=["float32", "head-dim-12", "head-dim-192"])
def test_cudnn_refuses_what_it_cannot_run_naming_the_field(monkeypatch, dtype, d, message):
    """Was: NotImplementedError from inside jax's cuDNN wrapper (jax's check_is_flash_attention)."""
    _gpu(monkeypatch, hopper=False)
    with pytest.raises(ValueError, match=r"attention\.impl=cudnn cannot run this call: " + message):
        attention.attention_core(AttentionImpl.cudnn)(*_qkv(dtype, d), causal=True)


@pytest.mark.parametrize("hopper,dtype,d,t,want", [
    (False, jnp.bfloat16, 64, 16, AttentionImpl.cudnn),
    (False, jnp.float32, 64, 16, AttentionImpl.xla),  # was cuDNN, which refuses float32
    (False, jnp.bfloat16, 12, 16, AttentionImpl.xla),  # was cuDNN, which refuses D=12
    (True, jnp.bfloat16, 192, 16, AttentionImpl.cudnn),  # Hopper's cuDNN takes up to 256
    (True, jnp.float32, 64, 16, AttentionImpl.pallas),  # ours take float32 (Triton)
    (True, jnp.float32, 64, 8192 + 8, AttentionImpl.xla),  # was cuDNN beyond our length
    (True, jnp.bfloat16, 64, 8192 + 8, AttentionImpl.cudnn),
])
def test_auto_does_not_pick_cudnn_for_calls_it_cannot_run(monkeypatch, hopper, dtype, d, t, want):
    _gpu(monkeypatch, hopper)
    assert attention.resolve_impl(AttentionImpl.auto, seq_len=t, head_dim=d, dtype=dtype) == want
    seen = []
    monkeypatch.setattr(attention, "ATTENTION_CORES", {
        i: (lambda q, k, v, *, causal, segment_ids, i=i, **kw: seen.append(i) or q) for i in attention.ATTENTION_CORES})
    attention.attention_core(AttentionImpl.auto)(*_qkv(dtype, d, t=t), causal=True)
    assert seen == [want]


# ------------------------------------------------------------------- against numpy


@pytest.mark.parametrize("tie", [True, False])
def test_packed_rows_with_llama3_rope_match_float64_numpy(tie):
    """GQA (6 query heads over 2 KV heads), Llama 3 RoPE scaling with all three bands in use,
    two documents packed in each row (segment ids, positions restarting at each), at positions
    past original_max_len / high so the scaled frequencies matter, and the tied or untied head."""
    theta, hd, factor, low, high, orig = 10000.0, 16, 8.0, 1.0, 4.0, 64
    cfg = small(hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=hd, rope_theta=theta,
                rope_scaling_factor=factor, rope_low_freq_factor=low, rope_high_freq_factor=high,
                rope_original_max_len=orig, norm_eps=0.1, tie_embeddings=tie, max_seq_len=512)
    inv_freq, bands = meta_llama3_inv_freq(theta, hd, factor, low, high, orig)
    assert {"kept", "divided", "blended"} <= set(bands)
    model = build_model(cfg, seed=3)
    rng = np.random.default_rng(1)
    state = nnx.state(model, nnx.Param)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64) * 8.0, nnx.to_pure_dict(state))  # non-uniform attention
    for scale in (p["blocks"]["attn_norm"], p["blocks"]["mlp_norm"], p["final_norm"]):
        scale["scale"] = rng.normal(1.0, 0.3, scale["scale"].shape)
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), p)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, p))
    nnx.update(model, state)

    t = 10
    tokens = rng.integers(0, V, (2, t))
    segments = np.array([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    starts = np.array([[100, 300], [37, 450]])  # each document's first position
    positions = np.stack([np.where(seg == 0, start[0] + np.arange(t), start[1] + np.arange(t) - np.argmax(seg))
                          for seg, start in zip(segments, starts)])
    got = np.asarray(model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                           jnp.asarray(segments, jnp.int32)))
    want = numpy_llama(jax.tree.map(lambda a: a.astype(np.float64), p), tokens, positions, cfg, segments_bt=segments,
                       inv_freq=inv_freq)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # The segments are separate: the second document's logits do not depend on the first's tokens.
    other = tokens.copy()
    other[0, :4] = (other[0, :4] + 1) % V
    moved = np.asarray(model(jnp.asarray(other, jnp.int32), jnp.asarray(positions, jnp.int32),
                             jnp.asarray(segments, jnp.int32)))
    np.testing.assert_allclose(moved[0, 4:], got[0, 4:], rtol=1e-5, atol=1e-5)
    assert not np.allclose(moved[0, :4], got[0, :4])
