"""The model's layers, the attention dispatch and the remat policies, checked where mutation testing
found the existing tests blind (a mutant of the code passed all of them). Each reference is
independent of the code: float64 numpy written from the published definition, or what the config
and docstrings promise.

- Llama 3 RoPE scaling with low_freq_factor != 1: every test before used Meta's published values
  (low 1, high 4), under which `original_len / low` and `original_len * low` agree.
- The model's default positions (0..T-1), the auto compute dtype, f32 logits and RMSNorm in f32
  under bf16 compute, the output-head weight handed to the chunked loss, a model built with
  attention.impl=xla (the default bwd_workspace_mb must not reach the xla core).
- Bad input a ModelConfig built in Python let through (odd head dims, Llama 3 factors with
  low >= high) and positions of the wrong shape ([B, 1] broadcast silently).
- The attention core on calls the model does not make (cross attention, non-causal, rows with no
  visible key) and the dispatch's choices and errors for them.
- Which checkpoint_name tags each remat policy keeps; host-offload support per device.
"""

from __future__ import annotations

import importlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_reference import meta_llama3_inv_freq  # noqa: E402

from scaling import attention, layers
from scaling.attention import AUTO_PALLAS_MAX_LEN, attention_core
from scaling.config import AttentionConfig, AttentionImpl, DType, ModelConfig
from scaling.model import build_model, resolve_dtype


def small(**overrides) -> ModelConfig:
    fields = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
                  compute_dtype=DType.float32)
    return ModelConfig(**{**fields, **overrides})


def tokens(b, t, vocab, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


# ------------------------------------------------------------------------- Llama 3 RoPE scaling


@pytest.mark.parametrize("theta,head_dim,factor,low,high,original_len", [
    (10000.0, 128, 8.0, 2.0, 8.0, 4096),  # low != 1: original_len / low is not original_len * low
    (500000.0, 64, 16.0, 1.5, 6.0, 2048),
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B's published rope_scaling
])
def test_llama3_rope_frequencies_match_metas_formula(theta, head_dim, factor, low, high, original_len):
    cfg = small(hidden_size=head_dim, num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta,
                rope_scaling_factor=factor, rope_low_freq_factor=low, rope_high_freq_factor=high,
                rope_original_max_len=original_len)
    want, bands = meta_llama3_inv_freq(theta, head_dim, factor, low, high, original_len)
    assert all(bands.count(b) >= 2 for b in ("kept", "divided", "blended")), bands  # each branch is exercised
    np.testing.assert_allclose(np.asarray(layers.rope_frequencies(cfg), np.float64), want, rtol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    # was: "array split does not result in an equal division" from inside apply_rope
    (dict(head_dim=7), r"model\.head_dim: RoPE rotates pairs of dimensions and needs an even head_dim >= 2, got 7$"),
    (dict(head_dim=None, hidden_size=30), r"got 7 \(model\.hidden_size=30 // model\.num_heads=4; set model\.head_dim\)"),
    # were accepted: low == high (an empty blend, a step Meta's formula asserts against), low > high,
    # a factor below 1 (frequencies multiplied, not divided)
    (dict(rope_scaling_factor=8.0, rope_low_freq_factor=2.0, rope_high_freq_factor=2.0),
     r"model\.rope_low_freq_factor/rope_high_freq_factor: need 0 < low < high with rope scaling on, got 2\.0, 2\.0"),
    (dict(rope_scaling_factor=8.0, rope_low_freq_factor=4.0, rope_high_freq_factor=1.0), r"need 0 < low < high"),
    (dict(rope_scaling_factor=0.5), r"model\.rope_scaling_factor: must be 0 \(off\) or a finite factor >= 1, got 0\.5"),
    (dict(rope_scaling_factor=8.0, rope_original_max_len=0), r"model\.rope_original_max_len: must be positive"),
], ids=["odd-head-dim", "odd-derived-head-dim", "low-equals-high", "low-above-high", "factor-below-1", "original-len-0"])
def test_rope_settings_of_a_config_built_in_python_are_checked(overrides, message):
    """A ModelConfig built in Python skips the config file's validation; RoPE checks what it needs."""
    from scaling.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_model(small(**overrides))(tokens(1, 4, 64))


