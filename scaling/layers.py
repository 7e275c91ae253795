"""Building blocks as Flax NNX modules; every parameter carries logical axis names.

Parameters live in `param_dtype` (f32 master weights) and are cast to the compute dtype
at use, so mixed precision needs no separate copy of the model.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaling.config import ModelConfig, validate_model
from scaling.sharding import axes as A
from scaling.sharding import constrain

# checkpoint_name tags: remat policies (`names`, `offload`, `selective`) refer to these.
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
ATTENTION_OUT = "attention_out"  # the attention core's output, before the output projection
OUT_PROJ = "out_proj"
MLP_GATE = "mlp_gate"
MLP_UP = "mlp_up"
MLP_DOWN = "mlp_down"
CHECKPOINT_NAMES = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTENTION_OUT, OUT_PROJ, MLP_GATE, MLP_UP, MLP_DOWN)


def make_param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...], dtype) -> nnx.Param:
    """A parameter with logical axis names; sharding is applied by scaling.sharding at init."""
    assert len(shape) == len(names), (shape, names)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


def normal_init(std: float):
    def init(key, shape, dtype):
        return std * jax.random.normal(key, shape, dtype)

    return init


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale (Zhang & Sennrich 2019), computed in f32."""

    def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = make_param(rngs, lambda k, s, d: jnp.ones(s, d), (dim,), (A.NORM,), param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x32 = x_btd.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x_btd.dtype)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs):
        self.table_vd = make_param(
            rngs, normal_init(cfg.init_std), (cfg.vocab_size, cfg.hidden_size), (A.VOCAB, A.EMBED), param_dtype
        )

    def __call__(self, tokens_bt: jax.Array, dtype) -> jax.Array:
        """Rows of the table; an id outside [0, V) gives a row of NaN. jnp.take fills ids >= V
        with NaN but wraps negative ones (-1 read the last row): they are sent past V first (in
        int32: V may not fit the ids' own dtype)."""
        tokens_bt = tokens_bt.astype(jnp.int32)
        tokens_bt = jnp.where(tokens_bt < 0, self.table_vd.shape[0], tokens_bt)
        x_btd = jnp.take(self.table_vd[...].astype(dtype), tokens_bt, axis=0, mode="fill", fill_value=jnp.nan)
        return constrain(x_btd, (A.BATCH, A.SEQ, A.ACT_EMBED))

    def attend(self, x_btd: jax.Array) -> jax.Array:
        """Tied output head: logits = x · E^T, accumulated in f32."""
        table = self.table_vd[...].astype(x_btd.dtype)
        return jnp.einsum("btd,vd->btv", x_btd, table, preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------ RoPE


def check_rope(cfg: ModelConfig) -> None:
    """The model config's checks (head dim, RoPE scaling), run here too: a ModelConfig built in
    Python skips the config file's validation (an odd head dim failed deep in jnp.split; low >=
    high, or a factor below 1, gave frequencies that are not Llama 3's, without a word)."""
    validate_model(cfg)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies theta^(-2i/H) (Su et al. 2021), with Llama 3's scaling if set."""
    check_rope(cfg)
    head_dim = cfg.resolved_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if cfg.rope_scaling_factor:
        # Llama 3.1 "llama3" rope_type: long wavelengths divided by `factor`, short ones
        # kept, a smooth ramp between (Meta's reference implementation, apply_scaling).
        factor = cfg.rope_scaling_factor
        low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = jnp.where(wavelen > low_wavelen, inv_freq / factor, jnp.where(wavelen < high_wavelen, inv_freq, mid))
    return inv_freq


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + H/2): the half-split layout of GPT-NeoX and HF Llama.

    Meta's original checkpoints pair adjacent dims (2i, 2i+1) instead; HF's conversion script
    permutes their q/k rows into this layout, so scaling.interop reads HF directories as they are
    (it does not read Meta's original format).
    """
    angles_bth = positions_bt[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles_bth)[:, :, None, :]
    sin = jnp.sin(angles_bth)[:, :, None, :]
    x32 = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


# ------------------------------------------------------------------------------- MLP


class SwiGLU(nnx.Module):
    """down(silu(x W_gate) * (x W_up)) (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.mlp_dim
        init = normal_init(cfg.init_std)
        self.gate_df = make_param(rngs, init, (d, f), (A.EMBED, A.MLP), param_dtype)
        self.up_df = make_param(rngs, init, (d, f), (A.EMBED, A.MLP), param_dtype)
        # Scaled init on the residual-branch output (GPT-2): std / sqrt(2 L).
        out_init = normal_init(cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.down_fd = make_param(rngs, out_init, (f, d), (A.MLP, A.EMBED), param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dt = x_btd.dtype
        gate_btf = checkpoint_name(jnp.einsum("btd,df->btf", x_btd, self.gate_df[...].astype(dt)), MLP_GATE)
        up_btf = checkpoint_name(jnp.einsum("btd,df->btf", x_btd, self.up_df[...].astype(dt)), MLP_UP)
        h_btf = constrain(jax.nn.silu(gate_btf) * up_btf, (A.BATCH, A.SEQ, A.ACT_MLP))
        out_btd = checkpoint_name(jnp.einsum("btf,fd->btd", h_btf, self.down_fd[...].astype(dt)), MLP_DOWN)
        return constrain(out_btd, (A.BATCH, A.SEQ, A.ACT_EMBED))
