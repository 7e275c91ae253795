import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scaling import layers
from scaling.attention import xla_attention
from scaling.config import load_config
from scaling.model import build_model, count_params
from scaling import accounting


def tiny(*overrides):
    return load_config("configs/models/tiny.yaml", ["--model.compute_dtype=float32", *overrides]).model


def tokens(b, t, vocab, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, t)), jnp.int32)


def test_shapes_dtypes_and_param_count():
    cfg = tiny()
    model = build_model(cfg)
    logits = model(tokens(2, 16, cfg.vocab_size))
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    assert count_params(model) == accounting.param_count(cfg)
    bf = build_model(tiny("--model.compute_dtype=bfloat16"))
    assert bf.hidden_states(tokens(1, 8, cfg.vocab_size)).dtype == jnp.bfloat16
    assert bf(tokens(1, 8, cfg.vocab_size)).dtype == jnp.float32
    # Master weights stay f32.
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(bf, nnx.Param)))


def test_causality():
    cfg = tiny()
    model = build_model(cfg)
    x = tokens(1, 24, cfg.vocab_size)
    y = x.at[0, 15].set((x[0, 15] + 1) % cfg.vocab_size)
    a, b = model(x), model(y)
    np.testing.assert_array_equal(np.asarray(a[0, :15]), np.asarray(b[0, :15]))
    assert not np.allclose(a[0, 15:], b[0, 15:])


def test_gqa_with_repeated_kv_equals_mha():
    gqa_cfg = tiny("--model.num_heads=4", "--model.num_kv_heads=2")
    mha_cfg = tiny("--model.num_heads=4", "--model.num_kv_heads=4")
    gqa = build_model(gqa_cfg, seed=1)
    mha = build_model(mha_cfg, seed=2)
    # Copy every weight; repeat each KV head for its group of 2 query heads.
    g_state, m_state = nnx.state(gqa, nnx.Param), nnx.state(mha, nnx.Param)
    pure_g, pure_m = nnx.to_pure_dict(g_state), nnx.to_pure_dict(m_state)
    pure_m = jax.tree.map(lambda x: x, pure_g)
    for name in ("k_dkh", "v_dkh"):
        pure_m["blocks"]["attn"][name] = jnp.repeat(pure_g["blocks"]["attn"][name], 2, axis=2)
    nnx.replace_by_pure_dict(m_state, pure_m)
    nnx.update(mha, m_state)
    x = tokens(2, 12, gqa_cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(gqa(x)), np.asarray(mha(x)), rtol=1e-5, atol=1e-5)


def test_rope_relative_position():
    cfg = tiny()
    inv_freq = layers.rope_frequencies(cfg)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, cfg.resolved_head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, cfg.resolved_head_dim)), jnp.float32)

    def score(m, n):
        qm = layers.apply_rope(q, jnp.array([[m]]), inv_freq)
        kn = layers.apply_rope(k, jnp.array([[n]]), inv_freq)
        return float(jnp.sum(qm * kn))

    # <R_m q, R_n k> depends on m - n only.
    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4, abs=1e-5)
    assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), rel=1e-5)
    assert score(9, 3) != pytest.approx(score(7, 3), rel=1e-3)


def test_llama3_rope_scaling_matches_reference_formula():
    cfg = load_config("configs/models/llama3.2_1b.yaml").model
    inv = np.asarray(layers.rope_frequencies(cfg), np.float64)
    base = 1.0 / (cfg.rope_theta ** (np.arange(0, 64, 2) / 64))
    # Reference: Meta's llama3 apply_scaling, elementwise in float64.
    out = []
    for f in base:
        wavelen = 2 * np.pi / f
        if wavelen < 8192 / 4:
            out.append(f)
        elif wavelen > 8192 / 1:
            out.append(f / 32)
        else:
            s = (8192 / wavelen - 1) / (4 - 1)
            out.append((1 - s) * f / 32 + s * f)
    np.testing.assert_allclose(inv, np.array(out), rtol=1e-5)


def test_scanned_equals_unrolled():
    scanned = build_model(tiny("--model.scan_layers=true"), seed=3)
    unrolled = build_model(tiny("--model.scan_layers=false"), seed=3)
    x = tokens(2, 16, scanned.cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(scanned(x)), np.asarray(unrolled(x)), rtol=1e-5, atol=1e-5)


def test_xla_attention_against_numpy_float64():
    rng = np.random.default_rng(1)
    b, t, n, k, h = 2, 7, 4, 2, 8
    q, kk, v = (rng.normal(size=s) for s in ((b, t, n, h), (b, t, k, h), (b, t, k, h)))
    out = np.asarray(xla_attention(*(jnp.asarray(a, jnp.float32) for a in (q, kk, v))))
    ref = np.zeros((b, t, n, h))
    for bi in range(b):
        for hi in range(n):
            kv = hi // (n // k)
            s = q[bi, :, hi] @ kk[bi, :, kv].T / np.sqrt(h)
            s = np.where(np.tril(np.ones((t, t))) > 0, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            ref[bi, :, hi] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, kv]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_tiny_model_overfits_one_batch():
    cfg = tiny()
    model = build_model(cfg)
    batch = tokens(2, 17, cfg.vocab_size, seed=5)
    graphdef, params = nnx.split(model)
    tx = optax.adam(3e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss

    first = None
    for _ in range(120):
        params, opt, loss = step(params, opt)
        first = first if first is not None else float(loss)
    assert first > 6.0 and float(loss) < 0.05, (first, float(loss))