@pytest.mark.parametrize("shape", [(7,), (2, 1), (3, 7)])
def test_positions_must_be_b_by_t(shape):
    """positions_bt is [B, T] (or [1, T], shared by the rows). A [B, 1] array broadcast silently: every
    token at the same position, no positional signal at all."""
    model = build_model(small(), seed=0)
    with pytest.raises(ValueError, match=r"positions_bt must have shape \[B, T\]=\(2, 7\) \(or \[1, T\]\), got " + re.escape(str(shape))):
        model(tokens(2, 7, 64), jnp.zeros(shape, jnp.int32))
    shared = jnp.arange(7, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(model(tokens(2, 7, 64), shared)), np.asarray(model(tokens(2, 7, 64))))


def test_model_default_positions_are_0_to_t_minus_1():
    """positions_bt=None means 0..T-1 for every row: the same program as passing them (bit for bit).
    (An offset would only change rounding, RoPE being relative, but the decoder's cache positions
    count from 0.)"""
    model = build_model(small(), seed=0)
    x = tokens(2, 7, 64)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(model(x, positions)))
    # An offset changes the rounding, so the bit-for-bit comparison above can see one.
    assert not np.array_equal(np.asarray(model(x)), np.asarray(model(x, positions + 1)))


@pytest.mark.parametrize("tie", [False, True])
def test_head_weight_and_its_layout_give_the_logits(tie):
    """head_weight() returns (w, "dv") with logits = x w, or tied (E, "vd") with logits = x E^T:
    recomputed in float64 numpy from the returned array and the layout it names."""
    model = build_model(small(tie_embeddings=tie), seed=1)
    x = jax.random.normal(jax.random.key(0), (2, 3, 32), jnp.float32)
    w, layout = model.head_weight()
    w64, x64 = np.asarray(w, np.float64), np.asarray(x, np.float64)
    assert layout == ("vd" if tie else "dv") and w.shape == ((64, 32) if tie else (32, 64))
    want = x64 @ (w64.T if layout == "vd" else w64)
    np.testing.assert_allclose(np.asarray(model.logits(x)), want, rtol=1e-5, atol=1e-6)


def test_auto_compute_dtype_is_float32_on_cpu_and_bfloat16_on_accelerators(monkeypatch):
    """config.DType.auto: "bfloat16 on GPU/TPU, float32 on CPU"."""
    assert resolve_dtype(DType.auto) == jnp.float32
    assert build_model(small(compute_dtype=DType.auto)).hidden_states(tokens(1, 4, 64)).dtype == jnp.float32
    for backend in ("gpu", "tpu"):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert resolve_dtype(DType.auto) == jnp.bfloat16, backend
    assert resolve_dtype(DType.float16) == jnp.float16


def test_rmsnorm_of_bfloat16_is_computed_in_float32():
    """RMSNorm "computed in f32": on bf16 input the output is the float64 result rounded once to
    bf16 (measured: every element). Computed in bf16, about half the elements are an ulp off."""
    norm = layers.RMSNorm(256, eps=1e-5, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    scale = rng.normal(1.0, 0.3, 256)
    norm.scale[...] = jnp.asarray(scale, jnp.float32)
    x = jnp.asarray(rng.normal(0.0, 3.0, (4, 8, 256)), jnp.bfloat16)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + 1e-5) * np.asarray(norm.scale[...], np.float64)
    got = norm(x)
    assert got.dtype == jnp.bfloat16
    rounded_once = np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
    assert np.mean(np.asarray(got.astype(jnp.float32)) == rounded_once) > 0.99


@pytest.mark.parametrize("tie", [False, True])
def test_bfloat16_model_logits_are_float32(tie):
    """The output head accumulates in f32 and returns f32 logits, tied to the embedding or not."""
    model = build_model(small(tie_embeddings=tie, compute_dtype=DType.bfloat16), seed=0)
    assert model(tokens(1, 4, 64)).dtype == jnp.float32


def test_model_with_the_xla_core_runs_with_the_default_workspace():
    """attention.impl=xla with AttentionConfig's default bwd_workspace_mb (4096): the budget is for
    our kernels' backward and must not reach the xla core (which takes no such argument)."""
    cfg = small()
    x = tokens(2, 6, 64)
    want = build_model(cfg, attention=AttentionConfig(impl=AttentionImpl.auto), seed=2)(x)  # xla on the CPU
    got = build_model(cfg, attention=AttentionConfig(impl=AttentionImpl.xla), seed=2)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------------------- the xla core


