"""How to Scale Your Model's accounting as code: parameters, FLOPs, bytes, communication, roofline.

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

The activation table (`layer_residuals`) mirrors what JAX saves for this repository's
model code (scaling/layers.py, attention.py, model.py) under each remat policy; the tests
check it tensor-for-tensor against `jax.ad_checkpoint` and against XLA's memory analysis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from scaling.config import AttentionImpl, Config, DType, ModelConfig, RematPolicyName
from scaling.hardware import Hardware
from scaling.sharding import axes as A
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

    @property
    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def rule_set(self) -> RuleSet:
        return get_rule_set(self.rules)

    def shards(self, names: Sequence[str | None], mapping: Mapping[str, tuple[str, ...]]) -> list[int]:
        """Per dimension, how many ways it is split (a mesh axis used at most once per spec,
        size-1 axes ignored: scaling.sharding.mesh.logical_to_spec)."""
        used: set[str] = set()
        out = []
        for name in names:
            axes = [a for a in mapping.get(name, ()) if a not in used and self.sizes[a] > 1] if name else []
            used.update(axes)
            out.append(math.prod(self.sizes[a] for a in axes))
        return out

    def axes_of(self, name: str, params: bool) -> tuple[str, ...]:
        mapping = self.rule_set.params if params else self.rule_set.activations
        return tuple(a for a in mapping.get(name, ()) if self.sizes[a] > 1)

    def split(self, name: str, params: bool = False) -> int:
        return math.prod(self.sizes[a] for a in self.axes_of(name, params))


def params_per_device(m: ModelConfig, mesh: MeshShape) -> int:
    """Parameter elements on one device under the rule set (ceil where a dim does not divide)."""
    total = 0
    for shape, names in param_shapes(m).values():
        total += math.prod(-(-s // k) for s, k in zip(shape, mesh.shards(names, mesh.rule_set.params)))
    return total


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

    full: the whole layer forward again. dots / selective: the attention core (its inputs,
    the projections, are saved; [K22] selective recomputation). names/offload: the core, plus
    any projection whose tag is not kept (its output is needed by the backward pass).
    """
    from scaling import layers as T  # tags only

    per_layer_dense = 2 * layer_matmul_params(m)
    core = attention_flops_per_token(m, seq_len, causal=causal)
    if policy == RematPolicyName.none:
        return 0.0
    if policy == RematPolicyName.full:
        return float(per_layer_dense * m.num_layers + core)
    if policy in (RematPolicyName.dots, RematPolicyName.selective):
        return float(core)
    d, n, k, h, f = m.hidden_size, m.num_heads, m.num_kv_heads, m.resolved_head_dim, m.mlp_dim
    cost = {T.QUERY_PROJ: d * n * h, T.KEY_PROJ: d * k * h, T.VALUE_PROJ: d * k * h, T.OUT_PROJ: n * h * d,
            T.MLP_GATE: d * f, T.MLP_UP: d * f}
    kept = set(names)
    dense = sum(2 * c for tag, c in cost.items() if tag not in kept) * m.num_layers
    return float(dense + core)


# ------------------------------------------------------------------------ activations


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tensor the backward pass keeps, per token (times B·T) unless `per_token` is False."""

    name: str
    elems: int  # elements per token (or in total, when per_token is False)
    nbytes: int  # bytes per element
    tp_axis: str | None = None  # the logical activation axis a tensor-parallel mesh splits
    per_token: bool = True

    def bytes(self, tokens: int, tp_split: int = 1) -> float:
        n = self.elems * self.nbytes * (tokens if self.per_token else 1)
        return n / tp_split


def is_flash(impl: AttentionImpl, hw: Hardware | None) -> bool:
    """Does the attention core avoid materialising [T, T] probabilities? (attention.resolve_impl:
    auto is cudnn on a GPU, the xla reference elsewhere)."""
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
        [F] tensors of the SwiGLU, and (when c != p) the c-cast of the layer's weights.
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
        out.append(Residual("weights cast to compute dtype", layer_matmul_params(m), c, per_token=False))
    return out


def host_residuals(m: ModelConfig, policy: RematPolicyName, names: Sequence[str], *, c: int) -> list[Residual]:
    """offload: the tagged tensors moved to pinned host memory instead of kept in HBM."""
    if policy != RematPolicyName.offload:
        return []
    return [r for r in layer_residuals(m, 0, RematPolicyName.names, names, c=c) if r.name != "layer input x"]


def outer_residuals(m: ModelConfig, *, c: int, p: int = 4) -> list[Residual]:
    """Kept outside the layers: the final RMSNorm's (as in a layer), the softmax of the
    cross-entropy (f32 [B, T, V]), token indices; the head weight's c-cast when c != p."""
    d, v = m.hidden_size, m.vocab_size
    out = [
        Residual("final norm input (f32)", d, F32) if c != F32 else Residual("final hidden state", d, c),
        Residual("final norm x·rsqrt (f32)", d, F32),
        Residual("final norm output", d, c),
        Residual("final norm stats (f32)", 2, F32),
        Residual("cross-entropy exp(logits) (f32)", v, F32, A.ACT_VOCAB),
        Residual("token ids, targets, loss terms", 4, 4),
    ]
    if c != p:
        out.append(Residual("head weight cast", d * v, c, per_token=False))
    return out


