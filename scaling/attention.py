"""The attention block and the one dispatch point for the attention core.

Core implementations share one signature:
    core(q_btnh, k_bskh, v_bskh, *, causal, segment_ids) -> out_btnh
with N query heads and K key/value heads (GQA when K < N, N % K == 0).
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scaling import layers
from scaling.attention_args import check_attention_args
from scaling.config import AttentionImpl, ModelConfig
from scaling.sharding import active as active_sharding
from scaling.sharding import axes as A
from scaling.sharding import constrain, logical_to_spec


def _segment_mask(segment_ids):
    if segment_ids is None:
        return None
    # A list pair too: check_attention_args and the other cores take one (a list was read as ids).
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
    return q_seg[:, :, None] == kv_seg[:, None, :]  # [B, T, S]


def xla_attention(q_btnh, k_bskh, v_bskh, *, causal: bool = True, segment_ids=None):
    """Reference: softmax(q k^T / sqrt(H)) v, GQA by grouping query heads. Scores and softmax in
    f32 (f64 for f64 inputs, under jax_enable_x64); the probabilities are rounded to v's dtype for
    the P·V product (accumulated in that precision), as the flash kernels do."""
    check_attention_args(q_btnh, k_bskh, v_bskh, causal=causal, segment_ids=segment_ids)
    b, t, n, h = q_btnh.shape
    s, kh = k_bskh.shape[1], k_bskh.shape[2]
    g = n // kh
    # (f32 for f64 inputs too had rounded their scores and output to f32, silently)
    acc = jnp.promote_types(q_btnh.dtype, jnp.float32)
    q_btkgh = q_btnh.reshape(b, t, kh, g, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=acc)
    logits = logits / math.sqrt(h)
    mask = jnp.ones((t, s), bool) if not causal else jnp.tril(jnp.ones((t, s), bool))
    mask = mask[None]
    seg = _segment_mask(segment_ids)
    if seg is not None:
        mask = mask & seg
    logits = jnp.where(mask[:, None, None], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    # Rows with no visible key (possible with segment ids) give 0, not a uniform average.
    probs = jnp.where(mask[:, None, None].any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_bskh.dtype), v_bskh, preferred_element_type=acc)
    return out.reshape(b, t, n, h).astype(q_btnh.dtype)


def cudnn_unsupported(dtype, head_dim: int | None) -> str | None:
    """Why cuDNN's flash attention cannot take q of this dtype and head dim (None: not known), or
    None. Its limits (jax's cudnn check_is_flash_attention): float16/bfloat16 only, head dims a
    multiple of 8 up to 128, or 256 from Hopper on. Past them it raised NotImplementedError from
    inside jax. On an H200 (jax 0.11.2) cuDNN ran or refused exactly as predicted for bf16, f16 and
    f32 at 18 head dims from 8 to 264 (experiments/check_cudnn_limits.py; 54 of 54 agree,
    docs/results/scan_session49/cudnn_limits_h200.json). The 128 limit for pre-Hopper GPUs is
    unchecked."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"q/k/v dtype is {jnp.dtype(dtype).name} (model.compute_dtype); cuDNN takes bfloat16 or float16"
    if head_dim is None:
        return None
    max_dim = 256 if _hopper_or_later() else 128
    if head_dim % 8 or head_dim > max_dim:
        return f"head dim is {head_dim} (model.head_dim); cuDNN takes multiples of 8 up to {max_dim} on this GPU"
    return None


def _hopper_or_later() -> bool:
    from scaling.kernels.flash_attention import is_hopper  # lazily: the kernels are optional

    capability = getattr(jax.devices()[0], "compute_capability", None)
    return is_hopper() or (capability is not None and float(capability) >= 9.0)


def cudnn_attention(q_btnh, k_bskh, v_bskh, *, causal: bool = True, segment_ids=None):
    if jax.default_backend() != "gpu":
        raise ValueError(
            f"attention.impl=cudnn needs a GPU (backend is {jax.default_backend()!r}); use attention.impl=xla or auto"
        )
    check_attention_args(q_btnh, k_bskh, v_bskh, causal=causal, segment_ids=segment_ids)
    if (why := cudnn_unsupported(q_btnh.dtype, q_btnh.shape[-1])) is not None:
        raise ValueError(f"attention.impl=cudnn cannot run this call: {why}; use attention.impl=xla, pallas or auto")
    mask = None
    if segment_ids is not None:
        mask = _segment_mask(segment_ids)[:, None]
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, mask=mask, is_causal=causal, implementation="cudnn")