def numpy_attention(q, k, v, *, causal, q_seg=None, kv_seg=None):
    """softmax(q k^T / sqrt(H)) v in float64, query head h reading KV head h // (N/K); a row that
    sees no key gives 0."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    out = np.zeros((b, t, n, h))
    for bi in range(b):
        for head in range(n):
            g = head // (n // kh)
            scores = q[bi, :, head] @ k[bi, :, g].T / math.sqrt(h)
            visible = np.tril(np.ones((t, s), bool)) if causal else np.ones((t, s), bool)
            if q_seg is not None:
                visible &= q_seg[bi][:, None] == kv_seg[bi][None, :]
            for ti in range(t):
                if visible[ti].any():
                    e = np.exp(np.where(visible[ti], scores[ti] - scores[ti][visible[ti]].max(), -np.inf))
                    out[bi, ti, head] = e / e.sum() @ v[bi, :, g]
    return out


def _qkv(b, t, s, n, kh, h, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, t, n, h)), rng.normal(size=(b, s, kh, h)), rng.normal(size=(b, s, kh, h))


def test_xla_core_non_causal_cross_attention_against_numpy():
    q, k, v = _qkv(2, 3, 7, 4, 2, 8)
    got = attention.xla_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), causal=False)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, causal=False), rtol=1e-5, atol=1e-5)


def test_xla_core_row_without_a_visible_key_is_zero():
    """With a (q, kv) pair of segment ids a query may see no key at all: its output is 0, not the
    uniform average of every value (the docstring's promise)."""
    q, k, v = _qkv(1, 4, 4, 2, 1, 8, seed=1)
    q_seg = np.array([[0, 0, 5, 1]])  # query 2's segment is in no key
    kv_seg = np.array([[0, 0, 1, 1]])
    got = np.asarray(attention.xla_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), causal=True,
                                             segment_ids=(jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32))))
    np.testing.assert_array_equal(got[0, 2], 0.0)
    want = numpy_attention(q, k, v, causal=True, q_seg=q_seg, kv_seg=kv_seg)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- the dispatch


@pytest.fixture
def recorded(monkeypatch):
    """The cores replaced by recorders of (impl, keyword arguments other than causal/segment_ids);
    each returns zeros."""
    calls = []

    def recorder(impl):
        def core(q, k, v, *, causal=True, segment_ids=None, **kw):
            calls.append((impl, kw))
            return jnp.zeros_like(q)
        return core

    monkeypatch.setattr(attention, "ATTENTION_CORES", {i: recorder(i) for i in attention.ATTENTION_CORES})
    return calls


def on_hopper(monkeypatch):
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(importlib.import_module("scaling.kernels.flash_attention"), "is_hopper", lambda: True)


def _shapes(t, s, d=64, n=2, kh=1):  # bf16: a call cuDNN can take (auto leaves f32 to xla)
    return jnp.zeros((1, t, n, d), jnp.bfloat16), jnp.zeros((1, s, kh, d), jnp.bfloat16), jnp.zeros((1, s, kh, d), jnp.bfloat16)


def test_auto_reads_the_longer_of_the_query_and_key_rows(monkeypatch, recorded):
    """AUTO_PALLAS_MAX_LEN bounds the rows, query or key (resolve_impl's docstring): a short query
    over long keys is a long call."""
    on_hopper(monkeypatch)
    core = attention_core(AttentionImpl.auto)
    limit = AUTO_PALLAS_MAX_LEN[64]
    core(*_shapes(16, limit + 16), causal=False)
    core(*_shapes(16, limit), causal=False)
    assert [impl for impl, _ in recorded] == [AttentionImpl.cudnn, AttentionImpl.pallas]


def test_the_workspace_budget_goes_to_our_kernels_only(monkeypatch, recorded):
    """bwd_workspace_mb reaches the pallas core (chosen explicitly or by auto) and no other core."""
    on_hopper(monkeypatch)
    q, k, v = _shapes(32, 32)
    attention_core(AttentionImpl.auto, bwd_workspace_mb=64)(q, k, v, causal=True)
    attention_core(AttentionImpl.auto, bwd_workspace_mb=64)(*_shapes(32, 32, d=32), causal=True)  # D=32: cuDNN
    attention_core(AttentionImpl.pallas, bwd_workspace_mb=0)(q, k, v, causal=True)
    attention_core(AttentionImpl.cudnn, bwd_workspace_mb=64)(q, k, v, causal=True)
    attention_core(AttentionImpl.xla, bwd_workspace_mb=64)(q, k, v, causal=True)
    attention_core(AttentionImpl.auto)(q, k, v, causal=True)
    assert recorded == [(AttentionImpl.pallas, {"bwd_workspace_mb": 64}), (AttentionImpl.cudnn, {}),
                        (AttentionImpl.pallas, {"bwd_workspace_mb": 0}), (AttentionImpl.cudnn, {}),
                        (AttentionImpl.xla, {}), (AttentionImpl.pallas, {})]