@dataclasses.dataclass(frozen=True)
class ActivationBytes:
    per_layer: float  # saved per layer (device memory)
    layers: float  # all L layers
    outer: float  # final norm, cross-entropy softmax, ...
    logits: float  # transient: f32 logits [B, T, V] and their gradient
    working_layer: float  # transient: the layer being differentiated (complete residual set)
    host: float = 0.0  # offloaded to host memory (not in HBM)

    @property
    def total(self) -> float:
        return self.layers + self.outer + self.logits + self.working_layer


def activation_bytes(m: ModelConfig, seq_len: int, batch: int, policy: RematPolicyName, names: Sequence[str] = (),
                     *, c: int, p: int = 4, flash: bool = False, mesh: MeshShape = MeshShape()) -> ActivationBytes:
    """Activation bytes of one micro-batch of `batch` sequences, per device under `mesh`.

    Batch splits over the rule set's batch axes; tensors whose axis the rule set maps to
    `tensor` split over it; [B, T, D] tensors are replicated over `tensor` (Megatron without
    sequence parallelism [K22]). Peak = saved residuals + the layer under differentiation
    (its complete residual set is live, sliced from the stack or recomputed) + the f32 logits
    and their gradient. These two transients are what XLA's memory analysis shows beyond
    the stacked residuals (tests/test_accounting.py).
    """
    tokens = batch * seq_len / mesh.split(A.BATCH)

    def total(rs):
        return sum(r.bytes(tokens, mesh.split(r.tp_axis) if r.tp_axis else 1) for r in rs)

    per_layer = total(layer_residuals(m, seq_len, policy, names, c=c, p=p, flash=flash))
    full_layer = total(layer_residuals(m, seq_len, RematPolicyName.none, c=c, p=p, flash=flash))
    logits = 2 * tokens * m.vocab_size * F32 / mesh.split(A.ACT_VOCAB)
    host = total(host_residuals(m, policy, names, c=c)) * m.num_layers
    return ActivationBytes(per_layer, per_layer * m.num_layers, total(outer_residuals(m, c=c, p=p)), logits,
                           full_layer, host)


def kv_cache_bytes(m: ModelConfig, batch: int, seq_len: int, *, c: int = 2) -> float:
    """Decode KV cache: 2 (K and V) · L · K · H · T · B · c bytes [HSM-I]."""
    return 2.0 * m.num_layers * m.num_kv_heads * m.resolved_head_dim * seq_len * batch * c


# -------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class MemoryBytes:
    """Training-step memory per device."""

    params: float
    grads: float
    optimizer: float
    activations: ActivationBytes

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations.total


def training_memory(cfg: Config, mesh: MeshShape, *, accelerator: bool = True, hw: Hardware | None = None,
                    policy: RematPolicyName | None = None, grad_accum: int | None = None) -> MemoryBytes:
    """Params, grads and AdamW state per device plus one micro-batch's activations.

    AdamW (optax.adamw in scaling/optim.py) keeps two moments in the parameter dtype; the
    parameters are the f32 master copy and the compute dtype is a per-use cast, so there
    is no separate master copy: 4 + 4 + 8 = 16 bytes per parameter with f32 params [HSM-TR].
    Grad accumulation keeps an f32 sum of grads beside the micro-batch grads.
    """
    m = cfg.model
    p = dtype_bytes(m.param_dtype)
    c = dtype_bytes(m.compute_dtype, accelerator=accelerator)
    policy = cfg.remat.policy if policy is None else policy
    accum = cfg.train.grad_accum if grad_accum is None else grad_accum
    n_dev = params_per_device(m, mesh)
    micro = cfg.train.batch_size // accum
    act = activation_bytes(m, cfg.train.seq_len, micro, policy, cfg.remat.names, c=c, p=p,
                           flash=is_flash(cfg.attention.impl, hw), mesh=mesh)
    grads = n_dev * p * (2 if accum > 1 else 1)
    return MemoryBytes(n_dev * p, grads, 2 * n_dev * p, act)


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


def collective_seconds(kind: str, nbytes: float, n: int, bw: float) -> float:
    """Ring collective over n devices: AllGather / ReduceScatter move (n-1)/n of the array
    through each device, AllReduce twice that [HSM-S]."""
    if n <= 1:
        return 0.0
    factor = 2.0 if kind == "all-reduce" else 1.0
    return factor * (n - 1) / n * nbytes / bw