def pallas_attention(q_btnh, k_bskh, v_bskh, *, causal: bool = True, segment_ids=None,
                     bwd_workspace_mb: int | None = None):
    """Our flash-attention kernels, run per device under a mesh. bwd_workspace_mb: the
    backward's dS workspace budget (`AttentionConfig.bwd_workspace_mb`; None: the kernel's).

    XLA's SPMD partitioner cannot split an opaque custom call such as a pallas_call: it would
    run it on q, k and v gathered onto every device. Under `use_sharding` the kernels
    therefore run inside a shard_map, on each device's batch rows and heads (the activations'
    own layout: batch over data x fsdp, heads over tensor, whole rows), which needs no
    communication: attention is independent per row and per KV-head group."""
    from scaling.kernels import flash_attention  # imported lazily: the kernel is optional

    # Checked on the global shapes: inside the shard_map the kernel would name per-device ones.
    check_attention_args(q_btnh, k_bskh, v_bskh, causal=causal, segment_ids=segment_ids)

    def local(q, k, v, seg):
        # "auto": on Hopper the faster measured forward (Triton or Mosaic GPU) and the Mosaic GPU
        # backward where they support the call (docs/attention.md, "Choosing the backend");
        # the Triton kernels everywhere else and for what the Mosaic kernels refuse.
        kw = {} if bwd_workspace_mb is None else dict(bwd_workspace_bytes=bwd_workspace_mb << 20)
        return flash_attention(q, k, v, causal=causal, segment_ids=seg, backend="auto", **kw)

    ctx = active_sharding()
    if ctx is None or ctx[0].size == 1:
        return local(q_btnh, k_bskh, v_bskh, segment_ids)
    mesh, rules = ctx
    spec = functools.partial(logical_to_spec, mapping=rules.activations, mesh=mesh)
    q_spec = spec((A.BATCH, A.SEQ, A.ACT_HEADS, A.HEAD_DIM))
    kv_spec = spec((A.BATCH, A.SEQ, A.ACT_KV_HEADS, A.HEAD_DIM))
    seg_spec = jax.tree.map(lambda _: spec((A.BATCH, A.SEQ)), segment_ids)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=False)(q_btnh, k_bskh, v_bskh, segment_ids)


ATTENTION_CORES: dict[AttentionImpl, Callable] = {
    AttentionImpl.xla: xla_attention,
    AttentionImpl.cudnn: cudnn_attention,
    AttentionImpl.pallas: pallas_attention,
}

# `auto` on a Hopper GPU runs our kernels for rows (query or key) up to this many tokens, per
# head dim, and cuDNN beyond and at other head dims (their backward is the Triton kernel's,
# slower than cuDNN's). Measured (docs/benchmarks.md, issue 5; forward+backward, causal,
# interleaved rounds against cuDNN in the same run): D=64 at T=8k 1.07x (H200, ninth session);
# D=128 (thirteenth session) at 8k 1.03x (H100) and 1.07x (H200) with 32 heads, 1.07x and 1.11x
# with GQA 4; at 16k 0.99x / 1.04x and 0.97x / 1.01x: cuDNN from 16k on. (Non-causal D=128 at 8k,
# which the model never runs, is 0.98x on the H100.)
AUTO_PALLAS_MAX_LEN: dict[int, int] = {64: 8192, 128: 8192}


def resolve_impl(impl: AttentionImpl, *, seq_len: int | None = None, segmented: bool = False,
                 head_dim: int | None = None, dtype=None) -> AttentionImpl:
    """`auto` picks the fastest implementation measured on the current backend for this call:
    the xla reference off GPU; on a Hopper GPU our Pallas kernels for rows up to
    AUTO_PALLAS_MAX_LEN[head_dim] tokens without segment ids (their Mosaic kernels take none; the
    Triton fallback is slower than cuDNN), cuDNN otherwise; cuDNN on other GPUs; the xla
    reference where cuDNN would be picked but cannot take the dtype or head dim
    (`cudnn_unsupported`: float32 compute, say). With seq_len None (not known yet) the answer is
    for a short row; with head_dim None, for the strictest head dim of the table; with dtype
    None, for a dtype cuDNN takes."""
    if impl != AttentionImpl.auto:
        return impl
    if jax.default_backend() != "gpu":
        return AttentionImpl.xla
    from scaling.kernels.flash_attention import is_hopper  # lazily: the kernels are optional

    limit = min(AUTO_PALLAS_MAX_LEN.values()) if head_dim is None else AUTO_PALLAS_MAX_LEN.get(head_dim, 0)
    if is_hopper() and not segmented and limit and (seq_len is None or seq_len <= limit):
        return AttentionImpl.pallas
    if dtype is not None and cudnn_unsupported(dtype, head_dim) is not None:
        return AttentionImpl.xla
    return AttentionImpl.cudnn


def prepare(impl: AttentionImpl) -> None:
    """Call before the first trace of a model that may run our Pallas kernels.

    Lowering a pallas_call imports parts of Pallas lazily (on the CPU, its interpreter, which
    imports `jax.experimental.pallas.fuser`), and that module defines a jax config option that
    is part of every jit's trace context. Imported during the first trace of a train step, it
    changes the context, so the next call of the same jitted step misses the cache and traces
    and compiles it all again. Importing it up front keeps the context the same. (Seen with
    attention.impl=pallas on the CPU. On an H200 every core's train step compiles once, `auto`
    and `pallas` running our Mosaic GPU kernels included: experiments/check_recompile.py.)
    """
    if impl == AttentionImpl.pallas:
        try:
            importlib.import_module("jax.experimental.pallas.fuser")
        except ImportError:  # a jax without it defines no such option
            pass


