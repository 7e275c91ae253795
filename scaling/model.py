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
from scaling.config import AttentionConfig, DType, ModelConfig, RematConfig, validate_attention, validate_model
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
        # Checked here too: configs built in Python skip load_config's validation.
        validate_model(cfg)
        validate_attention(attention)
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
        """Final-normed hidden states [B, T, D] in the compute dtype (arguments: see __call__)."""
        cfg = self.cfg
        tokens_bt = check_tokens(tokens_bt, cfg.vocab_size)
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        else:
            positions_bt = check_positions(positions_bt, b, t)
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
        """tokens [B, T] integer ids in [0, V) -> logits [B, T, V] float32.

        positions_bt: [B, T] or [1, T] integers (default 0..T-1 in every row). segment_ids: None,
        or [B, T] integers; a token attends only to earlier tokens of its own segment (packed rows).
        T may exceed cfg.max_seq_len: RoPE is computed per position, but the model was not
        trained there. Ids outside [0, V) raise ValueError when the tokens are concrete; under
        jit (traced) they cannot be checked, and give NaN logits in their row (Embed).
        """
        return self.logits(self.hidden_states(tokens_bt, positions_bt, segment_ids))


def check_tokens(tokens_bt, vocab_size: int) -> jax.Array:
    """tokens as a [B, T] integer array; ids checked against [0, vocab_size) when concrete.

    Float ids failed deep inside jnp.take, bool ids or ids of another rank ran or failed on an
    unpacking; ids >= V gave NaN logits and ids < 0 another token's row, without a word."""
    tokens_bt = jnp.asarray(tokens_bt)
    if tokens_bt.ndim != 2:
        raise ValueError(f"tokens_bt must be 2-D [B, T], got shape {tokens_bt.shape}")
    if not jnp.issubdtype(tokens_bt.dtype, jnp.integer):
        raise TypeError(f"tokens_bt.dtype={tokens_bt.dtype} must be an integer type (int32)")
    # (Traced ids cannot be read; nor can a multi-host array's from one process.)
    if not isinstance(tokens_bt, jax.core.Tracer) and tokens_bt.is_fully_addressable and tokens_bt.size:
        lo, hi = int(jnp.min(tokens_bt)), int(jnp.max(tokens_bt))
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"tokens_bt: ids must be in [0, model.vocab_size={vocab_size}), got min {lo}, max {hi}")
    return tokens_bt


def check_positions(positions_bt, b: int, t: int) -> jax.Array:
    """positions as a [B, T] or [1, T] integer array."""
    positions_bt = jnp.asarray(positions_bt)
    if positions_bt.ndim != 2 or positions_bt.shape[1] != t or positions_bt.shape[0] not in (1, b):
        # A [T] or [B, 1] array broadcast silently (or failed deep in RoPE): [B, 1] gave every
        # token the same position.
        raise ValueError(f"positions_bt must have shape [B, T]={(b, t)} (or [1, T]), got {positions_bt.shape}")
    if not jnp.issubdtype(positions_bt.dtype, jnp.integer):
        # Float positions ran: bfloat16 ones are rounded (to multiples of 2 past 256) without a word.
        raise TypeError(f"positions_bt.dtype={positions_bt.dtype} must be an integer type (int32)")
    return positions_bt


def build_model(cfg: ModelConfig, *, attention: AttentionConfig = AttentionConfig(), remat_cfg: RematConfig = RematConfig(), seed: int = 0) -> Transformer:
    """An unsharded model (tests, single device). Sharded init lives in scaling.sharding.init."""
    return Transformer(cfg, attention=attention, remat_cfg=remat_cfg, rngs=nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