def training_comms(cfg: Config, mesh: MeshShape, hw: Hardware, *, accelerator: bool = True,
                   policy: RematPolicyName | None = None, grad_accum: int | None = None) -> list[Collective]:
    """Collectives per training step, per mesh axis.

    FSDP (params over an axis that also splits the batch): AllGather each layer's weights
    forward, again backward, ReduceScatter the grads [HSM-TR]. Replicated-param batch axes
    (data parallel): AllReduce of the (FSDP-sharded) grads. Tensor parallel (Megatron):
    2 AllReduces of [B, T, D] per layer forward (after the out and down projections) and 2
    backward (grads of the q/k/v and gate/up inputs) [HSM-TR, K22]; `full` remat re-runs the
    forward ones. With grad accumulation (scaling/train.py scans over micro-batches, each
    with its own forward and backward) every collective happens once per micro-batch.
    Weights move in the parameter dtype (the cast to the compute dtype happens after the
    gather in the model code), grads in the parameter dtype.
    """
    m = cfg.model
    p = dtype_bytes(m.param_dtype)
    c = dtype_bytes(m.compute_dtype, accelerator=accelerator)
    policy = cfg.remat.policy if policy is None else policy
    accum = cfg.train.grad_accum if grad_accum is None else grad_accum
    rules = mesh.rule_set
    out: list[Collective] = []
    batch_axes = mesh.axes_of(A.BATCH, params=False)
    # Bytes of params on one device *before* sharding over a given axis: per_device x axis size.
    per_dev = params_per_device(m, mesh) * p
    param_axes = {a for _, names in param_shapes(m).values() for n in names for a in rules.params.get(n, ())}
    for axis in batch_axes:
        n = mesh.sizes[axis]
        bw = axis_bandwidth(axis, mesh, hw)
        if axis in param_axes:
            gathered = per_dev * n  # weights before sharding over this axis
            for what in ("weights (forward)", "weights (backward re-gather)"):
                out.append(Collective(axis, "all-gather", what, gathered * accum,
                                      collective_seconds("all-gather", gathered, n, bw) * accum))
            out.append(Collective(axis, "reduce-scatter", "grads", gathered * accum,
                                  collective_seconds("reduce-scatter", gathered, n, bw) * accum))
        else:
            out.append(Collective(axis, "all-reduce", "grads", per_dev * accum,
                                  collective_seconds("all-reduce", per_dev, n, bw) * accum))
    t = mesh.sizes["tensor"]
    if t > 1 and "tensor" in rules.activations.get(A.ACT_MLP, ()):
        micro = cfg.train.batch_size // accum
        act = micro * cfg.train.seq_len / mesh.split(A.BATCH) * m.hidden_size * c
        count = m.num_layers * (4 + (2 if policy == RematPolicyName.full else 0))
        bw = axis_bandwidth("tensor", mesh, hw)
        out.append(Collective("tensor", "all-reduce", f"[B,T,D] activations x{count}", act * count * accum,
                              collective_seconds("all-reduce", act, t, bw) * count * accum))
    return out


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
    read in the compute dtype forward and twice backward (per micro-batch), saved
    activations written once and read once, logits written and read in f32, and AdamW
    reading params, grads and two moments and writing params and moments (7 param-sized
    passes). Communication: `training_comms`, axes not overlapped with each other.
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
    act = mem.activations
    hbm = accum * (3 * n_dev * c + 2 * (act.layers + act.outer) + act.logits) + 7 * n_dev * p
    comms = sum(x.seconds for x in training_comms(cfg, mesh, hw, policy=policy, grad_accum=accum))
    return Roofline(tokens, model_flops, hw_flops, hbm, comms, hw_flops / hw.bf16_flops, hbm / hw.hbm_bandwidth,
                    hw.bf16_flops)


def critical_tokens_per_device(hw: Hardware, *, bytes_per_param: int = 2) -> dict[str, float]:
    """Tokens per device above which a step is compute-bound [HSM-R, HSM-TR].

    HBM: a bf16 matmul of a [B, D] batch against a [D, F] weight does 2·B·D·F FLOPs over
    2·D·F weight bytes, so B > C / W_hbm. FSDP: 6·B·P FLOPs against 3 weight-sized
    collectives of P·b bytes, so B > b·C / (2·W_ici) (= C / W_ici for bf16) per axis.
    """
    return {
        "hbm": hw.bf16_flops / hw.hbm_bandwidth,
        "fsdp (intra-node)": bytes_per_param * hw.bf16_flops / (2 * hw.ring_bandwidth),
        "fsdp (across nodes)": bytes_per_param * hw.bf16_flops / (2 * hw.dcn_bandwidth),
    }