def auto_attention(q_btnh, k_bskh, v_bskh, *, causal: bool = True, segment_ids=None, bwd_workspace_mb=None):
    """The `auto` core: resolved per call (shapes are static under jit)."""
    check_attention_args(q_btnh, k_bskh, v_bskh, causal=causal, segment_ids=segment_ids)
    impl = resolve_impl(AttentionImpl.auto, seq_len=max(q_btnh.shape[1], k_bskh.shape[1]),
                        segmented=segment_ids is not None, head_dim=q_btnh.shape[-1], dtype=q_btnh.dtype)
    kw = dict(bwd_workspace_mb=bwd_workspace_mb) if impl == AttentionImpl.pallas and bwd_workspace_mb is not None else {}
    return ATTENTION_CORES[impl](q_btnh, k_bskh, v_bskh, causal=causal, segment_ids=segment_ids, **kw)


def attention_core(impl: AttentionImpl, *, bwd_workspace_mb: int | None = None) -> Callable:
    """The core for `impl`; bwd_workspace_mb goes to our kernels' backward (None: its default)."""
    if impl not in (*ATTENTION_CORES, AttentionImpl.auto):
        raise ValueError(f"attention impl {impl!r} must be one of {[i.value for i in AttentionImpl]}")
    if bwd_workspace_mb is not None and (isinstance(bwd_workspace_mb, bool) or not isinstance(bwd_workspace_mb, int)
                                         or bwd_workspace_mb < 0):
        raise ValueError(f"attention.bwd_workspace_mb must be None or an int >= 0, got {bwd_workspace_mb!r}")
    core = auto_attention if impl == AttentionImpl.auto else ATTENTION_CORES[impl]
    if bwd_workspace_mb is not None and impl in (AttentionImpl.auto, AttentionImpl.pallas):
        core = functools.partial(core, bwd_workspace_mb=bwd_workspace_mb)
    return core


class Attention(nnx.Module):
    """GQA self-attention with RoPE. Q/K/V column-parallel, output row-parallel."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        init = layers.normal_init(cfg.init_std)
        self.q_dnh = layers.make_param(rngs, init, (d, n, h), (A.EMBED, A.HEADS, A.HEAD_DIM), param_dtype)
        self.k_dkh = layers.make_param(rngs, init, (d, k, h), (A.EMBED, A.KV_HEADS, A.HEAD_DIM), param_dtype)
        self.v_dkh = layers.make_param(rngs, init, (d, k, h), (A.EMBED, A.KV_HEADS, A.HEAD_DIM), param_dtype)
        out_init = layers.normal_init(cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.o_nhd = layers.make_param(rngs, out_init, (n, h, d), (A.HEADS, A.HEAD_DIM, A.EMBED), param_dtype)

    def project_qkv(self, x_btd, positions_bt, inv_freq):
        """q [B, T, N, H], k and v [B, T, K, H], RoPE applied to q and k."""
        dt = x_btd.dtype
        q = checkpoint_name(jnp.einsum("btd,dnh->btnh", x_btd, self.q_dnh[...].astype(dt)), layers.QUERY_PROJ)
        k = checkpoint_name(jnp.einsum("btd,dkh->btkh", x_btd, self.k_dkh[...].astype(dt)), layers.KEY_PROJ)
        v = checkpoint_name(jnp.einsum("btd,dkh->btkh", x_btd, self.v_dkh[...].astype(dt)), layers.VALUE_PROJ)
        q = constrain(layers.apply_rope(q, positions_bt, inv_freq), (A.BATCH, A.SEQ, A.ACT_HEADS, A.HEAD_DIM))
        k = constrain(layers.apply_rope(k, positions_bt, inv_freq), (A.BATCH, A.SEQ, A.ACT_KV_HEADS, A.HEAD_DIM))
        v = constrain(v, (A.BATCH, A.SEQ, A.ACT_KV_HEADS, A.HEAD_DIM))
        return q, k, v

    def project_out(self, attn_btnh):
        dt = attn_btnh.dtype
        out = jnp.einsum("btnh,nhd->btd", attn_btnh, self.o_nhd[...].astype(dt))
        return constrain(checkpoint_name(out, layers.OUT_PROJ), (A.BATCH, A.SEQ, A.ACT_EMBED))

    def __call__(self, x_btd, positions_bt, inv_freq, *, core: Callable, segment_ids=None):
        q, k, v = self.project_qkv(x_btd, positions_bt, inv_freq)
        attn = core(q, k, v, causal=True, segment_ids=segment_ids)
        attn = checkpoint_name(constrain(attn, (A.BATCH, A.SEQ, A.ACT_HEADS, A.HEAD_DIM)), layers.ATTENTION_OUT)
        return self.project_out(attn)
