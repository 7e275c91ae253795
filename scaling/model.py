"""The Llama-family decoder: embed -> L x (RMSNorm, GQA attention, RMSNorm, SwiGLU) -> norm -> head.

Layer parameters are always stacked on a leading `layers` axis. `scan_layers` only picks
how the forward pass walks them: `lax.scan` over one compiled body, or an unrolled Python
loop. The parameter layout (and so every checkpoint) is the same either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from scaling import layers, remat
from scaling.attention import Attention, attention_core
from scaling.config import AttentionConfig, DType, ModelConfig, RematConfig
from scaling.sharding import axes as A
from scaling.sharding import constrain

_DTYPES = {DType.float32: jnp.float32, DType.bfloat16: jnp.bfloat16, DType.float16: jnp.float16}


def resolve_dtype(dtype: DType):
    if dtype == DType.auto:
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return _DTYPES[dtype]


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdt = resolve_dtype(cfg.param_dtype)
        self.attn_norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
        self.attn = Attention(cfg, param_dtype=pdt, rngs=rngs)
        self.mlp_norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
        self.mlp = layers.SwiGLU(cfg, param_dtype=pdt, rngs=rngs)

    def __call__(self, x_btd, positions_bt, inv_freq, *, core, segment_ids=None):
        x_btd = x_btd + self.attn(self.attn_norm(x_btd), positions_bt, inv_freq, core=core, segment_ids=segment_ids)
        x_btd = x_btd + self.mlp(self.mlp_norm(x_btd))
        return constrain(x_btd, (A.BATCH, A.SEQ, A.ACT_EMBED))


class Transformer(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        attention: AttentionConfig = AttentionConfig(),
        remat_cfg: RematConfig = RematConfig(),
        rngs: nnx.Rngs,
    ):
        self.cfg = cfg
        self.attention_cfg = attention
        self.remat_cfg = remat_cfg
        pdt = resolve_dtype(cfg.param_dtype)
        self.embed = layers.Embed(cfg, param_dtype=pdt, rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.num_layers, transform_metadata={nnx.PARTITION_NAME: A.LAYERS})
        def make_blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, param_dtype=pdt, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head_dv = layers.make_param(
                rngs, layers.normal_init(cfg.init_std), (cfg.hidden_size, cfg.vocab_size), (A.EMBED, A.VOCAB), pdt
            )

    @property
    def compute_dtype(self):
        return resolve_dtype(self.cfg.compute_dtype)

    def hidden_states(self, tokens_bt, positions_bt=None, segment_ids=None):
        """Final-normed hidden states [B, T, D] in the compute dtype."""
        cfg = self.cfg
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        elif jnp.ndim(positions_bt) != 2 or jnp.shape(positions_bt)[1] != t or jnp.shape(positions_bt)[0] not in (1, b):
            # A [T] or [B, 1] array broadcast silently (or failed deep in RoPE): [B, 1] gave every
            # token the same position.
            raise ValueError(f"positions_bt must have shape [B, T]={(b, t)} (or [1, T]), got {jnp.shape(positions_bt)}")
        inv_freq = layers.rope_frequencies(cfg)
        core = attention_core(self.attention_cfg.impl, bwd_workspace_mb=self.attention_cfg.bwd_workspace_mb)
        x_btd = self.embed(tokens_bt, self.compute_dtype)

        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer_state):
            block = nnx.merge(graphdef, layer_state)
            return block(x, positions_bt, inv_freq, core=core, segment_ids=segment_ids), None

        if cfg.scan_layers:
            body = remat.apply(body, self.remat_cfg, prevent_cse=False)  # scan already prevents CSE
            x_btd, _ = jax.lax.scan(body, x_btd, stacked)
        else:
            body = remat.apply(body, self.remat_cfg)
            for i in range(cfg.num_layers):
                x_btd, _ = body(x_btd, jax.tree.map(lambda p: p[i], stacked))
        return self.final_norm(x_btd)

    def logits(self, x_btd):
        """Output head in the compute dtype with f32 accumulation: [B, T, V] f32."""
        if self.cfg.tie_embeddings:
            logits = self.embed.attend(x_btd)
        else:
            w = self.head_dv[...].astype(x_btd.dtype)
            logits = jnp.einsum("btd,dv->btv", x_btd, w, preferred_element_type=jnp.float32)
        return constrain(logits, (A.BATCH, A.SEQ, A.ACT_VOCAB))

    def head_weight(self):
        """(w, layout): the output projection in the compute dtype, w [D, V] with layout "dv",
        or tied, the embedding table [V, D] with "vd". For losses that apply the head themselves."""
        dt = self.compute_dtype
        if self.cfg.tie_embeddings:
            return self.embed.table_vd[...].astype(dt), "vd"
        return self.head_dv[...].astype(dt), "dv"

    def __call__(self, tokens_bt, positions_bt=None, segment_ids=None):
        """tokens [B, T] int32 -> logits [B, T, V] float32."""
        return self.logits(self.hidden_states(tokens_bt, positions_bt, segment_ids))


def build_model(cfg: ModelConfig, *, attention: AttentionConfig = AttentionConfig(), remat_cfg: RematConfig = RematConfig(), seed: int = 0) -> Transformer:
    """An unsharded model (tests, single device). Sharded init lives in scaling.sharding.init."""
    return Transformer(cfg, attention=attention, remat_cfg=remat_cfg, rngs=nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
