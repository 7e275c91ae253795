"""The model against an independent float64 numpy forward pass written from the Llama definition,
and its initialisation against what the config and docstrings say."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaling.config import DType, ModelConfig
from scaling.model import build_model


def numpy_llama(p, tokens_bt, positions_bt, cfg: ModelConfig, *, segments_bt=None, inv_freq=None):
    """Pre-norm Llama in float64: RMSNorm (eps inside the sqrt), rotate-half RoPE with
    inv_freq theta^(-2i/H) (or the given ones: Llama 3's scaled) at each row's own positions,
    causal GQA where query head h reads KV head h // (N/K), within each segment when segment
    ids are given, SwiGLU down(silu(x W_gate) * (x W_up)), final norm, (tied) head."""
    n, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    b, t = tokens_bt.shape
    visible = np.tril(np.ones((t, t), bool))[None]
    if segments_bt is not None:
        visible = visible & (segments_bt[:, :, None] == segments_bt[:, None, :])

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * w

    if inv_freq is None:
        inv_freq = cfg.rope_theta ** (-2.0 * np.arange(hd // 2) / hd)
    ang = positions_bt[:, :, None, None] * inv_freq  # [B, T, 1, H/2]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    x = p["embed"]["table_vd"][tokens_bt]
    for layer in range(cfg.num_layers):
        w = jax.tree.map(lambda a: a[layer], p["blocks"])
        h = rms(x, w["attn_norm"]["scale"])
        q = rope(np.einsum("btd,dnh->btnh", h, w["attn"]["q_dnh"]))
        k = rope(np.einsum("btd,dkh->btkh", h, w["attn"]["k_dkh"]))
        v = np.einsum("btd,dkh->btkh", h, w["attn"]["v_dkh"])
        out = np.zeros((b, t, n, hd))
        for head in range(n):
            g = head // (n // kv)
            s = np.einsum("bth,bsh->bts", q[:, :, head], k[:, :, g]) / math.sqrt(hd)
            s = np.where(visible, s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            out[:, :, head] = np.einsum("bts,bsh->bth", e / e.sum(-1, keepdims=True), v[:, :, g])
        x = x + np.einsum("btnh,nhd->btd", out, w["attn"]["o_nhd"])
        h = rms(x, w["mlp_norm"]["scale"])
        gate, up = h @ w["mlp"]["gate_df"], h @ w["mlp"]["up_df"]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["mlp"]["down_fd"]
    x = rms(x, p["final_norm"]["scale"])
    return x @ (p["embed"]["table_vd"].T if cfg.tie_embeddings else p["head_dv"])


@pytest.mark.parametrize("tie,scan", [(False, True), (True, False)])
def test_tiny_model_logits_match_float64_numpy(tie, scan):
    # head_dim 12 != D / N; small rope_theta and big weights so rotations and attention matter.
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
                      mlp_dim=48, rope_theta=100.0, norm_eps=0.1, tie_embeddings=tie, scan_layers=scan,
                      compute_dtype=DType.float32)
    model = build_model(cfg, seed=1)
    rng = np.random.default_rng(0)
    state = nnx.state(model, nnx.Param)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(state))
    p = jax.tree.map(lambda a: a * 10.0, p)  # std 0.2 (0.07 scaled): non-uniform attention
    for norm in ("attn_norm", "mlp_norm"):
        p["blocks"][norm]["scale"] = rng.normal(1.0, 0.3, p["blocks"][norm]["scale"].shape)
    p["final_norm"]["scale"] = rng.normal(1.0, 0.3, p["final_norm"]["scale"].shape)
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), p)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, p))
    nnx.update(model, state)

    tokens = rng.integers(0, cfg.vocab_size, (2, 9))
    # Each row its own, unevenly spaced positions: a relative shift alone would not show
    # rows using another row's positions.
    positions = np.stack([np.arange(9), np.cumsum(rng.integers(1, 5, 9))])
    got = np.asarray(model(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32)))
    want = numpy_llama(jax.tree.map(lambda a: a.astype(np.float64), p), tokens, positions, cfg)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_init_std_of_each_weight():
    cfg = ModelConfig(vocab_size=300, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=96,
                      init_std=0.05)
    p = nnx.to_pure_dict(nnx.state(build_model(cfg, seed=0), nnx.Param))
    std, scaled = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)  # residual outputs: std / sqrt(2L)
    want = {
        ("embed", "table_vd"): std, ("head_dv",): std,
        ("blocks", "attn", "q_dnh"): std, ("blocks", "attn", "k_dkh"): std, ("blocks", "attn", "v_dkh"): std,
        ("blocks", "attn", "o_nhd"): scaled,
        ("blocks", "mlp", "gate_df"): std, ("blocks", "mlp", "up_df"): std, ("blocks", "mlp", "down_fd"): scaled,
    }
    seen = set()
    for path, x in jax.tree_util.tree_leaves_with_path(p):
        key = tuple(k.key for k in path)
        x = np.asarray(x, np.float64)
        if key[-1] == "scale":
            np.testing.assert_array_equal(x, 1.0)
            continue
        seen.add(key)
        if key[0] == "blocks":  # every layer on its own: std right, and layers not copies
            for layer in range(cfg.num_layers):
                assert np.std(x[layer]) == pytest.approx(want[key], rel=0.06), (key, layer)
                assert abs(np.mean(x[layer])) < 4 * want[key] / math.sqrt(x[layer].size), (key, layer)
            assert not np.allclose(x[0], x[1])
        else:
            assert np.std(x) == pytest.approx(want[key], rel=0.06), key
    assert seen == set(want)
