"""How to Scale Your Model's accounting as code: parameters, FLOPs, bytes, communication, roofline,
and a calibrated step time.

Notation (the book's "All the Transformer Math You Need"): D model width, F MLP width,
N query heads, K key/value heads, H head dim, L layers, V vocabulary, T sequence length,
B sequences. `c` is the compute dtype's byte width, `p` the parameter dtype's.

Sources, cited as [tag] below:
  [HSM-R]  How to Scale Your Model (Austin et al. 2025), "Rooflines": T = max(T_math, T_comms),
           arithmetic intensity = FLOPs / bytes, critical intensity = peak FLOP/s / bandwidth.
  [HSM-S]  ibid., "Sharded Matrices" (collectives): AllGather / ReduceScatter of V bytes over
           one axis T ~ V / W_ici; AllReduce = ReduceScatter + AllGather = 2x.
  [HSM-T]  ibid., "Transformer Math": 2 FLOPs per weight per token forward, 6 for training;
           attention 4·T·N·H per token per layer forward (halved by causality in a flash kernel);
           KV cache 2·L·K·H·T bytes-per-element per sequence.
  [HSM-TR] ibid., "Training": FSDP = AllGather weights forward + again backward + ReduceScatter
           grads; compute-bound when tokens per device > C / W; Megatron TP 2 AllReduces of
           [B, T, D] per layer forward, 2 backward; AdamW state.
  [HSM-I]  ibid., "Inference": KV cache, memory-bound decode.
  [K20]    Kaplan et al. 2020, C ~ 6 N per token.
  [K22]    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
           Models": per-layer activation bytes and selective recomputation.
  [PaLM]   Chowdhery et al. 2022, appendix B: MFU = model FLOPs (no recomputation) / peak.
  [XLA-GPU] What XLA:GPU compiles into this repository's sharded train step, counted from the
           optimized HLO (experiments/hlo_collectives.py, 2 H200s; docs/benchmarks.md,
           "Multi-GPU scaling"): which arrays each collective carries, in which dtype, how often.

Peak memory is the largest phase of the step (MemoryBytes), not a sum of every buffer: the
loss/head transients and a layer's backward working set are live at different times.
The calibrated step time (training_time) divides work by measured achievable rates and adds
the kernel classes up (XLA runs a step's kernels on one CUDA stream, which executes them in
order); the roofline (training_roofline) stays beside it as the book's bound [HSM-R].

The activation table (`layer_residuals`) mirrors what JAX saves for this repository's
model code (scaling/layers.py, attention.py, model.py) under each remat policy; the tests
check it tensor-for-tensor against `jax.ad_checkpoint` and against XLA's memory analysis.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence

from scaling.config import AttentionImpl, Config, DType, ModelConfig, RematPolicyName
from scaling.hardware import Hardware
from scaling.sharding import axes as A
from scaling.sharding.rules import mesh_axes_of  # (a bare-string rule is one axis, as in logical_to_spec)
from scaling.sharding.rules import RuleSet, get_rule_set

F32 = 4
_DTYPE_BYTES = {DType.float32: 4, DType.bfloat16: 2, DType.float16: 2}


def dtype_bytes(dtype: DType, *, accelerator: bool = True) -> int:
    """Bytes per element; `auto` is bf16 on an accelerator, f32 on the CPU (model.resolve_dtype)."""
    if dtype == DType.auto:
        return 2 if accelerator else 4
    return _DTYPE_BYTES[dtype]


# ------------------------------------------------------------------------- parameters


def layer_matmul_params(m: ModelConfig) -> int:
    """Per layer: Q (D·N·H), K and V (2·D·K·H), O (N·H·D), SwiGLU (3·D·F) [HSM-T]."""
    d, n, k, h, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim
    return d * n * h + 2 * d * k * h + n * h * d + 3 * d * f


def param_count(m: ModelConfig) -> int:
    """Exact count of the parameters scaling.model.Transformer creates."""
    d, v, l = m.hidden_size, m.vocab_size, m.num_layers
    per_layer = layer_matmul_params(m) + 2 * d  # + two RMSNorm scales
    head = 0 if m.tie_embeddings else d * v
    return v * d + l * per_layer + d + head  # embedding, layers, final norm, head


def param_shapes(m: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """name -> (shape, logical axes), as scaling.model builds them (without building it)."""
    d, n, k, h, f, v, l = (m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim,
                           m.vocab_size, m.num_layers)
    L, E = A.LAYERS, A.EMBED
    out = {
        "embed.table_vd": ((v, d), (A.VOCAB, E)),
        "blocks.attn_norm.scale": ((l, d), (L, A.NORM)),
        "blocks.attn.q_dnh": ((l, d, n, h), (L, E, A.HEADS, A.HEAD_DIM)),
        "blocks.attn.k_dkh": ((l, d, k, h), (L, E, A.KV_HEADS, A.HEAD_DIM)),
        "blocks.attn.v_dkh": ((l, d, k, h), (L, E, A.KV_HEADS, A.HEAD_DIM)),
        "blocks.attn.o_nhd": ((l, n, h, d), (L, A.HEADS, A.HEAD_DIM, E)),
        "blocks.mlp_norm.scale": ((l, d), (L, A.NORM)),
        "blocks.mlp.gate_df": ((l, d, f), (L, E, A.MLP)),
        "blocks.mlp.up_df": ((l, d, f), (L, E, A.MLP)),
        "blocks.mlp.down_fd": ((l, f, d), (L, A.MLP, E)),
        "final_norm.scale": ((d,), (A.NORM,)),
    }
    if not m.tie_embeddings:
        out["head_dv"] = ((d, v), (E, A.VOCAB))
    return out


# ------------------------------------------------------------------------------ mesh


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes (scaling.sharding.axes.MESH_AXES) and the rule set."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    rules: str = "default"

    def __post_init__(self):
        # A size of 0 divided by zero later, a negative one priced negative FLOPs, a float
        # fractional devices: none of them describes a mesh.
        for axis in ("data", "fsdp", "tensor"):
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise ValueError(f"MeshShape.{axis} must be an integer >= 1, got {size!r}")
        get_rule_set(self.rules)  # an unknown rule set names the allowed ones

    @property
    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def rule_set(self) -> RuleSet:
        return get_rule_set(self.rules)

    def dim_axes(self, names: Sequence[str | None], mapping: Mapping[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
        """Per dimension, the mesh axes that split it (a mesh axis used at most once per spec,
        size-1 axes ignored: scaling.sharding.mesh.logical_to_spec)."""
        used: set[str] = set()
        out = []
        for name in names:
            axes = tuple(a for a in mesh_axes_of(name, mapping) if a not in used and self.sizes[a] > 1) if name else ()
            used.update(axes)
            out.append(axes)
        return out

    def shards(self, names: Sequence[str | None], mapping: Mapping[str, tuple[str, ...]]) -> list[int]:
        """Per dimension, how many ways it is split (see `dim_axes`)."""
        return [math.prod(self.sizes[a] for a in axes) for axes in self.dim_axes(names, mapping)]

    def axes_of(self, name: str, params: bool) -> tuple[str, ...]:
        mapping = self.rule_set.params if params else self.rule_set.activations
        return tuple(a for a in mesh_axes_of(name, mapping) if self.sizes[a] > 1)

    def split(self, name: str, params: bool = False) -> int:
        return math.prod(self.sizes[a] for a in self.axes_of(name, params))


def params_per_device(m: ModelConfig, mesh: MeshShape) -> int:
    """Parameter elements on one device under the rule set (ceil where a dim does not divide)."""
    total = 0
    for shape, names in param_shapes(m).values():
        total += math.prod(-(-s // k) for s, k in zip(shape, mesh.shards(names, mesh.rule_set.params)))
    return total


def gathered_params_per_device(m: ModelConfig, mesh: MeshShape) -> int:
    """Parameter elements a device holds once FSDP has all-gathered them: what its matmuls read.

    FSDP splits a parameter over mesh axes that also split the batch, and all-gathers it over
    those axes before use [HSM-TR]; only its split over the other axes (`tensor` under the
    default rules: Megatron) remains. Equals `params_per_device` without FSDP."""
    batch_axes = set(mesh.axes_of(A.BATCH, params=False))
    total = 0
    for shape, names in param_shapes(m).values():
        dims = mesh.dim_axes(names, mesh.rule_set.params)
        total += math.prod(-(-s // math.prod(mesh.sizes[a] for a in axes if a not in batch_axes))
                           for s, axes in zip(shape, dims))
    return total


LAYER_WEIGHTS = ("blocks.attn.q_dnh", "blocks.attn.k_dkh", "blocks.attn.v_dkh", "blocks.attn.o_nhd",
                 "blocks.mlp.gate_df", "blocks.mlp.up_df", "blocks.mlp.down_fd")
# Every per-layer parameter (the matmul weights and the two RMSNorm scales): what the backward
# scan stacks its gradients into.
LAYER_PARAMS = LAYER_WEIGHTS + ("blocks.attn_norm.scale", "blocks.mlp_norm.scale")


def head_weight_name(m: ModelConfig) -> str:
    """The parameter the output head multiplies by: its own [D, V], or the tied embedding table."""
    return "embed.table_vd" if m.tie_embeddings else "head_dv"


def weight_elems_per_device(m: ModelConfig, mesh: MeshShape, names: Sequence[str], *, gathered: bool) -> int:
    """Elements of the named parameters on one device: as stored (sharded by the rule set's
    params mapping), or, `gathered`, as the matmuls read them, after FSDP's all-gather over the
    mesh axes that also split the batch (only the other splits, Megatron's `tensor`, remain).
    For tensors derived from a parameter elementwise (its cast to the compute dtype), the same:
    an elementwise op keeps its operand's sharding."""
    shapes = param_shapes(m)
    batch_axes = set(mesh.axes_of(A.BATCH, params=False)) if gathered else set()
    total = 0
    for name in names:
        shape, logical = shapes[name]
        dims = mesh.dim_axes(logical, mesh.rule_set.params)
        total += math.prod(-(-s // math.prod(mesh.sizes[a] for a in axes if a not in batch_axes))
                           for s, axes in zip(shape, dims))
    return total


def is_fsdp(m: ModelConfig, mesh: MeshShape, names: Sequence[str] = LAYER_WEIGHTS) -> bool:
    """Are these parameters split over a mesh axis that also splits the batch (so all-gathered
    before use [HSM-TR])?"""
    return weight_elems_per_device(m, mesh, names, gathered=True) != weight_elems_per_device(m, mesh, names,
                                                                                           gathered=False)


def divisibility_errors(m: ModelConfig, mesh: MeshShape) -> list[str]:
    """Parameters whose sharded dims the mesh cannot divide (scaling.sharding.params.spec_for)."""
    errors = []
    for pname, (shape, names) in param_shapes(m).items():
        for s, k, n in zip(shape, mesh.shards(names, mesh.rule_set.params), names):
            if s % k:
                errors.append(f"{pname}: {n}={s} not divisible by {k}")
    return errors


# ----------------------------------------------------------------------------- FLOPs


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    dense: float  # matmuls against weights (projections, MLP, output head)
    attention: float  # q·k^T and probs·v
    six_n: float  # Kaplan et al.'s 6N approximation, beside it for comparison

    @property
    def total(self) -> float:
        return self.dense + self.attention


def matmul_params(m: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup does not; a tied
    head does, as x·E^T)."""
    return m.num_layers * layer_matmul_params(m) + m.hidden_size * m.vocab_size


def attention_flops_per_token(m: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Forward q·k^T and probs·v: 2·T·N·H each per token per layer, 4·T·N·H·L [HSM-T];
    a causal flash kernel skips the masked half."""
    f = 4.0 * seq_len * m.num_heads * m.resolved_head_dim * m.num_layers
    return f / 2 if causal else f


def flops_per_token(m: ModelConfig, seq_len: int, *, training: bool = True, causal: bool = True) -> FlopsPerToken:
    """Model FLOPs per token.

    Forward dense: 2 FLOPs per weight per token (one multiply, one add) [HSM-T]. Attention
    forward: 4·T·N·H·L, halved when causal (what a flash kernel does; PaLM [PaLM] appendix B
    counts the unhalved 12·L·N·H·T for training). Training is 3x forward (backward = 2x
    forward: gradients w.r.t. activations and w.r.t. weights) [HSM-T]. `six_n` is Kaplan's
    6N (2N for inference) over all parameters, embedding included [K20].
    """
    mult = 3 if training else 1
    dense = 2 * matmul_params(m) * mult
    attention = attention_flops_per_token(m, seq_len, causal=causal) * mult
    six_n = (6 if training else 2) * param_count(m)
    return FlopsPerToken(float(dense), float(attention), float(six_n))


def recompute_flops_per_token(m: ModelConfig, seq_len: int, policy: RematPolicyName, names: Sequence[str] = (),
                              *, causal: bool = True) -> float:
    """Extra forward FLOPs that rematerialisation spends per token (hardware, not model, FLOPs).

    full: the layer forward again but the down projection: JAX's rematerialisation re-runs
    only the forward ops whose outputs the backward reads (jax.checkpoint's partial evaluation
    drops the rest as dead code), and the down projection's output only feeds the residual add
    that makes the layer output, which no backward op reads (its backward needs its input h
    and the weight). XLA's cost analysis agrees (tests/test_accounting_xla.py); [K22]'s full
    recomputation, in PyTorch, re-runs it. dots / selective: the attention core (its inputs,
    the projections, are saved; [K22] selective recomputation). names/offload: the core, plus
    any projection whose tag is not kept (its output is needed by the backward pass).
    """
    from scaling import layers as T  # tags only

    recomputed_dense = 2 * (layer_matmul_params(m) - m.mlp_dim * m.hidden_size)  # all but the down projection
    core = attention_flops_per_token(m, seq_len, causal=causal)
    if policy == RematPolicyName.none:
        return 0.0
    if policy == RematPolicyName.full:
        return float(recomputed_dense * m.num_layers + core)
    if policy in (RematPolicyName.dots, RematPolicyName.selective):
        return float(core)
    d, n, k, h, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim
    cost = {T.QUERY_PROJ: d * n * h, T.KEY_PROJ: d * k * h, T.VALUE_PROJ: d * k * h, T.OUT_PROJ: n * h * d,
            T.MLP_GATE: d * f, T.MLP_UP: d * f}
    kept = set(names)
    dense = sum(2 * c for tag, c in cost.items() if tag not in kept) * m.num_layers
    return float(dense + core)


def recomputes_out_proj(policy: RematPolicyName, names: Sequence[str] = ()) -> bool:
    """Does the backward re-run the attention output projection? (Its output, added to the
    layer input, is the MLP's input, which the MLP's backward reads.) full saves nothing;
    dots / selective / none keep it; names / offload keep it only when tagged."""
    from scaling import layers as T  # tags only

    if policy == RematPolicyName.full:
        return True
    if policy in (RematPolicyName.names, RematPolicyName.offload):
        return T.OUT_PROJ not in names
    return False


# ------------------------------------------------------------------------ activations


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor the backward pass keeps, per token (times B·T) unless `per_token` is False."""

    name: str
    elems: int  # elements per token (or in total, when per_token is False)
    nbytes: int  # bytes per element
    tp_axis: str | None = None  # the logical activation axis a tensor-parallel mesh splits
    per_token: bool = True
    # A weight-shaped tensor (not per token): "layer" (one layer's matmul weights, LAYER_WEIGHTS)
    # or "head" (the output head's weight). `activation_bytes` splits it like the parameters
    # (a saved residual: the cast of each device's shard) or as the matmuls read it (all-gathered
    # over FSDP's axes, `weight_elems_per_device`), not by `tp_axis`.
    weights: str = ""

    def bytes(self, tokens: int, tp_split: int = 1) -> float:
        n = self.elems * self.nbytes * (tokens if self.per_token else 1)
        return n / tp_split


def is_flash(impl: AttentionImpl, hw: Hardware | None) -> bool:
    """Does the attention core avoid materialising [T, T] probabilities? (attention.resolve_impl:
    auto is ours or cuDNN on a GPU, both flash kernels, the xla reference elsewhere)."""
    if impl == AttentionImpl.auto:
        return hw is not None and not hw.name.startswith("TPU")
    return impl in (AttentionImpl.cudnn, AttentionImpl.pallas)


def layer_residuals(m: ModelConfig, seq_len: int, policy: RematPolicyName, names: Sequence[str] = (), *,
                    c: int, p: int = 4, flash: bool = False) -> list[Residual]:
    """What one layer keeps for the backward pass under `policy`, per token.

    Mirrors JAX's residuals for the Block in scaling/model.py (checked by
    tests/test_accounting.py against jax.ad_checkpoint.saved_residuals):
      - every policy keeps the layer input x (the scan carry; `full` keeps only that);
      - dots == selective here: the dots without batch dims are exactly the q/k/v, out,
        gate and up projections (the down projection only feeds a residual add, so the
        backward pass never reads it);
      - none keeps everything: each RMSNorm's f32 input and normalised value plus its output
        in c, rsqrt stats, post-RoPE q and k, v, the attention probabilities (f32 and their
        cast to c) or, for a flash core, its output and log-sum-exp, the core output, six
        [F] tensors of the SwiGLU, and (when c != p) the c-cast of the layer's weights (each
        device's shard: sharded like the parameters).
    """
    from scaling import layers as T

    d, n, k, h, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim
    x_in = Residual("layer input x", d, c)
    tagged = {
        T.QUERY_PROJ: Residual(T.QUERY_PROJ, n * h, c, A.ACT_HEADS),
        T.KEY_PROJ: Residual(T.KEY_PROJ, k * h, c, A.ACT_KV_HEADS),
        T.VALUE_PROJ: Residual(T.VALUE_PROJ, k * h, c, A.ACT_KV_HEADS),
        T.ATTENTION_OUT: Residual(T.ATTENTION_OUT, n * h, c, A.ACT_HEADS),
        T.OUT_PROJ: Residual(T.OUT_PROJ, d, c),
        T.MLP_GATE: Residual(T.MLP_GATE, f, c, A.ACT_MLP),
        T.MLP_UP: Residual(T.MLP_UP, f, c, A.ACT_MLP),
    }
    if policy == RematPolicyName.full:
        return [x_in]
    if policy in (RematPolicyName.dots, RematPolicyName.selective):
        keep = [t for t in tagged if t != T.ATTENTION_OUT]
        return [x_in] + [tagged[t] for t in keep]
    if policy == RematPolicyName.names:
        return [x_in] + [tagged[t] for t in tagged if t in names]
    if policy == RematPolicyName.offload:
        return [x_in]  # the tagged tensors live in host memory (host_residuals)
    # none: everything autodiff needs.
    out = []
    for norm in ("attn_norm", "mlp_norm"):
        out += [
            Residual(f"{norm} input (f32)", d, F32) if c != F32 else Residual(f"{norm} input", d, c),
            Residual(f"{norm} x·rsqrt (f32)", d, F32),
            Residual(f"{norm} output", d, c),
            Residual(f"{norm} stats (f32)", 2, F32),
            Residual(f"{norm} scale broadcast", d, F32, per_token=False),
        ]
    out += [
        Residual("q after RoPE", n * h, c, A.ACT_HEADS),
        Residual("k after RoPE", k * h, c, A.ACT_KV_HEADS),
        tagged[T.VALUE_PROJ],
        tagged[T.ATTENTION_OUT],
    ]
    if flash:
        out.append(Residual("attention log-sum-exp (f32)", n, F32, A.ACT_HEADS))
    else:
        out += [
            Residual("attention probabilities (f32)", n * seq_len, F32, A.ACT_HEADS),
            Residual("attention probabilities (cast)", n * seq_len, c, A.ACT_HEADS),
            Residual("softmax max and sum (f32)", 2 * n, F32, A.ACT_HEADS),
        ]
    out += [Residual(f"SwiGLU [F] #{i}", f, c, A.ACT_MLP) for i in range(6)]
    if c != p:
        # Each device casts its own shard (an elementwise op keeps its operand's sharding): the
        # saved cast is sharded like the parameters, 1/(fsdp x tensor) of the layer under the
        # default rules, not the whole layer (XLA's shardings of the saved residuals and the
        # forward scan's outputs in the compiled step: tests/test_accounting_xla.py).
        out.append(Residual("weights cast to compute dtype", layer_matmul_params(m), c, per_token=False,
                            weights="layer"))
    return out


def host_residuals(m: ModelConfig, policy: RematPolicyName, names: Sequence[str], *, c: int) -> list[Residual]:
    """offload: the tagged tensors moved to pinned host memory instead of kept in HBM."""
    if policy != RematPolicyName.offload:
        return []
    return [r for r in layer_residuals(m, 0, RematPolicyName.names, names, c=c) if r.name != "layer input x"]


def head_residuals(m: ModelConfig, *, c: int, p: int = 4, chunk_tokens: float = 0,
                   fsdp: bool = False) -> list[Residual]:
    """What is live while the loss and the output head are differentiated, beyond the saved
    layer stack: the final RMSNorm's residuals (as in a layer), token ids and targets, the
    head weight as the head's backward reads it, and the loss's own buffers:
      - one-pass loss (train.loss_chunk = 0): the f32 logits [B, T, V] and their f32 gradient
        (softmax - one-hot; scaling.train.cross_entropy computes in f32). Two [B, T, V] f32
        buffers, not three: XLA keeps either the logits or exp(logits) for the backward, never
        both, and writes the gradient into a second buffer (XLA:CPU's live ranges at the peak;
        tests/test_remat.py);
      - chunked loss (scaling.train.chunked_cross_entropy, `chunk_tokens` = rows x chunk
        positions): it runs in the forward pass (a custom VJP that forms the head's gradients
        chunk by chunk), so no gradient buffer exists yet. Live: the f32 dx [B, T, D] it
        fills, and the larger of (one chunk's f32 logits + their c gradient + the f32 dW
        [D, V] accumulator) and (the accumulation dW + x^T·dlogits: three [D, V] f32
        buffers, the chunk's logits dead by then); XLA:CPU's live ranges at the peak.
    The head weight as the head's matmuls read it, [D, V/tensor] per device (`weights="head"`:
    all-gathered over FSDP's axes, split over `tensor` like the logits): its c-cast when c != p
    (live at the head phase's peak in an H200 compile, bf16, one device); when c == p, the
    all-gather's output under FSDP, else the parameter itself (state, not counted here).
    XLA:CPU instead converts the cast back to f32 for the one-pass loss's f32 backward matmuls
    (under FSDP: all-gathers the f32 weight again), a [D, V] f32 buffer in place of the c-cast.
    """
    d, v = m.hidden_size, m.vocab_size
    out = [
        Residual("final norm input (f32)", d, F32) if c != F32 else Residual("final hidden state", d, c),
        Residual("final norm x·rsqrt (f32)", d, F32),
        Residual("final norm output", d, c),
        Residual("final norm stats (f32)", 2, F32),
        Residual("token ids, targets", 2, 4),
    ]
    if chunk_tokens:
        chunk = int(chunk_tokens * v * (F32 + c) + d * v * F32)
        out += [
            Residual("dx accumulator (f32)", d, F32),
            Residual("max(chunk logits + gradient + dW, 3 dW)", max(chunk, 3 * d * v * F32), 1, A.ACT_VOCAB,
                     per_token=False),
        ]
    else:
        out += [
            Residual("logits (f32)", v, F32, A.ACT_VOCAB),
            Residual("logits gradient (f32)", v, F32, A.ACT_VOCAB),
        ]
    if c != p:
        out.append(Residual("head weight cast", d * v, c, per_token=False, weights="head"))
    elif fsdp:
        out.append(Residual("head weight all-gathered", d * v, p, per_token=False, weights="head"))
    return out


def layer_weights_in_use(m: ModelConfig, *, c: int, p: int = 4, fsdp: bool = False) -> list[Residual]:
    """One layer's weights as its matmuls read them, live while that layer is differentiated:
    its slice of the stacked [L, ...] parameters, all-gathered over FSDP's axes [HSM-TR] (ZeRO-3
    gathers one layer's parameters at a time and frees them after use: Rajbhandari et al. 2020,
    "ZeRO", sec. 5.3, parameter partitioning) and split over `tensor` only, in the compute dtype:
      - c != p: the c-cast (the f32 all-gather output it is cast from is dead by the layer's peak);
      - c == p under FSDP: the all-gather's output;
      - c == p without FSDP: nothing new, the matmuls read the stacked parameter in place (an H200
        compile keeps no slice; XLA:CPU copies the slice out, a buffer the GPU does not keep).
    XLA:CPU's live ranges at the layer backward's peak (8 devices, fsdp=8, f32 and bf16) hold
    all of them but the down projection's, whose backward runs first."""
    if c == p and not fsdp:
        return []
    return [Residual("layer weights as the matmuls read them", layer_matmul_params(m), c, per_token=False,
                     weights="layer")]


def backward_temporaries(m: ModelConfig, *, c: int) -> list[Residual]:
    """The backward pass's own buffers at its widest point, the SwiGLU backward: the gradients
    of the gate and up projections' outputs, [F] each, while the layer's residuals are live."""
    return [Residual("SwiGLU gate/up gradients", 2 * m.mlp_dim, c, A.ACT_MLP)]


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one micro-batch, per device, in the two phases of the backward pass.

    A training step's activation memory is not one sum. The backward pass runs in phases
    that are live at different times:
      1. loss and output head: the f32 logits and their gradient (`head`), with every layer's
         saved residuals (`layers`) still waiting;
      2. the layer backward (a reverse scan): one layer at a time has its complete residual
         set live (sliced from the stack or recomputed), its weights as the matmuls read them
         (all-gathered under FSDP) and the backward's temporaries (`working_layer`); the head's
         buffers are dead by then.
    So the activation peak is `layers + max(head, working_layer)`: the largest transient, not
    the sum of all of them (checked on CPU by varying the vocabulary: XLA's peak follows the
    larger phase and does not grow with the smaller, tests/test_accounting.py).
    """

    per_layer: float  # saved per layer (device memory)
    layers: float  # all L layers: the saved stack
    head: float  # transient, phase 1: final norm, f32 logits + gradient, head weight (FSDP: gathered)
    working_layer: float  # transient, phase 2: one layer's complete residual set, its weights, backward temporaries
    host: float = 0.0  # offloaded to host memory (not in HBM)

    @property
    def total(self) -> float:
        """The activation peak: saved stack + the larger of the two transients."""
        return self.layers + max(self.head, self.working_layer)


def activation_bytes(m: ModelConfig, seq_len: int, batch: int, policy: RematPolicyName, names: Sequence[str] = (),
                     *, c: int, p: int = 4, flash: bool = False, mesh: MeshShape = MeshShape(),
                     loss_chunk: int = 0) -> ActivationBytes:
    """Activation bytes of one micro-batch of `batch` sequences, per device under `mesh`.

    Batch splits over the rule set's batch axes; tensors whose axis the rule set maps to
    `tensor` split over it; [B, T, D] tensors are replicated over `tensor` (Megatron without
    sequence parallelism [K22]). Weight-shaped tensors (`Residual.weights`) split like the
    parameters where saved (the `none` policy's weight casts) and as the matmuls read them,
    all-gathered over FSDP's axes, where in use (`weight_elems_per_device`). The saved stack is
    `layer_residuals` x L; the layer under differentiation holds the activations of
    `layer_residuals(policy=none)` (every residual the backward reads, whichever policy saved
    or recomputed it), its weights as the matmuls read them (`layer_weights_in_use`) and
    `backward_temporaries`; the head phase holds `head_residuals`. See ActivationBytes for how
    they combine.
    """
    tokens = batch * seq_len / mesh.split(A.BATCH)
    weight_names = {"layer": LAYER_WEIGHTS, "head": (head_weight_name(m),)}

    def total(rs, gathered=False):
        out = 0.0
        for r in rs:
            if r.weights:  # the full tensor's elems, scaled to what one device holds
                names_ = weight_names[r.weights]
                full = weight_elems_per_device(m, MeshShape(), names_, gathered=False)
                out += r.bytes(tokens) * weight_elems_per_device(m, mesh, names_, gathered=gathered) / full
            else:
                out += r.bytes(tokens, mesh.split(r.tp_axis) if r.tp_axis else 1)
        return out

    per_layer = total(layer_residuals(m, seq_len, policy, names, c=c, p=p, flash=flash))
    working = total([r for r in layer_residuals(m, seq_len, RematPolicyName.none, c=c, p=p, flash=flash)
                     if not r.weights])
    working += total(layer_weights_in_use(m, c=c, p=p, fsdp=is_fsdp(m, mesh)), gathered=True)
    working += total(backward_temporaries(m, c=c))
    host = total(host_residuals(m, policy, names, c=c)) * m.num_layers
    chunk_tokens = tokens * loss_chunk / seq_len
    head_fsdp = is_fsdp(m, mesh, (head_weight_name(m),))
    head = total(head_residuals(m, c=c, p=p, chunk_tokens=chunk_tokens, fsdp=head_fsdp), gathered=True)
    return ActivationBytes(per_layer, per_layer * m.num_layers, head, working, host)


def kv_cache_bytes(m: ModelConfig, batch: int, seq_len: int, *, c: int = 2) -> float:
    """Decode KV cache: 2 (K and V) · L · K · H · T · B · c bytes [HSM-I]."""
    return 2.0 * m.num_layers * m.num_kv_heads * m.resolved_head_dim * seq_len * batch * c


# -------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class MemoryBytes:
    """Training-step memory per device, phase by phase.

    Live through the whole step: params and AdamW moments (the donated state) and, with grad
    accumulation, the f32 sum of the grads. Gradients come into existence during the
    backward pass: the output head's (and final norm's) in the head phase, the stacked layers'
    when the backward scan starts (its outputs), the embedding's after it (a scatter-add).
    `eager_grads` (XLA:CPU's schedule, seen in its buffer live ranges) allocates all of them
    before the head phase instead. A chunked loss (`loss_in_forward`) runs its head phase in
    the forward pass, before any gradient. The peak is the largest phase:

      head phase   = state + accum + head grads (all, if eager) + saved stack + head transient
      layer phase  = state + accum + all grads but the embedding's (all, if eager) + stack + layer working set
      update phase = state + accum + all grads (the fused AdamW update writes in place)
    """

    params: float
    grads: float  # all gradients of one micro-batch (parameter dtype)
    optimizer: float
    activations: ActivationBytes
    grads_head: float = 0.0  # output head + final norm (tied: the final norm only)
    grads_embed: float = 0.0  # embedding table (tied: 0; its grad arrives with the head's)
    accumulator: float = 0.0  # grad accumulation's running sum
    eager_grads: bool = False
    loss_in_forward: bool = False  # chunked loss: the head phase runs before any gradient exists

    @property
    def phases(self) -> dict[str, float]:
        state = self.params + self.optimizer + self.accumulator
        act = self.activations
        head_grads = 0.0 if self.loss_in_forward else self.grads if self.eager_grads else self.grads_head
        layer_grads = self.grads if self.eager_grads else self.grads - self.grads_embed
        return {
            "loss and output head": state + head_grads + act.layers + act.head,
            "layer backward": state + layer_grads + act.layers + act.working_layer,
            "optimizer update": state + self.grads,
        }

    @property
    def peak_phase(self) -> str:
        phases = self.phases
        return max(phases, key=phases.get)

    @property
    def total(self) -> float:
        """Predicted peak bytes per device: the largest phase."""
        return max(self.phases.values())


def micro_batch(batch: int, grad_accum: int) -> int:
    """Sequences per micro-batch. (A grad_accum that did not divide the batch was floored
    silently: batch 8 over 3 micro-batches priced 2 sequences each, 6 in all.)"""
    if grad_accum < 1 or batch % grad_accum:
        raise ValueError(f"grad_accum={grad_accum} must be >= 1 and divide train.batch_size={batch}")
    return batch // grad_accum


def moment_bytes(p: int) -> int:
    """Bytes of an AdamW moment element for params of `p` bytes: float32 at least
    (`optim.float32_moments`; in bf16 the second moment does not decay at b2 = 0.999)."""
    return max(p, F32)


def training_memory(cfg: Config, mesh: MeshShape, *, accelerator: bool = True, hw: Hardware | None = None,
                    policy: RematPolicyName | None = None, grad_accum: int | None = None,
                    batch_size: int | None = None) -> MemoryBytes:
    """Params, grads and AdamW state per device plus one micro-batch's activations, by phase.

    AdamW (optax.adamw in scaling/optim.py) keeps two moments, float32 whatever the param
    dtype (`moment_bytes`); the parameters are the master copy and the compute dtype is a
    per-use cast, so there is no separate master copy: 4 + 4 + 8 = 16 bytes per parameter with
    f32 params [HSM-TR], 2 + 2 + 8 = 12 with bf16 params.
    Grad accumulation keeps an f32 sum of grads beside the micro-batch grads.
    `accelerator=False` prices the CPU: `auto` compute is f32 and gradients are allocated
    eagerly (MemoryBytes).
    """
    m = cfg.model
    p = dtype_bytes(m.param_dtype)
    c = dtype_bytes(m.compute_dtype, accelerator=accelerator)
    policy = cfg.remat.policy if policy is None else policy
    accum = cfg.train.grad_accum if grad_accum is None else grad_accum
    batch = cfg.train.batch_size if batch_size is None else batch_size
    n_dev = params_per_device(m, mesh)
    micro = micro_batch(batch, accum)
    act = activation_bytes(m, cfg.train.seq_len, micro, policy, cfg.remat.names, c=c, p=p,
                           flash=is_flash(cfg.attention.impl, hw), mesh=mesh, loss_chunk=cfg.train.loss_chunk)
    shapes = param_shapes(m)

    def dev_elems(name):
        shape, names = shapes[name]
        return math.prod(-(-s // k) for s, k in zip(shape, mesh.shards(names, mesh.rule_set.params)))

    if not accelerator and act.host:
        # The CPU's pinned_host memory space is its own RAM: XLA counts offloaded residuals there.
        act = dataclasses.replace(act, layers=act.layers + act.host)
    head = dev_elems("final_norm.scale") + (dev_elems("head_dv") if "head_dv" in shapes else 0)
    embed = 0 if m.tie_embeddings else dev_elems("embed.table_vd")
    if m.tie_embeddings:
        head += dev_elems("embed.table_vd")
    return MemoryBytes(n_dev * p, n_dev * p, 2 * n_dev * moment_bytes(p), act, head * p, embed * p,
                       n_dev * p if accum > 1 else 0.0, eager_grads=not accelerator,
                       loss_in_forward=cfg.train.loss_chunk > 0)


# ------------------------------------------------------------------- communication


@dataclasses.dataclass(frozen=True)
class Collective:
    axis: str
    kind: str  # all-gather, reduce-scatter, all-reduce
    what: str
    bytes: float  # the full (unsharded over `axis`) array size, per device, per step
    seconds: float


def axis_bandwidth(axis: str, mesh: MeshShape, hw: Hardware) -> float:
    """Per-device bandwidth of a ring over `axis`. jax.make_mesh puts the last mesh axis on
    the nearest devices, so an axis stays inside a node when its size times the sizes of the
    axes after it fits in one node; otherwise it crosses the network (DCN / NIC)."""
    order = ("data", "fsdp", "tensor")
    inner = math.prod(mesh.sizes[a] for a in order[order.index(axis):])
    return hw.ring_bandwidth if inner <= hw.devices_per_node else hw.dcn_bandwidth


COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def collective_seconds(kind: str, nbytes: float, n: int, bw: float) -> float:
    """Ring collective over n devices: AllGather / ReduceScatter move (n-1)/n of the array
    through each device, AllReduce twice that [HSM-S]. AllToAll of a device's `nbytes`: it
    keeps 1/n and sends the rest, (n-1)/n, priced at the link rate of a switched GPU network
    (the book's 1/4 of an AllGather is for a bidirectional TPU ring, [HSM-S])."""
    if kind not in COLLECTIVE_KINDS:  # ("allreduce" was priced as an all-gather, half the time)
        raise ValueError(f"collective kind {kind!r} is not one of: {', '.join(COLLECTIVE_KINDS)}")
    if n <= 1:
        return 0.0
    factor = 2.0 if kind == "all-reduce" else 1.0
    return factor * (n - 1) / n * nbytes / bw


def training_comms(cfg: Config, mesh: MeshShape, hw: Hardware, *, accelerator: bool = True,
                   policy: RematPolicyName | None = None, grad_accum: int | None = None,
                   batch_size: int | None = None) -> list[Collective]:
    """Collectives per training step, per mesh axis.

    FSDP (params over an axis that also splits the batch): AllGather each layer's weights
    forward, again backward, ReduceScatter the grads [HSM-TR]. Replicated-param batch axes
    (data parallel): AllReduce of the (FSDP-sharded) grads. Over several batch axes at once
    (`fsdp` rules with tensor > 1, `dp` rules over two or three axes) one collective spans
    them all: it is priced as one stage per axis, innermost first, each on what the stages
    before it left ((N-1)/N of the array in all, not (n-1)/n of it per axis). Tensor parallel (Megatron):
    2 AllReduces of [B, T, D] per layer forward (after the out and down projections) and 2
    backward (grads of the q/k/v and gate/up inputs) [HSM-TR, K22]; a policy that recomputes the
    out projection (`full`; `names`/`offload` without out_proj) re-runs its AllReduce, once:
    JAX recomputes only what the backward reads, and the down projection's output (summed into
    the layer output) is read by nothing (`recompute_flops_per_token`; XLA:CPU's compiled step,
    tests/test_accounting_xla.py).

    Outside the layers, as XLA:GPU partitions them [XLA-GPU]:
      - the output head is gathered like a layer (forward, backward); with the chunked loss
        (train.loss_chunk) once per chunk instead, forward and backward together;
      - the embedding lookup over a table split along D by batch axes is an AllToAll of the
        [B, T, D] activations, forward and backward, not a gather of the table (its gradient
        needs no reduction there); a table split along the vocabulary by `tensor` is looked up
        in pieces and the [B, T, D] result all-reduced; a tied table is also gathered and
        reduced like the head;
      - a vocabulary split by `tensor` all-reduces the head's f32 input gradient [B, T, D]
        (the loss's [B, T] softmax statistics are D times smaller and left out).

    Dtypes. On an accelerator [XLA-GPU]: each weight shard is cast to the compute dtype before
    it is gathered; a matmul's weight gradient (the layers', the embedding's) leaves it in the
    compute dtype and is reduced in it; the head's gradient comes from the loss's f32 backward
    and the norm scales' from the f32 norm, and are reduced in f32, bf16 parameters or not.
    With accelerator=False (XLA:CPU, which computes bf16 in f32, tests/test_accounting_xla.py)
    weights and gradients move in the parameter dtype.

    Grad accumulation (scaling/train.py scans over micro-batches, each with its own forward
    and backward): every collective happens once per micro-batch, except the data-parallel
    AllReduces of the parameters outside every scan (the embedding, the one-pass loss's head,
    the final norm, untied): XLA sums those gradients over the micro-batches first and
    reduces them once [XLA-GPU].
    """
    m = cfg.model
    p = dtype_bytes(m.param_dtype)
    c = dtype_bytes(m.compute_dtype, accelerator=accelerator)
    weight_b = min(p, c) if accelerator else p  # gathered weights
    matmul_grad_b = min(p, c) if accelerator else p  # layers' and embedding's gradients
    f32_grad_b = F32 if accelerator else p  # head's and norm scales' gradients (f32 even with bf16 params)
    policy = cfg.remat.policy if policy is None else policy
    accum = cfg.train.grad_accum if grad_accum is None else grad_accum
    micro = micro_batch(cfg.train.batch_size if batch_size is None else batch_size, accum)
    chunk = cfg.train.loss_chunk
    # One-pass loss: the head is gathered for the logits and again for their backward, except
    # in f32, where XLA:GPU keeps the forward's gather (1b and 350m) [XLA-GPU].
    head_gathers = cfg.train.seq_len // chunk if chunk else (1 if accelerator and c == F32 else 2)
    rules = mesh.rule_set
    order = A.MESH_AXES  # jax.make_mesh puts the last axis on the nearest devices
    batch_axes = mesh.axes_of(A.BATCH, params=False)
    act_elems = micro * cfg.train.seq_len / mesh.split(A.BATCH) * m.hidden_size  # one [B, T, D] per device
    # (axis, kind, what) -> bytes per step. A collective over several axes runs as one stage per
    # axis, the innermost (fastest link) first on the whole array, each next on what is left:
    # a reduce-scatter over the inner axis leaves 1/n of the array for the outer one (an
    # all-gather is the mirror image), so the bytes add up to one ring over all the axes,
    # (N-1)/N of the array, and the slow outer links carry the least.
    total: dict[tuple[str, str, str], float] = {}

    def add(axis: str, kind: str, what: str, nbytes: float) -> None:
        total[(axis, kind, what)] = total.get((axis, kind, what), 0.0) + nbytes

    inner_first = sorted(batch_axes, key=order.index, reverse=True)
    for name, (shape, names) in param_shapes(m).items():
        dims = mesh.dim_axes(names, rules.params)
        shard = math.prod(-(-s // math.prod(mesh.sizes[a] for a in axes)) for s, axes in zip(shape, dims))
        sharded_over = {a for axes in dims for a in axes}
        table, head = name == "embed.table_vd", name == "head_dv" or (name == "embed.table_vd" and m.tie_embeddings)
        # Data-parallel reductions XLA hoists out of the micro-batch loop: the gradients of the
        # params outside every scan. Not the layers', the chunked loss's head (its chunk scan
        # accumulates it), nor a tied table's (two uses summed) [XLA-GPU].
        per_micro = name.startswith("blocks.") or (head and (chunk or m.tie_embeddings))
        matmul = name.startswith("blocks.") and not name.endswith(".scale") or table
        # (gathers per micro-batch, gradient bytes per element) for each way the param is used
        uses = []
        if head:
            uses.append((head_gathers, f32_grad_b))
        if table:
            uses.append((0, matmul_grad_b))  # the lookup: no gather, its gradient summed over data axes
        elif not head:
            uses.append((2, matmul_grad_b if matmul else f32_grad_b))
        for gathers, grad_b in uses:
            # FSDP: the param is split over these batch axes: gather it, reduce-scatter its grad.
            size = shard * math.prod(mesh.sizes[a] for a in batch_axes if a in sharded_over)
            for a in (a for a in inner_first if a in sharded_over):
                if gathers == 2:  # one-pass: forward, and again in the backward
                    add(a, "all-gather", "weights (forward)", size * weight_b * accum)
                    add(a, "all-gather", "weights (backward re-gather)", size * weight_b * accum)
                elif gathers:
                    add(a, "all-gather", f"head weight (per loss chunk) x{gathers}", size * weight_b * gathers * accum)
                if gathers:
                    add(a, "reduce-scatter", "grads", size * grad_b * accum)
                size /= mesh.sizes[a]
            # Data parallel: replicated over these batch axes: all-reduce its (sharded) grad.
            size = shard
            for a in (a for a in inner_first if a not in sharded_over):
                add(a, "all-reduce", "grads", size * grad_b * (accum if per_micro else 1))
                size /= mesh.sizes[a]
        if table:
            over = [a for a in inner_first if a in sharded_over]
            if over:  # the lookup's [B, T, D] all-to-all, forward and backward, on its slowest axis
                add("+".join(sorted(over, key=order.index)), "all-to-all", "embedding lookup [B,T,D] x2",
                    2 * act_elems * c * accum)
    t = mesh.sizes["tensor"]
    if t > 1 and "tensor" in rules.activations.get(A.ACT_MLP, ()):
        count = m.num_layers * (4 + (1 if recomputes_out_proj(policy, cfg.remat.names) else 0))
        add("tensor", "all-reduce", f"[B,T,D] activations x{count}", act_elems * c * count * accum)
    vocab_axes = set(a for axes in mesh.dim_axes((A.VOCAB,), rules.params) for a in axes) - set(batch_axes)
    for a in sorted(vocab_axes, key=order.index):
        add(a, "all-reduce", "embedding lookup [B,T,D]", act_elems * c * accum)
        add(a, "all-reduce", "head input grad [B,T,D] (f32)", act_elems * F32 * accum)

    out: list[Collective] = []
    for (axis, kind, what), nbytes in total.items():
        if not nbytes:
            continue
        axes = axis.split("+")
        n = math.prod(mesh.sizes[a] for a in axes)
        bw = axis_bandwidth(axes[0], mesh, hw)  # the outermost: the slowest link it crosses
        if kind == "all-reduce" and what == "grads" and any(k[0] == axis and k[1] == "all-gather" for k in total):
            what = "grads of replicated params"
        out.append(Collective(axis, kind, what, nbytes, collective_seconds(kind, nbytes, n, bw)))
    return sorted(out, key=lambda x: (order.index(x.axis.split("+")[-1]), COLLECTIVE_KINDS.index(x.kind)))


# ------------------------------------------------------------------------- roofline


@dataclasses.dataclass(frozen=True)
class Roofline:
    tokens_per_step: int
    model_flops: float  # per device per step (no recomputation)
    hardware_flops: float  # + recomputation
    hbm_bytes: float  # per device per step
    comm_seconds: float
    compute_seconds: float
    memory_seconds: float
    peak_flops: float

    @property
    def step_seconds(self) -> float:
        """Perfect overlap: the slowest of the three [HSM-R]."""
        return max(self.compute_seconds, self.memory_seconds, self.comm_seconds)

    @property
    def step_seconds_no_overlap(self) -> float:
        return self.compute_seconds + self.memory_seconds + self.comm_seconds

    @property
    def bound(self) -> str:
        times = {"compute": self.compute_seconds, "memory": self.memory_seconds, "communication": self.comm_seconds}
        return max(times, key=times.get)

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per HBM byte [HSM-R]."""
        return self.hardware_flops / self.hbm_bytes if self.hbm_bytes else math.inf

    @property
    def mfu(self) -> float:
        """Predicted MFU ceiling: model FLOPs over peak for the overlapped step time [PaLM]."""
        return self.model_flops / (self.peak_flops * self.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


def training_roofline(cfg: Config, mesh: MeshShape, hw: Hardware, *, policy: RematPolicyName | None = None,
                      grad_accum: int | None = None) -> Roofline:
    """Step time bounds for one optimizer step.

    Compute: (model + recompute) FLOPs / peak. Memory (HBM traffic, a lower bound): weights
    read in the compute dtype forward and twice backward (per micro-batch; under FSDP the
    all-gathered weights, `gathered_params_per_device`, which are what the matmuls read), saved
    activations written once and read once, logits written and read in f32, and AdamW
    reading params, grads and two moments and writing params and moments (3 param-sized
    passes and 4 of the float32 moments). Communication: `training_comms`, axes not overlapped
    with each other.
    """
    m = cfg.model
    policy = cfg.remat.policy if policy is None else policy
    accum = cfg.train.grad_accum if grad_accum is None else grad_accum
    tokens = cfg.train.batch_size * cfg.train.seq_len
    dev = mesh.devices
    f = flops_per_token(m, cfg.train.seq_len)
    model_flops = f.total * tokens / dev
    hw_flops = model_flops + recompute_flops_per_token(m, cfg.train.seq_len, policy, cfg.remat.names) * tokens / dev
    mem = training_memory(cfg, mesh, hw=hw, policy=policy, grad_accum=accum)
    p = dtype_bytes(m.param_dtype)
    c = dtype_bytes(m.compute_dtype)
    n_dev = mem.params / p
    gathered = gathered_params_per_device(m, mesh)
    act = mem.activations
    hbm = accum * (3 * gathered * c + 2 * (act.layers + act.head)) + (3 * p + 4 * moment_bytes(p)) * n_dev
    comms = sum(x.seconds for x in training_comms(cfg, mesh, hw, policy=policy, grad_accum=accum))
    return Roofline(tokens, model_flops, hw_flops, hbm, comms, hw_flops / hw.bf16_flops, hbm / hw.hbm_bandwidth,
                    hw.bf16_flops)


def critical_tokens_per_device(hw: Hardware, *, bytes_per_param: int = 2, rates: Rates | None = None
                               ) -> dict[str, float]:
    """Tokens per device above which a step is compute-bound [HSM-R, HSM-TR].

    HBM: a bf16 matmul of a [B, D] batch against a [D, F] weight does 2·B·D·F FLOPs over
    2·D·F weight bytes, so B > C / W_hbm. FSDP: 6·B·P FLOPs against 3 weight-sized
    collectives of P·b bytes, so B > b·C / (2·W_ici) (= C / W_ici for bf16) per axis.
    With `rates`, the same bounds at the achievable rates instead of the datasheet's: the matmul
    rate for C, the copy bandwidth for W_hbm, the measured in-node link rate for W_ici (the
    across-nodes line keeps the datasheet's NIC, which is unmeasured).
    """
    flops, hbm, ring = hw.bf16_flops, hw.hbm_bandwidth, hw.ring_bandwidth
    if rates is not None:
        flops, hbm, ring = rates.matmul, rates.hbm, rates.link or ring * hw.link_fraction
    return {
        "hbm": flops / hbm,
        "fsdp (intra-node)": bytes_per_param * flops / (2 * ring),
        "fsdp (across nodes)": bytes_per_param * flops / (2 * hw.dcn_bandwidth),
    }


# ------------------------------------------------------------------ calibrated time


@dataclasses.dataclass(frozen=True)
class Rates:
    """What kernels achieve on a device (measured), as opposed to the datasheet's peaks.

    matmul: FLOP/s of a large bf16 matmul (8192^3). attention: FLOP/s of the flash attention
    core forward + backward, counting 3 x the causal forward FLOPs (this module's convention,
    `attention_flops_per_token`). hbm: bytes/s of a device-to-device copy, read + write.
    host: bytes/s one way between device and pinned host memory (remat offload; 0 = unknown).
    f32_matmul: FLOP/s of matmuls with f32 inputs (TF32 tensor cores on NVIDIA, XLA's default
    precision): the one-pass loss's output-head backward multiplies f32 logit gradients.
    link: the per-device bandwidth at which `collective_seconds`' ring formula gives a
    collective's measured time inside a node (0 = the hardware table's link_fraction of it).
    """

    matmul: float
    attention: float
    hbm: float
    host: float = 0.0
    f32_matmul: float = 0.0  # f32-input matmuls (TF32 on NVIDIA GPUs); 0 = the bf16 rate
    source: str = ""
    link: float = 0.0  # collectives' achieved in-node ring bandwidth, bytes/s per device; 0 = the table's

    @classmethod
    def of(cls, hw: Hardware) -> Rates:
        """The hardware table's default achievable fractions (scaling/hardware.py says where
        each was measured)."""
        return cls(hw.bf16_flops * hw.matmul_fraction, hw.bf16_flops * hw.attention_fraction,
                   hw.hbm_bandwidth * hw.hbm_fraction, hw.host_bandwidth, hw.bf16_flops * hw.f32_matmul_fraction,
                   hw.calibration, hw.ring_bandwidth * hw.link_fraction)


def elementwise_bytes_per_token(m: ModelConfig, seq_len: int, *, c: int, flash: bool, tp: int = 1) -> dict[str, float]:
    """HBM bytes per token per layer of the memory-bound (non-matmul) kernels of one layer.

    XLA fuses each chain of elementwise ops between two matmuls into one kernel, which reads
    the chain's inputs and writes its outputs once; counted that way (in the compute dtype):
      forward  RMSNorm x2 (read x, write y: 2·D each), RoPE on q and k (2·(N+K)·H), residual
               adds x2 (read two, write one: 3·D each), SwiGLU silu(gate)·up (read 2·F, write F):
               10·D + 2·(N+K)·H + 3·F
      backward RMSNorm x2 (read x and dy, write dx: 3·D each), RoPE (2·(N+K)·H), residual
               adds x2 (sum two cotangents: 3·D each), SwiGLU (read gate, up, dh; write dgate,
               dup: 5·F): 12·D + 2·(N+K)·H + 5·F
    An XLA (non-flash) attention core adds its [N, T] softmax passes per token: forward
    read and write the f32 scores and write the probabilities in c ((8 + c)·N·T), backward
    twice that. A flash core keeps them on chip (its time is in the attention rate).
    Head- and MLP-sized tensors split over a tensor-parallel axis; [D] ones do not.
    """
    d, n, k, h, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim
    fwd = (10 * d + 2 * (n + k) * h / tp + 3 * f / tp) * c
    bwd = (12 * d + 2 * (n + k) * h / tp + 5 * f / tp) * c
    core = 0.0 if flash else (8 + c) * n * seq_len / tp
    return {"forward": fwd + core, "backward": bwd + 2 * core}


def recomputed_bytes_per_token(m: ModelConfig, seq_len: int, policy: RematPolicyName, names: Sequence[str] = (), *,
                               c: int, flash: bool, tp: int = 1) -> float:
    """HBM bytes per token per layer of the elementwise forward work a remat policy redoes in
    the backward (0 for `none`).

    JAX re-runs only the forward ops whose outputs the backward reads; no policy here saves an
    elementwise output, so each recomputes the same four, counted in c like
    `elementwise_bytes_per_token`:
      RMSNorm 1 (read x, write y: 2·D); the mid-layer residual add with RMSNorm 2 (read x and
      the out projection, write y: 3·D); RoPE on q and k (2·(N+K)·H); the SwiGLU product
      h = silu(gate)·up, the down projection's dW input. With gate and up saved (dots,
      selective, names/offload keeping both tags), XLA writes h as a third output of the SwiGLU
      backward's fusion, which reads gate and up anyway: F. With them recomputed by matmuls
      (full, or names/offload without both tags), h is a kernel of its own: read 2·F, write F.
    The layer's last residual add feeds nothing in the backward: not recomputed.
      dots: 5·D + 2·(N+K)·H + F;  full: 5·D + 2·(N+K)·H + 3·F
    An XLA (non-flash) core adds its forward softmax passes again ((8 + c)·N·T).
    Measured: H200 profiles of the 1b (8 x 2048) with each kernel placed by its op name
    (`rematted_computation` in JAX's name stack), docs/benchmarks.md "Fiftieth session": the
    recomputed kernels took 2.6 ms a step under dots and selective and 6.7 ms under full,
    against 4.2 and 7.2 ms here at the table's copy rate; the whole forward (10·D + 2·(N+K)·H +
    3·F, 9.0 ms), which this had been priced as, was 3.5x the measured dots recompute.
    """
    from scaling import layers as T  # tags only

    if policy == RematPolicyName.none:
        return 0.0
    d, n, k, h, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim
    mlp_saved = policy in (RematPolicyName.dots, RematPolicyName.selective) or (
        policy in (RematPolicyName.names, RematPolicyName.offload) and {T.MLP_GATE, T.MLP_UP} <= set(names))
    core = 0.0 if flash else (8 + c) * n * seq_len / tp
    return (5 * d + 2 * (n + k) * h / tp + (1 if mlp_saved else 3) * f / tp) * c + core


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A calibrated step time prediction: work divided by measured (achievable) rates.

    On one GPU the matmuls, the attention core and the memory-bound kernels are separate
    kernels on one stream: they run one after another, so their times add (the roofline's
    max() assumes a perfect overlap that a single stream cannot give). Every collective adds
    up too: tensor-parallel all-reduces between a layer's matmuls and the embedding's
    all-to-all by construction, FSDP's and data parallelism's as measured on 2 H200s (neither
    scanned nor unrolled layers hid them). In a node they run at the measured link rate
    (Rates.link). tests/test_accounting_gpu_collectives.py holds the bytes to XLA:GPU's and
    the 2-H200 step times to the single device's prediction ratio. (`comm_seconds`, the
    overlapped part, stays for a caller's own StepTime; training_time leaves it 0.) Remat offload's host transfers
    add to the compute: on an H200 (1b, batch 4) the offload step measured 314.0 ms against
    331.8 ms predicted with the transfers after the compute and 211.0 ms with them
    overlapped (experiments/bench_remat.py, docs/benchmarks.md): the backward waits for
    each layer's residuals to come back, and the copy engines share HBM with the kernels.
    """

    matmul_flops: float  # per device per step: c-input (bf16) matmuls incl. recomputation (and an XLA core's)
    attention_flops: float  # flash core: 3 x causal forward + recomputed forwards
    traffic: dict[str, float]  # HBM bytes per device per step of the memory-bound kernels, by source
    rates: Rates
    comm_seconds: float = 0.0  # collectives that overlap the compute (none measured so: training_time gives 0)
    host_bytes: float = 0.0  # device <-> host per step (both directions)
    f32_matmul_flops: float = 0.0  # matmuls with f32 inputs (the one-pass loss's head backward; all, f32 compute)
    serial_comm_seconds: float = 0.0  # collectives (all on the critical path: measured on 2 H200s)

    @property
    def matmul_seconds(self) -> float:
        f32 = self.f32_matmul_flops / (self.rates.f32_matmul or self.rates.matmul)
        return self.matmul_flops / self.rates.matmul + f32

    @property
    def attention_seconds(self) -> float:
        return self.attention_flops / self.rates.attention if self.attention_flops else 0.0

    @property
    def memory_seconds(self) -> float:
        return sum(self.traffic.values()) / self.rates.hbm

    @property
    def host_seconds(self) -> float:
        """Offload traffic: out in the forward, back in the backward, one way at a time."""
        return self.host_bytes / self.rates.host if self.host_bytes and self.rates.host else 0.0

    @property
    def compute_seconds(self) -> float:
        """The kernels of one stream, in order (+ collectives that sit between them)."""
        return self.matmul_seconds + self.attention_seconds + self.memory_seconds + self.serial_comm_seconds

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds + self.host_seconds, self.comm_seconds)


def training_time(cfg: Config, mesh: MeshShape, hw: Hardware | None = None, *, rates: Rates | None = None,
                  policy: RematPolicyName | None = None, grad_accum: int | None = None,
                  batch_size: int | None = None, accelerator: bool = True) -> StepTime:
    """Calibrated step time of one optimizer step, per device.

    time = bf16 matmul FLOPs (model + remat recompute) / achievable matmul rate
         + f32 matmul FLOPs (the one-pass loss's head backward; every matmul under f32 compute)
           / achievable f32 matmul rate
         + flash attention FLOPs (3 x causal forward + recomputed forwards) / achievable attention rate
         + memory-bound HBM traffic / achievable copy bandwidth
         + tensor-parallel all-reduces (StepTime says why these add and the others overlap)
    with the traffic counted kernel by kernel (`elementwise_bytes_per_token`):
      - elementwise passes of each layer forward and backward, and what a policy recomputes of
        them: the norms, the mid-layer residual add, RoPE and the SwiGLU product, the forward
        kernels whose outputs the backward reads (`recomputed_bytes_per_token`);
      - scanned layers (`lax.scan`) copy every saved residual into the [L, ...] stack
        (a dynamic-update-slice: read + write); unrolled layers keep them in place. Before the
        loops, XLA fills each stack with zeros: the forward scan's residual stacks and the
        backward scan's stack of layer gradients (in the param dtype), one write each per
        micro-batch (the broadcasts feeding both loops, in the H200's compiled HLO and in
        XLA:CPU's: tests/test_accounting_xla.py; 0.8-1.1x of the scan-only kernels' measured
        time in five profiled H200 steps, docs/benchmarks.md "Forty-ninth session", where the
        copy alone had been 1.25-1.67x under);
      - the f32 -> c weight casts (forward; again backward unless `none` saved them) and the
        c -> f32 conversion of weight gradients, when c != p, per micro-batch, on each
        device's stored shard (XLA:GPU casts before FSDP's gather, converts after its reduction);
      - the loss: one-pass, read the f32 logits for the log-sum-exp, again backward, and write
        the f32 gradient (12·V per token; the head's backward then runs as f32 matmuls at the
        f32 rate); chunked (train.loss_chunk), read each chunk's f32 logits once and write its
        c gradient ((4 + c)·V per token) plus the f32 dW accumulation per chunk;
      - the optimizer once per step: the global grad norm reads the grads, the fused AdamW
        update reads params, grads and both moments and writes params and moments:
        (4·p + 4·m)·N with m the moments' float32 bytes (8·p·N for f32 params);
        grad accumulation adds a read + write of the f32 sum per micro-batch.
    `rates` default to the hardware table's achievable fractions (Rates.of(hw)); pass measured
    ones (experiments/bench_remat.py measures them in the same run). Collectives come from
    `training_comms` at the datasheet link bandwidths (not calibrated).
    """
    m = cfg.model
    policy = cfg.remat.policy if policy is None else policy
    accum = cfg.train.grad_accum if grad_accum is None else grad_accum
    batch = cfg.train.batch_size if batch_size is None else batch_size
    if rates is None:
        if hw is None:
            raise ValueError("training_time needs measured rates or a hardware entry")
        rates = Rates.of(hw)
    t = cfg.train.seq_len
    p = dtype_bytes(m.param_dtype)
    c = dtype_bytes(m.compute_dtype, accelerator=accelerator)
    flash = is_flash(cfg.attention.impl, hw)
    dev = mesh.devices
    tokens = batch * t / dev  # FLOPs: a device's share of the step's work (all micro-batches)
    # Traffic: a device streams every token of its batch shard; [D]-sized tensors are
    # replicated over a tensor-parallel axis, head/MLP/vocab-sized ones split (tp, v_dev).
    shard_tokens = batch * t / mesh.split(A.BATCH)
    tp = mesh.split(A.ACT_MLP)
    r = RematPolicyName

    # FLOPs. A flash core runs at the attention rate on the causal half; an XLA core is two
    # batched matmuls over the whole T x T at the matmul rate.
    f = flops_per_token(m, t)
    core_fwd = attention_flops_per_token(m, t, causal=flash)
    recompute = recompute_flops_per_token(m, t, policy, cfg.remat.names, causal=flash)
    recompute_core = core_fwd if policy != r.none else 0.0
    matmul = (f.dense + recompute - recompute_core) * tokens
    attention = (3 * core_fwd + recompute_core) * tokens
    if not flash:
        matmul, attention = matmul + attention, 0.0
    # The one-pass loss hands the head's backward f32 logit gradients: dx = dlogits·W^T and
    # dW = x^T·dlogits promote the c-side to f32 and run as f32 matmuls (TF32 on the GPU;
    # the training profile in docs/benchmarks.md shows them). The chunked loss rounds the
    # gradients to c first: all three head matmuls in c.
    chunk = cfg.train.loss_chunk
    f32_matmul = 0.0
    if not chunk and c < F32:
        # `tokens` is already this device's share of the step's work (its batch shard / tensor
        # split), as for every other matmul; dividing by the vocab split again had priced a
        # tensor-parallel device 1/tp of its f32 head backward.
        f32_matmul = 2 * 2 * m.hidden_size * m.vocab_size * tokens
        matmul -= f32_matmul
    elif c == F32:
        # f32 compute: every matmul has f32 inputs (TF32 on the GPU), so all run at the f32
        # rate; they had been priced at the bf16 rate (2.7x faster on an H200: 744 vs 277).
        matmul, f32_matmul = 0.0, matmul

    # Memory-bound traffic.
    mem = training_memory(cfg, mesh, hw=hw, policy=policy, grad_accum=accum, batch_size=batch, accelerator=accelerator)
    n_dev = mem.params / p
    e = elementwise_bytes_per_token(m, t, c=c, flash=flash, tp=tp)
    layers = m.num_layers
    recomputes = policy != r.none
    traffic = {
        "layer elementwise forward": e["forward"] * shard_tokens * layers,
        "layer elementwise backward": e["backward"] * shard_tokens * layers,
        "recomputed elementwise forward": recomputed_bytes_per_token(
            m, t, policy, cfg.remat.names, c=c, flash=flash, tp=tp) * shard_tokens * layers,
        "saved residuals copied into the scan stack": 2 * mem.activations.layers * accum if m.scan_layers else 0.0,
        "scan stacks zero-filled before the loops": (
            (mem.activations.layers + p * weight_elems_per_device(m, mesh, LAYER_PARAMS, gathered=False)) * accum
            if m.scan_layers else 0.0),
        "final norm, embedding gather": 6 * m.hidden_size * c * shard_tokens,
    }
    v_dev = m.vocab_size / mesh.split(A.ACT_VOCAB)
    if chunk:
        # Per chunk: read the f32 logits once (log-sum-exp and the gradient in one fusion),
        # write the c gradient; add x^T·dlogits into the f32 dW (read + write) per chunk.
        traffic["loss (chunked: f32 logits read, c gradient)"] = (F32 + c) * v_dev * shard_tokens
        traffic["loss (chunked: dW accumulation)"] = 2 * F32 * m.hidden_size * v_dev * (t // chunk) * accum
    else:
        # Read the f32 logits for the log-sum-exp, again backward, write the f32 gradient.
        traffic["loss (f32 logits read twice, f32 gradient)"] = 3 * F32 * v_dev * shard_tokens
    if c != p:
        # On each device's stored shard: XLA:GPU casts a weight before FSDP gathers it (the
        # gathers move c bytes, not p) and converts a gradient after reducing it (the
        # reductions move c) [XLA-GPU; tests/test_accounting_gpu_collectives.py]. They had been
        # priced on the gathered weights, n times the shard under FSDP over n devices: for
        # llama3_8b at fsdp=8, 96 of the 141 GB of memory-bound traffic instead of 12.
        layer_w = weight_elems_per_device(m, mesh, LAYER_WEIGHTS, gathered=False)  # (was pro rata of all params)
        other_w = n_dev - layer_w  # embedding, head, norm scales
        casts = (2 if recomputes else 1) * layer_w + other_w
        traffic["weight casts f32 -> c"] = (p + c) * casts * accum
        traffic["weight gradients c -> f32"] = (p + c) * n_dev * accum
    traffic["optimizer (grad norm + fused AdamW)"] = (4 * p + 4 * moment_bytes(p)) * n_dev
    if accum > 1:  # (the sum is f32 whatever the params' dtype: train.accumulate_grads)
        traffic["grad accumulation"] = 2 * F32 * n_dev * accum
    # Every collective adds to the step. Those of activations (Megatron's all-reduces, the
    # embedding's all-to-all) sit between matmuls that need their result. FSDP's gathers and
    # reduce-scatters and data parallelism's all-reduces could in principle run behind the
    # compute, but on 2 H200s they did not, with scanned layers or unrolled: the fsdp=2 and
    # data=2 steps took their collectives' whole time on top of the compute
    # (experiments/bench_multigpu.py; docs/benchmarks.md, "Multi-GPU scaling"). In a node a
    # collective runs at the measured link rate, not the datasheet's.
    # (The same batch and compute dtype as the rest of the step: the tensor all-reduces had
    # been priced on cfg's batch and bf16 whatever `batch_size` and `accelerator` said.)
    collectives = (training_comms(cfg, mesh, hw, accelerator=accelerator, policy=policy, grad_accum=accum,
                                  batch_size=batch) if hw and dev > 1 else [])
    link = rates.link or (hw.ring_bandwidth * hw.link_fraction if hw else 0.0)

    def seconds(x: Collective) -> float:
        in_node = axis_bandwidth(x.axis.split("+")[0], mesh, hw) == hw.ring_bandwidth
        return x.seconds * hw.ring_bandwidth / link if in_node and link else x.seconds

    serial = sum(seconds(x) for x in collectives)
    host = 2 * mem.activations.host * accum  # offloaded in the forward, fetched back in the backward
    return StepTime(matmul, attention, traffic, rates, 0.0, host, f32_matmul, serial)