@pytest.mark.parametrize("impl,budget,message", [
    ("bogus", None, r"attention impl 'bogus' must be one of \['xla', 'cudnn', 'pallas', 'auto'\]"),
    (AttentionImpl.pallas, -1, r"attention\.bwd_workspace_mb must be None or an int >= 0, got -1"),
    (AttentionImpl.pallas, True, r"attention\.bwd_workspace_mb must be None or an int >= 0, got True"),
    (AttentionImpl.auto, 2.5, r"attention\.bwd_workspace_mb must be None or an int >= 0, got 2\.5"),
], ids=["unknown-impl", "negative-budget", "bool-budget", "float-budget"])
def test_bad_core_arguments_name_the_field(impl, budget, message):
    with pytest.raises(ValueError, match=message):
        attention_core(impl, bwd_workspace_mb=budget)


def test_a_zero_workspace_is_allowed():
    """0 MiB is documented (AttentionConfig): it keeps the backward's split kernels."""
    assert attention_core(AttentionImpl.pallas, bwd_workspace_mb=0).keywords == {"bwd_workspace_mb": 0}


def test_cudnn_off_gpu_is_an_error_naming_the_choice():
    q, k, v = _shapes(4, 4)
    with pytest.raises(ValueError, match=r"attention\.impl=cudnn needs a GPU \(backend is 'cpu'\); use attention\.impl=xla or auto"):
        attention_core(AttentionImpl.cudnn)(q, k, v, causal=True)


def test_pallas_core_under_a_mesh_checks_the_global_shapes(devices):
    """Under a mesh the kernels run per device; a bad call must be refused with the shapes the user
    passed, not the per-device shards' (batch 8 vs 4 over data x fsdp = 4 reads "2 vs 1" there)."""
    from scaling.config import MeshConfig
    from scaling.sharding import make_mesh, use_sharding

    q = jnp.zeros((8, 16, 4, 16), jnp.float32)
    kv = jnp.zeros((4, 16, 2, 16), jnp.float32)
    with use_sharding(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices), "default"):
        with pytest.raises(ValueError, match=r"k/v batch 4 must equal q batch 8 \(q \(8, 16, 4, 16\), k \(4, 16, 2, 16\)\)"):
            jax.jit(lambda q, k, v: attention.pallas_attention(q, k, v, causal=True))(q, kv, kv)


# ------------------------------------------------------------------------- remat policies


def _saved_names(policy, names=()):
    """The checkpoint_name tags a policy keeps for the backward pass of a body that tags all eight."""
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints
    from jax.ad_checkpoint import checkpoint_name

    from scaling import remat
    from scaling.config import RematConfig

    def body(x):
        for i, name in enumerate(layers.CHECKPOINT_NAMES):
            x = jnp.sin(checkpoint_name(x * (i + 2.0), name))
        return x.sum()

    saved = saved_residuals(remat.apply(body, RematConfig(policy=policy, names=names)), jnp.ones(3))
    return {m.group(1) for _, why in saved if (m := re.match(r"named '(\w+)'", why))}


def test_each_policy_saves_the_documented_tags():
    """selective (Korthikanti et al. 2022): the linear layers' outputs, not the attention core's;
    names / offload: exactly remat.names, given as a YAML list or a tuple; full: none."""
    linear = {"query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_down"}
    assert _saved_names("selective") == linear
    assert _saved_names("names", ["mlp_up", "attention_out"]) == {"mlp_up", "attention_out"}
    assert _saved_names("names", ("query_proj",)) == {"query_proj"}
    assert _saved_names("full") == set()


def test_host_offload_support_reads_the_devices_memory_spaces():
    import types

    from scaling import remat

    class Device:
        def __init__(self, kinds):
            self.kinds = kinds

        def addressable_memories(self):
            if self.kinds is None:
                raise NotImplementedError("no memories API")
            return [types.SimpleNamespace(kind=k) for k in self.kinds]

    assert remat.host_offload_supported(Device(["device", "pinned_host"]))
    assert not remat.host_offload_supported(Device(["device", "unpinned_host"]))
    assert not remat.host_offload_supported(Device(None))
