"""The accounting's formulas against independent references: published parameter counts,
the FLOP tables of Kaplan et al. 2020 (Table 1), Hoffmann et al. 2022 ("Chinchilla", App. F)
and Chowdhery et al. 2022 ("PaLM", App. B), datasheet numbers, and values worked out by hand
from the definitions in float64. Each test kills mutants of scaling/accounting.py, plan.py or
hardware.py that tests/test_accounting.py let through (the report of the mutation run lists
them). Nothing here compiles a model: milliseconds per test.

SMALL is a shape whose numbers are easy to work by hand and that exercises what the presets
do not at once: GQA (K < N), a head dim that is not D / N, a vocabulary no mesh axis divides.
"""

import itertools
import math

import pytest

from scaling import accounting as acc
from scaling import plan
from scaling.config import ModelConfig, RematPolicyName as R, load_config
from scaling.hardware import HARDWARE, Hardware, by_device_kind, get_hardware
from scaling.layers import KEY_PROJ, MLP_GATE, MLP_UP, OUT_PROJ, QUERY_PROJ, VALUE_PROJ

PRESETS = "configs/models"

# D=64, N=4 query heads, K=2 kv heads, H=32 (not D/N=16), F=96, V=100, L=3.
D, N, K, H, F, V, L = 64, 4, 2, 32, 96, 100, 3
SMALL_OVERRIDES = [f"--model.hidden_size={D}", f"--model.num_heads={N}", f"--model.num_kv_heads={K}",
                   f"--model.head_dim={H}", f"--model.mlp_dim={F}", f"--model.vocab_size={V}",
                   f"--model.num_layers={L}", "--model.max_seq_len=128",
                   "--data.source=synthetic"]
SMALL = load_config(None, SMALL_OVERRIDES).model

# Per layer, by tensor (Hugging Face Llama names): q_proj [N·H, D], k_proj and v_proj [K·H, D],
# o_proj [D, N·H], gate/up [F, D], down [D, F], two RMSNorm weights [D].
Q_W, KV_W, O_W, MLP_W, NORM_W = N * H * D, K * H * D, N * H * D, F * D, D  # 8192, 4096, 8192, 6144, 64
LAYER_MATMUL = Q_W + 2 * KV_W + O_W + 3 * MLP_W  # 43,008
LAYER_ALL = LAYER_MATMUL + 2 * NORM_W  # 43,136
EMBED = HEAD = V * D  # 6,400
SMALL_PARAMS = EMBED + L * LAYER_ALL + D + HEAD  # 142,272


def small_cfg(*extra, batch=2, seq=16):
    return load_config(None, [*SMALL_OVERRIDES, f"--train.batch_size={batch}", f"--train.seq_len={seq}",
                              "--model.compute_dtype=bfloat16", *extra])


# ------------------------------------------------------------------------ parameters


def test_small_param_count_by_hand():
    assert SMALL_PARAMS == 142_272 and LAYER_MATMUL == 43_008
    assert acc.param_count(SMALL) == SMALL_PARAMS
    assert acc.layer_matmul_params(SMALL) == LAYER_MATMUL
    tied = load_config(None, [*SMALL_OVERRIDES, "--model.tie_embeddings=true"]).model
    assert acc.param_count(tied) == SMALL_PARAMS - HEAD == 135_872


# Published totals (Hugging Face safetensors metadata of each checkpoint).
@pytest.mark.parametrize("preset, published", [
    ("llama2_7b", 6_738_415_616),  # MHA, untied
    ("llama3_8b", 8_030_261_248),  # GQA 32/8, V=128,256
    ("tinyllama_1.1b", 1_100_048_384),  # GQA 32/4, H=64
    ("llama3.2_1b", 1_235_814_400),  # tied embeddings, explicit head_dim
])
def test_published_parameter_counts(preset, published):
    assert acc.param_count(load_config(f"{PRESETS}/{preset}.yaml").model) == published


def test_llama2_7b_parameters_by_component():
    """Llama 2 7B from its shapes: per layer 4·D² attention + 3·D·F SwiGLU + 2·D norms."""
    m = load_config(f"{PRESETS}/llama2_7b.yaml").model
    assert acc.layer_matmul_params(m) == 4 * 4096**2 + 3 * 4096 * 11008 == 202_375_168
    assert acc.matmul_params(m) == 32 * 202_375_168 + 32000 * 4096  # embedding lookup: no matmul


# (D/fsdp, V/tensor ...) per tensor under the default rules, ceil where a dim does not divide.
def _default_rules_elems(fsdp, tensor, gathered=False):
    f = 1 if gathered else fsdp
    c = lambda x, k: -(-x // k)  # noqa: E731
    return (c(V, tensor) * c(D, f)  # embedding [V/tensor, D/fsdp]
            + L * (2 * D  # norm scales, replicated
                   + c(D, f) * c(N, tensor) * H  # q [D/fsdp, N/tensor, H]
                   + 2 * c(D, f) * c(K, tensor) * H  # k, v
                   + c(N, tensor) * H * c(D, f)  # o
                   + 3 * c(D, f) * c(F, tensor))  # gate, up, down
            + D + c(D, f) * c(V, tensor))  # final norm; head [D/fsdp, V/tensor]


@pytest.mark.parametrize("fsdp, tensor, stored, gathered", [
    (2, 2, 35_904, 71_360),  # every matrix has a tensor dim: matrices / 4 stored, / 2 gathered
    (1, 3, 60_096, 60_096),  # V=100, N=4, K=2 not divisible by 3: ceil (34, 2, 1)
    (4, 1, (SMALL_PARAMS - 7 * D) // 4 + 7 * D, SMALL_PARAMS),  # the 7 norm scales [D] replicated
])
def test_params_per_device_by_hand(fsdp, tensor, stored, gathered):
    assert _default_rules_elems(fsdp, tensor) == stored
    assert _default_rules_elems(fsdp, tensor, gathered=True) == gathered
    mesh = acc.MeshShape(1, fsdp, tensor)
    assert acc.params_per_device(SMALL, mesh) == stored
    assert acc.gathered_params_per_device(SMALL, mesh) == gathered
    assert acc.is_fsdp(SMALL, mesh) == (fsdp > 1)


def test_weight_elems_per_device_gathers_only_the_batch_axes():
    mesh = acc.MeshShape(1, 2, 2)  # q [L, D/2, N/2, H] stored, [L, D, N/2, H] as read
    q = ("blocks.attn.q_dnh",)
    assert acc.weight_elems_per_device(SMALL, mesh, q, gathered=False) == L * 32 * 2 * H
    assert acc.weight_elems_per_device(SMALL, mesh, q, gathered=True) == L * 64 * 2 * H
    # The `data` axis splits the batch but no parameter: nothing to gather.
    assert not acc.is_fsdp(SMALL, acc.MeshShape(4, 1, 1))
    assert acc.head_weight_name(SMALL) == "head_dv"


def test_divisibility_errors_name_each_tensor_and_dim():
    errors = acc.divisibility_errors(SMALL, acc.MeshShape(1, 1, 3))
    # vocab (embedding, head), heads (q, o) and kv_heads (k, v); F=96 divides by 3.
    assert sorted(e.split(":")[0] for e in errors) == sorted(
        ["embed.table_vd", "head_dv", "blocks.attn.q_dnh", "blocks.attn.o_nhd", "blocks.attn.k_dkh",
         "blocks.attn.v_dkh"])
    assert "embed.table_vd: vocab=100 not divisible by 3" in errors
    assert acc.divisibility_errors(SMALL, acc.MeshShape(1, 4, 2)) == []
    odd = load_config(None, [*SMALL_OVERRIDES, "--model.vocab_size=101"]).model
    assert acc.divisibility_errors(odd, acc.MeshShape(1, 1, 2)) == [
        "embed.table_vd: vocab=101 not divisible by 2", "head_dv: vocab=101 not divisible by 2"]
    assert acc.divisibility_errors(SMALL, acc.MeshShape(1, 128, 1)) != []  # D=64 over 128


def test_a_mesh_axis_splits_at_most_one_dim():
    # `fsdp` rules map EMBED to (fsdp, tensor): with both > 1 a [D, F] matrix splits D 8 ways
    # and nothing else; the embedding [V, D] likewise (V is replicated under `fsdp`).
    mesh = acc.MeshShape(1, 2, 4, rules="fsdp")
    assert mesh.shards(("embed", "mlp"), mesh.rule_set.params) == [8, 1]
    # A rule mapping two logical names to one mesh axis uses it once, on the first dim.
    assert mesh.shards(("a", "b"), {"a": ("fsdp",), "b": ("fsdp", "tensor")}) == [2, 4]


@pytest.mark.parametrize("sizes, axis", [((0, 1, 1), "data"), ((1, -2, 1), "fsdp"), ((1, 1, 2.5), "tensor"),
                                         ((True, 1, 1), "data")])
def test_mesh_shape_rejects_sizes_that_are_not_positive_integers(sizes, axis):
    # (0 divided by zero in the roofline; -2 priced negative FLOPs; 2.5 fractional devices.)
    with pytest.raises(ValueError, match=f"MeshShape.{axis} must be an integer >= 1, got"):
        acc.MeshShape(*sizes)


def test_mesh_shape_rejects_an_unknown_rule_set():
    with pytest.raises(ValueError, match="'bogus' is not a rule set; allowed: default, dp, fsdp, fsdp_tp"):
        acc.MeshShape(1, 2, 1, rules="bogus")


# ------------------------------------------------------------------------------ FLOPs


def test_flops_per_token_by_hand():
    t = 16
    f = acc.flops_per_token(SMALL, t, training=False, causal=False)
    assert f.dense == 2 * (L * LAYER_MATMUL + D * V) == 270_848
    assert f.attention == 4 * t * N * H * L == 24_576  # q·k^T and probs·v over query heads
    assert f.six_n == 2 * SMALL_PARAMS
    train = acc.flops_per_token(SMALL, t)  # training, causal (the defaults)
    assert train.dense == 3 * 270_848 and train.attention == 3 * 24_576 / 2
    assert train.six_n == 6 * SMALL_PARAMS and train.total == train.dense + train.attention


def test_forward_flops_equal_chinchilla_appendix_f():
    """Hoffmann et al. 2022, App. F, per sequence of T tokens, forward: KQV 2·T·3·D·(N·H)
    (GQA: (N + 2K)·H), logits 2·T·T·(N·H), softmax @ V 2·T·T·(N·H), projection 2·T·(N·H)·D,
    FFW 2·T·2·D·F (SwiGLU: 3 matrices), final logits 2·T·D·V. The accounting leaves out the
    embedding's one-hot matmul (2·T·D·V, a gather here) and the softmax (3·N·T·T), which
    Chinchilla counts; no causal halving in Chinchilla."""
    m = load_config(f"{PRESETS}/llama2_7b.yaml").model
    t, d, n, h, f, v, layers = 4096, 4096, 32, 128, 11008, 32000, 32
    kqv = 2.0 * t * 3 * d * n * h
    logits = 2.0 * t * t * n * h
    reduce = 2.0 * t * t * n * h
    proj = 2.0 * t * n * h * d
    ffw = 2.0 * t * 3 * d * f
    final = 2.0 * t * d * v
    per_sequence = layers * (kqv + logits + reduce + proj + ffw) + final
    fwd = acc.flops_per_token(m, t, training=False, causal=False)
    assert fwd.total * t == pytest.approx(per_sequence, rel=1e-12)
    # Training: backward = 2 x forward (Chinchilla App. F; Kaplan 2020 sec. 2.1).
    assert acc.flops_per_token(m, t, causal=False).total * t == pytest.approx(3 * per_sequence, rel=1e-12)


def test_causal_attention_flops_equal_kaplan_table_1():
    """Kaplan et al. 2020, Table 1: C_forward = 2N + 2·n_layer·n_ctx·d_attn per token, the
    attention term being the causal average; d_attn = N·H (TinyLlama: 32 x 64 = 2048)."""
    m = load_config(f"{PRESETS}/tinyllama_1.1b.yaml").model
    n_ctx = 2048
    assert acc.flops_per_token(m, n_ctx, training=False).attention == 2 * 22 * n_ctx * (32 * 64)


def test_training_attention_flops_equal_palm_appendix_b():
    """Chowdhery et al. 2022, App. B: model FLOPs per token 6N + 12·L·H·Q·T (H heads of size
    Q, unhalved); for Llama 3 8B at T=8192: 12·32·32·128·8192 (query heads: GQA saves none)."""
    m = load_config(f"{PRESETS}/llama3_8b.yaml").model
    assert acc.flops_per_token(m, 8192, causal=False).attention == 12 * 32 * 32 * 128 * 8192
    assert acc.flops_per_token(m, 8192).six_n == 6 * 8_030_261_248


def test_recompute_flops_by_hand():
    t = 16
    core = 2 * t * N * H * L  # causal forward core: 12,288
    # full: every forward matmul of the layer again but the down projection, and the core.
    full = 2 * (Q_W + 2 * KV_W + O_W + 2 * MLP_W) * L + core
    assert full == 233_472
    assert acc.recompute_flops_per_token(SMALL, t, R.full) == full
    assert acc.recompute_flops_per_token(SMALL, t, R.dots) == core
    assert acc.recompute_flops_per_token(SMALL, t, R.selective) == core
    assert acc.recompute_flops_per_token(SMALL, t, R.none) == 0
    # names: the untagged projections (k, v, o, gate here) run again, plus the core.
    kept = (QUERY_PROJ, MLP_UP)
    names = 2 * (KV_W + KV_W + O_W + MLP_W) * L + core
    assert acc.recompute_flops_per_token(SMALL, t, R.names, kept) == names == 147_456
    assert acc.recompute_flops_per_token(SMALL, t, R.offload, kept) == names
    assert acc.recompute_flops_per_token(SMALL, t, R.names, kept, causal=False) == names + core


@pytest.mark.parametrize("policy, names, expected", [
    (R.full, (), True), (R.none, (), False), (R.dots, (), False), (R.selective, (), False),
    (R.names, (QUERY_PROJ,), True), (R.names, (OUT_PROJ,), False),
    (R.offload, (MLP_GATE,), True), (R.offload, (OUT_PROJ, KEY_PROJ), False),
])
def test_which_policies_rerun_the_out_projection(policy, names, expected):
    assert acc.recomputes_out_proj(policy, names) is expected


def test_kv_cache_bytes_llama3_8b():
    # 2 (K, V) x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token in bf16.
    m = load_config(f"{PRESETS}/llama3_8b.yaml").model
    assert acc.kv_cache_bytes(m, 1, 1) == 128 * 1024
    assert acc.kv_cache_bytes(m, 4, 8192, c=4) == 4 * 8192 * 256 * 1024


# ------------------------------------------------------------------------ activations

# Per token, bytes, c = 2 (bf16): the layer input x [D]; dots keeps q [N·H], k, v [K·H],
# the out projection [D], gate and up [F] (not the core's output).
X_IN = 2 * D
DOTS_EXTRA = 2 * (N * H + 2 * K * H + D + 2 * F)


@pytest.mark.parametrize("mesh, tp", [(acc.MeshShape(), 1), (acc.MeshShape(1, 1, 2), 2)])
def test_saved_activations_per_policy_by_hand(mesh, tp):
    tokens = 2 * 16
    full = acc.activation_bytes(SMALL, 16, 2, R.full, c=2, mesh=mesh)
    assert full.per_layer == X_IN * tokens and full.layers == L * X_IN * tokens
    dots = acc.activation_bytes(SMALL, 16, 2, R.dots, c=2, mesh=mesh)
    # [D]-sized tensors are replicated over tensor; head-, kv- and MLP-sized ones split.
    assert dots.per_layer == (X_IN + 2 * D + 2 * (N * H + 2 * K * H + 2 * F) / tp) * tokens
    names = acc.activation_bytes(SMALL, 16, 2, R.names, (MLP_GATE,), c=2, mesh=mesh)
    assert names.per_layer == (X_IN + 2 * F / tp) * tokens
    off = acc.activation_bytes(SMALL, 16, 2, R.offload, (MLP_GATE, OUT_PROJ), c=2, mesh=mesh)
    assert off.per_layer == X_IN * tokens and off.host == L * (2 * F / tp + 2 * D) * tokens


def test_activations_split_over_the_batch_axes():
    one = acc.activation_bytes(SMALL, 16, 8, R.full, c=2)
    four = acc.activation_bytes(SMALL, 16, 8, R.full, c=2, mesh=acc.MeshShape(2, 2, 1))
    assert four.layers == one.layers / 4 == L * X_IN * 8 * 16 / 4


def test_none_policy_residuals_by_hand():
    """Per token, c = 2, p = 4, the XLA core (T = 16): each RMSNorm keeps its f32 input,
    x·rsqrt (f32), its c output, 2 f32 stats; then q and k after RoPE, v, the core output,
    the f32 probabilities [N, T] and their c cast, 2·N f32 softmax stats, 6 SwiGLU [F]."""
    t = 16
    norms = 2 * (4 * D + 4 * D + 2 * D + 2 * 4)
    attn = 2 * N * H + 2 * K * H + 2 * K * H + 2 * N * H
    probs = 4 * N * t + 2 * N * t + 2 * N * 4
    per_token = norms + attn + probs + 6 * 2 * F
    assert per_token == 3632
    scales = 2 * D * 4  # the two norms' broadcast scales, once (not per token)
    weights = LAYER_MATMUL * 2  # the bf16 cast of the layer's weights (c != p)
    none = acc.activation_bytes(SMALL, t, 2, R.none, c=2, p=4)
    assert none.per_layer == per_token * 2 * t + scales + weights
    # A flash core keeps an f32 log-sum-exp [N] instead of the probabilities and their stats.
    flash = acc.activation_bytes(SMALL, t, 2, R.none, c=2, p=4, flash=True)
    assert none.per_layer - flash.per_layer == (probs - 4 * N) * 2 * t
    # The layer under differentiation: every residual, its weights as read, 2 [F] gradients.
    assert none.working_layer == per_token * 2 * t + scales + weights + 2 * 2 * F * 2 * t


def test_head_transient_by_hand():
    """One-pass loss, c = 2: final norm (f32 input, f32 x·rsqrt, c output, 2 f32 stats), token
    ids and targets (2 int32), f32 logits and their f32 gradient [V], and the head's c cast."""
    t = 16
    per_token = 4 * D + 4 * D + 2 * D + 8 + 8 + 4 * V + 4 * V
    act = acc.activation_bytes(SMALL, t, 2, R.full, c=2, p=4)
    assert act.head == per_token * 2 * t + 2 * D * V == 59_392
    assert act.total == act.layers + max(act.head, act.working_layer)
    # Chunked, 8 positions of 2 rows: f32 dx [D] per token, and the larger of (one chunk's f32
    # logits + their c gradient + the f32 dW) and 3 f32 [D, V].
    chunked = acc.activation_bytes(SMALL, t, 2, R.full, c=2, p=4, loss_chunk=8)
    chunk = 16 * V * 6 + D * V * 4
    assert chunked.head == (4 * D + 4 * D + 2 * D + 8 + 8 + 4 * D) * 2 * t + max(chunk, 3 * D * V * 4) + 2 * D * V


def test_fsdp_layer_working_set_holds_the_gathered_f32_weights():
    """c == p (f32 compute): no cast exists, but under FSDP the layer's all-gathered weights
    are a new buffer while it is differentiated (ZeRO-3 gathers a layer at a time); without
    FSDP the matmuls read the parameters in place. Per token, c = 4, XLA core, T = 16:
    norms 2·(4D + 4D + 4D + 8), q, k, v, core out 4·(2·N·H + 2·K·H), probabilities and
    their cast 2·4·N·T + 2 f32 stats·N, SwiGLU 6·4·F; 2 f32 [F] gradients."""
    t = 16
    per_token = 2 * (12 * D + 8) + 4 * (2 * N * H + 2 * K * H) + (8 * N * t + 8 * N) + 24 * F
    assert per_token == 5936
    scales, temps = 2 * D * 4, 2 * 4 * F
    one = acc.activation_bytes(SMALL, t, 2, R.full, c=4, p=4)
    assert one.working_layer == (per_token + temps) * 32 + scales
    fsdp = acc.activation_bytes(SMALL, t, 2, R.full, c=4, p=4, mesh=acc.MeshShape(1, 2, 1))
    assert fsdp.working_layer == (per_token + temps) * 16 + scales + LAYER_MATMUL * 4


def test_fsdp_head_phase_holds_the_gathered_f32_head():
    """c == p: the head's matmuls read the parameter itself, or under FSDP its all-gathered
    copy [D, V] (split over tensor only), live through the head phase. Per token, c = 4:
    final hidden state, x·rsqrt, output [D] each in f32, 2 stats, 2 ids, f32 logits and grad."""
    per_token = 12 * D + 8 + 8 + 8 * V
    one = acc.activation_bytes(SMALL, 16, 2, R.full, c=4, p=4)
    assert one.head == per_token * 32
    fsdp = acc.activation_bytes(SMALL, 16, 2, R.full, c=4, p=4, mesh=acc.MeshShape(1, 2, 1))
    assert fsdp.head == per_token * 16 + D * V * 4
    fsdp_tp = acc.activation_bytes(SMALL, 16, 4, R.full, c=4, p=4, mesh=acc.MeshShape(1, 2, 2))
    assert fsdp_tp.head == (12 * D + 16 + 8 * V / 2) * 32 + D * V / 2 * 4


def test_chunked_loss_head_when_the_chunk_outweighs_three_dw():
    # 8 rows x 32 positions: the chunk's f32 logits + c gradient (256·V·6) + dW beat 3 dW.
    t, chunk_tokens = 64, 8 * 32
    act = acc.activation_bytes(SMALL, t, 8, R.full, c=2, p=4, loss_chunk=32)
    chunk = chunk_tokens * V * (4 + 2) + D * V * 4
    assert chunk > 3 * D * V * 4
    assert act.head == (4 * D + 4 * D + 2 * D + 8 + 8 + 4 * D) * 8 * t + chunk + 2 * D * V


def test_memory_phases_of_hand_made_numbers():
    act = acc.ActivationBytes(per_layer=1, layers=5, head=30, working_layer=2)
    mem = acc.MemoryBytes(params=10, grads=10, optimizer=20, activations=act, grads_head=3, grads_embed=4)
    assert mem.phases == {"loss and output head": 30 + 3 + 5 + 30, "layer backward": 30 + 6 + 5 + 2,
                          "optimizer update": 40}
    assert (mem.total, mem.peak_phase) == (68, "loss and output head")
    eager = acc.MemoryBytes(10, 10, 20, act, 3, 4, eager_grads=True)  # every grad before the head phase
    assert eager.phases == {"loss and output head": 75, "layer backward": 47, "optimizer update": 40}
    chunked = acc.MemoryBytes(10, 10, 20, act, 3, 4, accumulator=10, loss_in_forward=True)
    assert chunked.phases == {"loss and output head": 75, "layer backward": 53, "optimizer update": 50}
    # The update phase can be the peak (a small batch of a model with a big embedding).
    small_act = acc.ActivationBytes(1, 1, 1, 1)
    update = acc.MemoryBytes(10, 10, 20, small_act, 1, 8)
    assert (update.total, update.peak_phase) == (40, "optimizer update")


def test_tied_embeddings_grads_arrive_with_the_head():
    tied = small_cfg("--model.tie_embeddings=true")
    mem = acc.training_memory(tied, acc.MeshShape())
    assert mem.grads_head == (D + V * D) * 4 and mem.grads_embed == 0


def test_cpu_memory_allocates_grads_eagerly_and_counts_offload_in_ram():
    cfg = small_cfg("--remat.policy=offload", "--remat.names=[mlp_gate]")
    cpu, gpu = acc.training_memory(cfg, acc.MeshShape(), accelerator=False), acc.training_memory(cfg, acc.MeshShape())
    assert cpu.eager_grads and not gpu.eager_grads
    # bf16 compute either way (set explicitly): the CPU's host memory space is its RAM.
    assert gpu.activations.host == L * 2 * F * 32
    assert cpu.activations.layers == gpu.activations.layers + gpu.activations.host


def test_training_memory_phases_by_hand():
    """SMALL, one device, bf16 compute, f32 params, full remat, batch 2 x 16."""
    cfg = small_cfg("--remat.policy=full")
    mem = acc.training_memory(cfg, acc.MeshShape())
    p = 4
    assert (mem.params, mem.grads, mem.optimizer) == (SMALL_PARAMS * p, SMALL_PARAMS * p, 2 * SMALL_PARAMS * p)
    assert mem.grads_head == (D + HEAD) * p and mem.grads_embed == EMBED * p and mem.accumulator == 0
    state = 3 * SMALL_PARAMS * p
    layers = L * X_IN * 32
    head = 59_392
    # The working layer: every `none` residual (not its saved weight cast: the weights in use
    # replace it), the layer's bf16 weights as read, the SwiGLU's 2 [F] gradients.
    working = 3632 * 32 + 2 * D * 4 + LAYER_MATMUL * 2 + 2 * 2 * F * 32
    assert mem.phases == {
        "loss and output head": state + (D + HEAD) * p + layers + head,
        "layer backward": state + (SMALL_PARAMS - EMBED) * p + layers + working,
        "optimizer update": state + SMALL_PARAMS * p,
    }
    assert mem.peak_phase == "layer backward" and mem.total == mem.phases["layer backward"]
    # Grad accumulation adds an f32 sum of the grads; the activations are one micro-batch's.
    accum = acc.training_memory(small_cfg("--remat.policy=full", "--train.grad_accum=2"), acc.MeshShape())
    assert accum.accumulator == SMALL_PARAMS * p
    assert accum.activations.layers == layers / 2


def test_training_memory_rejects_a_grad_accum_that_does_not_divide_the_batch():
    cfg = small_cfg(batch=8)
    with pytest.raises(ValueError, match=r"grad_accum=3 must be >= 1 and divide train.batch_size=8"):
        acc.training_memory(cfg, acc.MeshShape(), grad_accum=3)  # was: 2 sequences per micro-batch
    with pytest.raises(ValueError, match=r"grad_accum=0 must be >= 1"):
        acc.training_comms(cfg, acc.MeshShape(1, 1, 2), get_hardware("h100"), grad_accum=0)


# --------------------------------------------------------------------- communication


def test_collective_seconds_by_hand():
    # [HSM-S]: (n-1)/n of V through each device; all-reduce = reduce-scatter + all-gather.
    assert acc.collective_seconds("all-gather", 4e9, 4, 2e9) == pytest.approx(1.5)
    assert acc.collective_seconds("reduce-scatter", 4e9, 4, 2e9) == pytest.approx(1.5)
    assert acc.collective_seconds("all-reduce", 4e9, 2, 1e9) == pytest.approx(4.0)
    assert acc.collective_seconds("all-gather", 4e9, 1, 2e9) == 0.0


def test_collective_seconds_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="'allreduce' is not one of: all-gather, reduce-scatter, all-reduce"):
        acc.collective_seconds("allreduce", 8e9, 8, 1e9)  # was priced as an all-gather: 7 s, not 14


def _by(comms, axis, kind, what=None):
    return [x for x in comms if x.axis == axis and x.kind == kind and (what is None or x.what == what)]


def test_fsdp_comms_by_hand():
    """fsdp=2 on an H100 node, f32 params, bf16 compute (as XLA:GPU moves them,
    docs/benchmarks.md "Multi-GPU scaling"): the layer matrices and the head have a D (embed)
    dim split over fsdp, gathered in bf16 forward and backward; the layers' grads
    reduce-scattered in bf16, the head's in f32 (the loss's f32 backward); the embedding looked
    up through an all-to-all of the [B, T, D] activations (forward and backward) instead of a
    table gather; the 7 norm scales replicated: their f32 grads all-reduced. 450 GB/s NVLink."""
    hw = get_hardware("h100")
    comms = acc.training_comms(small_cfg(), acc.MeshShape(1, 2, 1), hw)
    gathered = (L * LAYER_MATMUL + HEAD) * 2
    grads = L * LAYER_MATMUL * 2 + HEAD * 4
    norms = (2 * L + 1) * D * 4
    lookup = 2 * (2 // 2 * 16 * D) * 2  # forward + backward, this device's [B/2, T, D] in bf16
    gathers = _by(comms, "fsdp", "all-gather")
    assert [x.what for x in gathers] == ["weights (forward)", "weights (backward re-gather)"]
    for x in gathers:
        assert x.bytes == gathered and x.seconds == pytest.approx(0.5 * gathered / 450e9, rel=1e-12)
    (rs,) = _by(comms, "fsdp", "reduce-scatter")
    assert rs.bytes == grads and rs.seconds == pytest.approx(0.5 * grads / 450e9, rel=1e-12)
    (ar,) = _by(comms, "fsdp", "all-reduce")
    assert ar.bytes == norms and ar.seconds == pytest.approx(2 * 0.5 * norms / 450e9, rel=1e-12)
    (a2a,) = _by(comms, "fsdp", "all-to-all")
    assert a2a.bytes == lookup and a2a.seconds == pytest.approx(0.5 * lookup / 450e9, rel=1e-12)
    # Two micro-batches of this batch: each has its forward and backward, so every collective
    # twice, except the final norm's all-reduce, outside the layer scan: XLA reduces its summed
    # grad once.
    comms2 = acc.training_comms(small_cfg(batch=4), acc.MeshShape(1, 2, 1), hw, grad_accum=2)
    assert sum(x.bytes for x in comms2) == 2 * sum(x.bytes for x in comms) - D * 4
    # On the CPU (XLA:CPU computes bf16 in f32) weights and grads move in the parameter dtype.
    cpu = acc.training_comms(small_cfg(), acc.MeshShape(1, 2, 1), hw, accelerator=False)
    assert [x.bytes for x in _by(cpu, "fsdp", "all-gather")] == [(L * LAYER_MATMUL + HEAD) * 4] * 2


def test_data_parallel_across_nodes_uses_the_network():
    """data=2 x fsdp=8 on H100 nodes of 8: fsdp rings stay in a node (450 GB/s), data crosses
    nodes (50 GB/s NIC). data all-reduces the fsdp-sharded grads, each / 8: the layers' and the
    embedding's in bf16, the head's and the norm scales' in f32 (the norms' after the fsdp
    stage left 1/8 of them)."""
    hw = get_hardware("h100")
    comms = acc.training_comms(small_cfg(batch=16), acc.MeshShape(2, 8, 1), hw)
    gathered = (L * LAYER_MATMUL + HEAD) * 2
    (ag, _), (rs,) = _by(comms, "fsdp", "all-gather"), _by(comms, "fsdp", "reduce-scatter")
    assert ag.seconds == pytest.approx(7 / 8 * gathered / 450e9, rel=1e-12)
    (ar,) = _by(comms, "data", "all-reduce")
    reduced = ((L * LAYER_MATMUL + EMBED) * 2 + HEAD * 4 + (2 * L + 1) * D * 4) / 8
    assert ar.bytes == reduced
    assert ar.seconds == pytest.approx(2 * 0.5 * reduced / 50e9, rel=1e-12)
    assert acc.axis_bandwidth("fsdp", acc.MeshShape(2, 8, 1), hw) == 450e9
    assert acc.axis_bandwidth("data", acc.MeshShape(2, 8, 1), hw) == 50e9
    assert acc.axis_bandwidth("data", acc.MeshShape(2, 4, 1), hw) == 450e9  # 8 devices: one node


@pytest.mark.parametrize("policy, per_layer", [(R.none, 4), (R.dots, 4), (R.full, 5)])
def test_tensor_parallel_allreduces_by_hand(policy, per_layer):
    """Megatron: 2 all-reduces of [B, T, D] per layer forward, 2 backward [HSM-TR]; `full`
    re-runs the out projection's. bf16 on an accelerator: 2·16·64·2 = 4,096 bytes each."""
    hw = get_hardware("h100")
    cfg = small_cfg(f"--remat.policy={policy.value}")
    x, lookup, head = acc.training_comms(cfg, acc.MeshShape(1, 1, 2), hw)
    count = per_layer * L
    act = 2 * 16 * D * 2
    assert (x.axis, x.kind, x.what) == ("tensor", "all-reduce", f"[B,T,D] activations x{count}")
    assert x.bytes == act * count
    assert x.seconds == pytest.approx(count * 2 * 0.5 * act / 450e9, rel=1e-12)
    # The vocabulary is split over tensor: the embedding's lookup is summed over the pieces
    # (bf16) and so is the head's input gradient (f32, the loss's backward) [XLA-GPU].
    assert (lookup.what, lookup.bytes, head.what, head.bytes) == \
        ("embedding lookup [B,T,D]", act, "head input grad [B,T,D] (f32)", 2 * act)
    assert all(c.axis == "tensor" and c.kind == "all-reduce" for c in (x, lookup, head))
    # The batch is split over fsdp first: each device all-reduces its half.
    fsdp = acc.training_comms(cfg, acc.MeshShape(1, 2, 2), hw)
    assert _by(fsdp, "tensor", "all-reduce", x.what)[0].bytes == act * count / 2


def test_training_time_runs_every_collective_serially_at_the_measured_link_rate():
    """In a node a collective takes its datasheet time x 450 / 222 (the H200-measured rate, or
    rates.link); across nodes (the NIC, not measured) its datasheet time. Every collective is
    on the critical path, scanned layers or unrolled (measured on 2 H200s)."""
    hw = get_hardware("h100")
    mesh = acc.MeshShape(2, 8, 1)  # fsdp in a node, data across nodes
    for scan in ("true", "false"):
        cfg = small_cfg(f"--model.scan_layers={scan}", batch=16)
        comms = acc.training_comms(cfg, mesh, hw)
        node = sum(x.seconds for x in comms if x.axis == "fsdp")
        nic = sum(x.seconds for x in comms if x.axis == "data")
        assert node and nic and {x.kind for x in comms} == {"all-gather", "reduce-scatter", "all-reduce", "all-to-all"}
        st = acc.training_time(cfg, mesh, hw)
        assert (st.comm_seconds, st.serial_comm_seconds) == (0.0, pytest.approx(node * 450 / 222 + nic))
        measured = acc.Rates(600e12, 200e12, 3e12, link=300e9)
        assert acc.training_time(cfg, mesh, hw, rates=measured).serial_comm_seconds == \
            pytest.approx(node * 450 / 300 + nic)
        # measured rates without a link rate: the table's
        no_link = acc.Rates(600e12, 200e12, 3e12)
        assert acc.training_time(cfg, mesh, hw, rates=no_link).serial_comm_seconds == \
            pytest.approx(node * 450 / 222 + nic)


def test_training_time_prices_the_tensor_allreduces_on_its_own_batch_and_dtype():
    """training_time(batch_size=..., accelerator=...) priced the all-reduces on cfg's batch in
    bf16 whatever it was given (the rest of its step used the arguments)."""
    hw = get_hardware("h100")
    cfg = small_cfg()
    # an all-reduce of batch 2's [B, T, D], per byte of its dtype, at the H200-measured link rate
    # the H100 entry borrows (222 GB/s per device where the datasheet has 450)
    unit = 2 * 0.5 * 2 * 16 * D / 222e9
    # bf16: 4 per layer and the embedding's lookup, in bf16; the head's input gradient in f32.
    one = unit * (2 * (4 * L + 1) + 4)
    assert acc.training_time(cfg, acc.MeshShape(1, 1, 2), hw).serial_comm_seconds == pytest.approx(one)
    batch8 = acc.training_time(cfg, acc.MeshShape(1, 1, 2), hw, batch_size=8)
    assert batch8.serial_comm_seconds == pytest.approx(4 * one)
    f32 = load_config(None, [*SMALL_OVERRIDES, "--train.batch_size=2", "--train.seq_len=16"])  # compute auto
    assert acc.training_time(f32, acc.MeshShape(1, 1, 2), hw, accelerator=False).serial_comm_seconds == \
        pytest.approx(unit * 4 * (4 * L + 2))


# ------------------------------------------------------------------------- roofline


def test_roofline_by_hand():
    """SMALL, one H100, full remat, bf16 compute: FLOPs (model + recompute) over 989 TFLOP/s;
    HBM: weights read in bf16 three times, saved activations and the head transient written
    and read, AdamW's 7 f32 passes; memory-bound at this size."""
    hw = get_hardware("h100")
    roof = acc.training_roofline(small_cfg("--remat.policy=full"), acc.MeshShape(), hw)
    tokens = 32
    model = (3 * 2 * (L * LAYER_MATMUL + D * V) + 3 * 2 * 16 * N * H * L) * tokens
    hardware = model + 233_472 * tokens
    hbm = 3 * SMALL_PARAMS * 2 + 2 * (L * X_IN * tokens + 59_392) + 7 * SMALL_PARAMS * 4
    assert roof.tokens_per_step == tokens
    assert roof.model_flops == pytest.approx(model, rel=1e-12)
    assert roof.hardware_flops == pytest.approx(hardware, rel=1e-12)
    assert roof.hbm_bytes == pytest.approx(hbm, rel=1e-12)
    assert roof.compute_seconds == pytest.approx(hardware / 989e12, rel=1e-12)
    assert roof.memory_seconds == pytest.approx(hbm / 3.35e12, rel=1e-12)
    assert roof.comm_seconds == 0.0
    assert roof.bound == "memory" and roof.step_seconds == roof.memory_seconds
    assert roof.step_seconds_no_overlap == pytest.approx(roof.compute_seconds + roof.memory_seconds)
    assert roof.intensity == pytest.approx(hardware / hbm)
    assert roof.mfu == pytest.approx(model / 989e12 / (hbm / 3.35e12), rel=1e-12)
    assert roof.tokens_per_second == pytest.approx(tokens / (hbm / 3.35e12), rel=1e-12)


def test_roofline_flops_are_per_device():
    """4 devices (fsdp 2 x tensor 2): each does a quarter of the step's FLOPs; the global
    tokens per step and its throughput stay global."""
    hw = get_hardware("h100")
    cfg = small_cfg("--remat.policy=full", batch=8)
    roof = acc.training_roofline(cfg, acc.MeshShape(1, 2, 2), hw)
    tokens = 8 * 16
    model = (3 * 2 * (L * LAYER_MATMUL + D * V) + 3 * 2 * 16 * N * H * L) * tokens / 4
    assert roof.model_flops == pytest.approx(model, rel=1e-12)
    assert roof.hardware_flops == pytest.approx(model + 233_472 * tokens / 4, rel=1e-12)
    assert roof.tokens_per_step == tokens
    assert roof.tokens_per_second == pytest.approx(tokens / roof.step_seconds)


def test_roofline_properties_pick_the_slowest():
    r = acc.Roofline(100, 4e12, 5e12, 1e9, comm_seconds=3.0, compute_seconds=2.0, memory_seconds=1.0,
                     peak_flops=1e12)
    assert (r.step_seconds, r.step_seconds_no_overlap, r.bound) == (3.0, 6.0, "communication")
    assert r.mfu == pytest.approx(4 / 3) and r.tokens_per_second == pytest.approx(100 / 3)
    assert r.intensity == 5e3
    assert acc.Roofline(1, 1, 1, 0, 0, 1, 0, 1).intensity == math.inf


def test_roofline_multiplies_per_micro_batch_traffic_by_grad_accum():
    hw = get_hardware("h100")
    cfg = small_cfg("--remat.policy=full", batch=4)
    one = acc.training_roofline(cfg, acc.MeshShape(), hw, grad_accum=1)
    two = acc.training_roofline(cfg, acc.MeshShape(), hw, grad_accum=2)
    # Weights and activations per micro-batch (each half the activations), AdamW once.
    act2 = 2 * (L * X_IN * 32 + 59_392)
    assert two.hbm_bytes == pytest.approx(2 * 3 * SMALL_PARAMS * 2 + 2 * act2 + 7 * SMALL_PARAMS * 4, rel=1e-12)
    assert one.model_flops == two.model_flops


def test_critical_tokens_h100():
    """[HSM-R]: a bf16 matmul is compute-bound above C / W_hbm tokens; FSDP above
    b·C / (2·W): 6·B·P FLOPs against 3 collectives of P·b bytes."""
    hw = get_hardware("h100")
    crit = acc.critical_tokens_per_device(hw, bytes_per_param=4)
    assert crit["hbm"] == pytest.approx(989e12 / 3.35e12)
    assert crit["fsdp (intra-node)"] == pytest.approx(4 * 989e12 / (2 * 450e9))
    assert crit["fsdp (across nodes)"] == pytest.approx(4 * 989e12 / (2 * 50e9))
    # At that many tokens per device the compute time equals the 3 collectives' (n -> inf).
    b, p = crit["fsdp (intra-node)"], 8e9
    assert 6 * b * p / 989e12 == pytest.approx(3 * p * 4 / 450e9)
    assert acc.critical_tokens_per_device(hw)["fsdp (intra-node)"] == pytest.approx(989e12 / 450e9)
    # At achievable rates: the matmul rate over the copy bandwidth and over the measured link.
    rates = acc.Rates(744e12, 287e12, 2.91e12, link=222e9)
    at = acc.critical_tokens_per_device(hw, rates=rates)
    assert at["hbm"] == pytest.approx(744e12 / 2.91e12)
    assert at["fsdp (intra-node)"] == pytest.approx(2 * 744e12 / (2 * 222e9))
    assert at["fsdp (across nodes)"] == pytest.approx(2 * 744e12 / (2 * 50e9))  # the NIC is unmeasured
    # No measured link: the table's link fraction of the ring bandwidth.
    no_link = acc.critical_tokens_per_device(hw, rates=acc.Rates(744e12, 287e12, 2.91e12))
    assert no_link["fsdp (intra-node)"] == pytest.approx(744e12 / (450e9 * hw.link_fraction))


def test_plan_prints_the_fsdp_threshold_for_the_dtype_the_gathers_carry(capsys):
    """XLA:GPU gathers the weights in the compute dtype (bf16 with f32 params: compiled 1b steps
    on 2 H200s, docs/benchmarks.md "Multi-GPU scaling"), so the threshold is C / W per bf16 weight
    (989e12 / 450e9 = 2,198 on an H100); f32 compute gathers f32: twice that."""
    assert plan.main(["--config", f"{PRESETS}/llama3_8b.yaml", "--hardware", "h100", "--devices", "8",
                      "--train.batch_size=16", "--train.seq_len=1024"]) == 0
    assert f"fsdp (intra-node) {989e12 / 450e9:,.0f}," in capsys.readouterr().out  # 2,198
    assert plan.main(["--config", f"{PRESETS}/llama3_8b.yaml", "--hardware", "h100", "--devices", "8",
                      "--train.batch_size=16", "--train.seq_len=1024", "--model.compute_dtype=float32"]) == 0
    f32_out = capsys.readouterr().out
    assert f"fsdp (intra-node) {4 * 989e12 / (2 * 450e9):,.0f}," in f32_out  # 4,396


def test_plan_prints_the_fsdp_threshold_at_the_calibrated_rates(capsys):
    """The same bound at the achievable rates (on an H100, the H200's measured fractions): the
    matmul rate for C (the f32 rate under f32 compute, as the calibrated line prices them), the
    measured link for W; bf16 gathers carry 2 bytes a weight, f32 ones 4."""
    hw = get_hardware("h100")
    w = hw.ring_bandwidth * hw.link_fraction
    for extra, c, b in (([], hw.bf16_flops * hw.matmul_fraction, 2),
                        (["--model.compute_dtype=float32"], hw.bf16_flops * hw.f32_matmul_fraction, 4)):
        assert plan.main(["--config", f"{PRESETS}/llama3_8b.yaml", "--hardware", "h100", "--devices", "8",
                          "--train.batch_size=16", "--train.seq_len=1024", *extra]) == 0
        out = capsys.readouterr().out
        assert (f"compute-bound above, at these rates: hbm {c / (hw.hbm_bandwidth * hw.hbm_fraction):,.0f}, "
                f"fsdp (intra-node) {b * c / (2 * w):,.0f} tokens/device") in out, out[-400:]


# ----------------------------------------------------------------- calibrated time


def test_elementwise_bytes_by_hand():
    # forward 10·D + 2·(N+K)·H + 3·F, backward 12·D + 2·(N+K)·H + 5·F, in c; head and MLP
    # sized terms split over tensor; an XLA core adds (8 + c)·N·T forward, twice backward.
    e = acc.elementwise_bytes_per_token(SMALL, 16, c=2, flash=True)
    assert e == {"forward": (640 + 384 + 288) * 2, "backward": (768 + 384 + 480) * 2}
    x = acc.elementwise_bytes_per_token(SMALL, 16, c=2, flash=False, tp=2)
    core = 10 * N * 16 / 2
    assert x == {"forward": (640 + 192 + 144) * 2 + core, "backward": (768 + 192 + 240) * 2 + 2 * core}


def test_recomputed_bytes_by_hand():
    """What a policy redoes of the layer's elementwise forward: the norms with the mid-layer
    residual add (5·D), RoPE (2·(N+K)·H) and the SwiGLU product: F written beside the SwiGLU
    backward when gate and up are saved, 3·F as its own kernel when they are recomputed."""
    fused, alone = (5 * D + 2 * (N + K) * H + F) * 2, (5 * D + 2 * (N + K) * H + 3 * F) * 2
    rb = acc.recomputed_bytes_per_token
    assert rb(SMALL, 16, R.none, c=2, flash=True) == 0
    for policy, names in ((R.dots, ()), (R.selective, ()), (R.names, ("mlp_gate", "mlp_up")),
                          (R.offload, ("mlp_up", "mlp_gate", "query_proj"))):
        assert rb(SMALL, 16, policy, names, c=2, flash=True) == fused, policy
    for policy, names in ((R.full, ()), (R.names, ("mlp_gate",)), (R.offload, ("out_proj",))):
        assert rb(SMALL, 16, policy, names, c=2, flash=True) == alone, policy
    # tensor=2 halves head- and MLP-sized tensors; an XLA core recomputes its softmax passes
    assert rb(SMALL, 16, R.dots, c=2, flash=False, tp=2) == (5 * D + (N + K) * H + F / 2) * 2 + 10 * N * 16 / 2
    # the layer forward it had been priced as: 10·D + 2·(N+K)·H + 3·F
    assert rb(SMALL, 16, R.full, c=2, flash=True) < acc.elementwise_bytes_per_token(SMALL, 16, c=2, flash=True)["forward"]


def test_step_time_adds_kernels_and_overlaps_comms():
    rates = acc.Rates(matmul=600e12, attention=200e12, hbm=3e12, host=64e9, f32_matmul=250e12)
    st = acc.StepTime(6e12, 2e12, {"a": 1e9, "b": 2e9}, rates, comm_seconds=5e-3, host_bytes=64e6,
                      f32_matmul_flops=1e12, serial_comm_seconds=2e-3)
    assert st.matmul_seconds == pytest.approx(10e-3 + 4e-3)
    assert st.attention_seconds == pytest.approx(10e-3)
    assert st.memory_seconds == pytest.approx(1e-3)
    assert st.host_seconds == pytest.approx(1e-3)
    assert st.compute_seconds == pytest.approx(27e-3)
    assert st.seconds == pytest.approx(28e-3)  # comms (5 ms) overlap; host transfers add
    slow_comms = acc.StepTime(6e12, 2e12, {}, rates, comm_seconds=40e-3)
    assert slow_comms.seconds == pytest.approx(40e-3)
    # No f32 rate measured: f32 matmuls at the bf16 rate; no host rate: no host time.
    st0 = acc.StepTime(0, 0, {}, acc.Rates(600e12, 200e12, 3e12), host_bytes=1e9, f32_matmul_flops=6e12)
    assert st0.matmul_seconds == pytest.approx(10e-3) and st0.host_seconds == 0.0


def test_rates_of_the_h200_are_its_measured_fractions():
    r = acc.Rates.of(get_hardware("h200"))
    assert (r.matmul, r.attention, r.hbm, r.host, r.f32_matmul) == pytest.approx(
        (744e12, 287e12, 2.91e12, 64e9, 277e12))


def test_training_time_traffic_by_hand():
    """SMALL, one device, no hw (the XLA core), full remat, bf16 compute, grad_accum 2."""
    cfg = small_cfg("--remat.policy=full", batch=4)
    rates = acc.Rates(600e12, 200e12, 3e12)
    st = acc.training_time(cfg, acc.MeshShape(), rates=rates, grad_accum=2)
    tokens, p, c = 4 * 16, 4, 2
    e = acc.elementwise_bytes_per_token(SMALL, 16, c=c, flash=False)
    layer_w = L * LAYER_MATMUL
    assert st.traffic == pytest.approx({
        "layer elementwise forward": e["forward"] * tokens * L,
        "layer elementwise backward": e["backward"] * tokens * L,
        # full: the norms (2·D + 3·D with the mid residual add), RoPE, h on its own (3·F), the XLA core
        "recomputed elementwise forward": ((5 * D + 2 * (N + K) * H + 3 * F) * c + 10 * N * 16) * tokens * L,
        "saved residuals copied into the scan stack": 2 * L * X_IN * 32 * 2,  # per micro-batch of 2
        # zero-filled before the loops: the residual stack and the f32 layer-gradient stack
        "scan stacks zero-filled before the loops": (L * X_IN * 32 + p * L * (LAYER_MATMUL + 2 * D)) * 2,
        "final norm, embedding gather": 6 * D * c * tokens,
        "loss (f32 logits read twice, f32 gradient)": 12 * V * tokens,
        "weight casts f32 -> c": (p + c) * (2 * layer_w + (SMALL_PARAMS - layer_w)) * 2,
        "weight gradients c -> f32": (p + c) * SMALL_PARAMS * 2,
        "optimizer (grad norm + fused AdamW)": 8 * p * SMALL_PARAMS,
        "grad accumulation": 2 * p * SMALL_PARAMS * 2,
    }, rel=1e-12)
    # The XLA core's FLOPs (all T x T, 3 x forward + the recomputed forward) run as matmuls.
    f = acc.flops_per_token(SMALL, 16, causal=False)
    recompute = acc.recompute_flops_per_token(SMALL, 16, R.full, causal=False)
    assert st.attention_flops == 0
    assert st.matmul_flops + st.f32_matmul_flops == pytest.approx((f.total + recompute) * tokens, rel=1e-12)
    assert st.f32_matmul_flops == pytest.approx(4 * D * V * tokens, rel=1e-12)


def test_training_time_flash_and_chunked_loss_by_hand():
    """An H100 (flash core at the attention rate), dots, the chunked loss (chunks of 8)."""
    cfg = small_cfg("--remat.policy=dots", "--train.loss_chunk=8")
    st = acc.training_time(cfg, acc.MeshShape(), get_hardware("h100"), rates=acc.Rates(600e12, 200e12, 3e12))
    tokens, core = 32, 2 * 16 * N * H * L  # the causal forward core per token
    assert st.attention_flops == pytest.approx((3 * core + core) * tokens, rel=1e-12)  # + its recompute
    assert st.matmul_flops == pytest.approx(2 * 3 * (L * LAYER_MATMUL + D * V) * tokens, rel=1e-12)
    assert st.f32_matmul_flops == 0
    assert st.traffic["loss (chunked: f32 logits read, c gradient)"] == (4 + 2) * V * tokens
    assert st.traffic["loss (chunked: dW accumulation)"] == 2 * 4 * D * V * (16 // 8)
    none = acc.training_time(small_cfg(), acc.MeshShape(), get_hardware("h100"), rates=acc.Rates(600e12, 200e12, 3e12))
    assert none.attention_flops == pytest.approx(3 * core * tokens, rel=1e-12)
    assert none.traffic["recomputed elementwise forward"] == 0
    assert "grad accumulation" not in none.traffic


def test_f32_head_backward_under_tensor_parallelism():
    """The one-pass loss's head backward (dx and dW, 4·D·V FLOPs per token) in f32, per device
    its share of the step's tokens: tensor parallelism splits V, as it splits every other
    matmul. It had been divided by the tensor split twice (1/tp of it priced at f32)."""
    cfg = load_config(f"{PRESETS}/1b.yaml", ["--train.batch_size=8", "--train.seq_len=2048"])
    m, hw = cfg.model, get_hardware("h200")
    for mesh in (acc.MeshShape(1, 1, 2), acc.MeshShape(1, 2, 2), acc.MeshShape(1, 1, 4)):
        st = acc.training_time(cfg, mesh, hw)
        assert st.f32_matmul_flops == pytest.approx(4 * m.hidden_size * m.vocab_size * 8 * 2048 / mesh.devices)


def test_f32_compute_runs_every_matmul_at_the_f32_rate():
    """f32 compute on a GPU: every matmul has f32 inputs (TF32 on Hopper, the 277 TFLOP/s
    the H200's head backward measured), not just the head's backward; they had been priced
    at the bf16 rate (631)."""
    cfg = small_cfg("--model.compute_dtype=float32")
    rates = acc.Rates(631e12, 219e12, 2.91e12, f32_matmul=277e12)
    st = acc.training_time(cfg, acc.MeshShape(), get_hardware("h200"), rates=rates)
    dense = 2 * 3 * (L * LAYER_MATMUL + D * V) * 32
    assert st.matmul_flops == 0 and st.f32_matmul_flops == pytest.approx(dense, rel=1e-12)
    assert st.matmul_seconds == pytest.approx(dense / 277e12, rel=1e-12)
    # bf16 compute: only the one-pass loss's head backward (dx, dW) is f32.
    bf16 = acc.training_time(small_cfg(), acc.MeshShape(), get_hardware("h200"), rates=rates)
    assert bf16.f32_matmul_flops == pytest.approx(4 * D * V * 32, rel=1e-12)
    assert bf16.matmul_flops == pytest.approx(dense - 4 * D * V * 32, rel=1e-12)


def test_training_time_under_tensor_parallelism_by_hand():
    """tensor=2: a device streams its whole batch shard (tensor splits no batch), with head-
    and MLP-sized elementwise tensors halved; it casts its half of each layer matrix (exactly:
    L·43,008 / 2 = 64,512) and the rest of its 71,360 gathered elements once."""
    cfg = small_cfg("--remat.policy=dots")
    st = acc.training_time(cfg, acc.MeshShape(1, 1, 2), get_hardware("h100"), rates=acc.Rates(600e12, 200e12, 3e12))
    e = acc.elementwise_bytes_per_token(SMALL, 16, c=2, flash=True, tp=2)
    assert e["forward"] == (640 + 192 + 144) * 2
    assert st.traffic["layer elementwise forward"] == e["forward"] * 32 * L
    assert st.traffic["layer elementwise backward"] == e["backward"] * 32 * L
    layer_w, gathered = L * LAYER_MATMUL // 2, 71_360
    assert st.traffic["weight casts f32 -> c"] == (4 + 2) * (2 * layer_w + (gathered - layer_w))
    assert st.traffic["weight gradients c -> f32"] == (4 + 2) * gathered
    assert st.traffic["loss (f32 logits read twice, f32 gradient)"] == 12 * (V / 2) * 32


def test_training_time_offload_moves_residuals_both_ways():
    """offload: each tagged residual goes to host memory in the forward and comes back in the
    backward; the transfers add to the compute at the host link's rate."""
    cfg = small_cfg("--remat.policy=offload", "--remat.names=[mlp_gate,mlp_up]")
    rates = acc.Rates(600e12, 200e12, 3e12, host=64e9)
    st = acc.training_time(cfg, acc.MeshShape(), get_hardware("h200"), rates=rates)
    one_way = L * 2 * (2 * F) * 32  # gate and up, bf16, 32 tokens, every layer
    assert st.host_bytes == 2 * one_way
    assert st.host_seconds == pytest.approx(2 * one_way / 64e9)
    assert st.seconds == pytest.approx(st.compute_seconds + st.host_seconds)


def test_training_time_needs_rates_or_hardware():
    with pytest.raises(ValueError, match="needs measured rates or a hardware entry"):
        acc.training_time(small_cfg(), acc.MeshShape())


def test_is_flash():
    from scaling.config import AttentionImpl as I

    assert acc.is_flash(I.auto, get_hardware("h100")) and not acc.is_flash(I.auto, get_hardware("tpu_v5e"))
    assert not acc.is_flash(I.auto, None) and not acc.is_flash(I.xla, get_hardware("h100"))
    assert acc.is_flash(I.cudnn, None) and acc.is_flash(I.pallas, None)


# -------------------------------------------------------------------------- hardware


@pytest.mark.parametrize("key, flops, hbm_bw, hbm_gib, link", [
    # NVIDIA datasheets: dense bf16 (half the sparsity figure), HBM, NVLink egress (half the
    # bidirectional figure: H100/H200 900 GB/s, A100 600 GB/s).
    ("h100", 989e12, 3.35e12, 80, 450e9),
    ("h200", 989e12, 4.8e12, 141, 450e9),
    ("a100", 312e12, 2.039e12, 80, 300e9),
    ("a100_40gb", 312e12, 1.555e12, 40, 300e9),
    ("h100_pcie", 756e12, 2.0e12, 80, 300e9),
])
def test_gpu_datasheet_numbers(key, flops, hbm_bw, hbm_gib, link):
    hw = HARDWARE[key]
    assert (hw.bf16_flops, hw.hbm_bandwidth, hw.hbm_bytes, hw.ring_bandwidth) == (flops, hbm_bw, hbm_gib * 2**30, link)
    assert hw.usable_bytes == pytest.approx(0.92 * hbm_gib * 2**30)


def test_tpu_numbers_from_the_book():
    """How to Scale Your Model, TPUs chapter: v5e 1.97e14 FLOP/s, 8.1e11 B/s HBM, 4.5e10 B/s
    per link one way; v5p 4.59e14, 9e10 per link. A ring along one axis uses its two links:
    W_ici = 2 x one-way."""
    v5e, v5p = get_hardware("v5e"), get_hardware("tpu-v5p")
    assert (v5e.bf16_flops, v5e.hbm_bandwidth, v5e.ring_bandwidth) == (1.97e14, 8.1e11, 9e10)
    assert (v5p.bf16_flops, v5p.ring_bandwidth) == (4.59e14, 1.8e11)
    assert v5e.dcn_bandwidth == 6.4e12 / 8 / 256  # 6.4 Tb/s per 256-chip pod
    assert v5p.dcn_bandwidth == 50e9 / 8


@pytest.mark.parametrize("name, key", [("H100", "h100"), ("tpu-v5e", "tpu_v5e"), ("  TPU_V5P ", "tpu_v5p"),
                                       ("h100 pcie", "h100_pcie"), ("A100-40GB", "a100_40gb")])
def test_get_hardware_spellings(name, key):
    assert get_hardware(name) is HARDWARE[key]


def test_get_hardware_unknown_names_the_allowed():
    with pytest.raises(ValueError, match="unknown hardware 'b200'; allowed: h100, h200, a100, tpu_v5e"):
        get_hardware("b200")


@pytest.mark.parametrize("kind, key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100_pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-SXM4-40GB", "a100_40gb"), ("TPU v5 lite", "tpu_v5e"),
    ("TPU v5", "tpu_v5p"), ("TPU v5e", "tpu_v5e"), ("TPU v5p", "tpu_v5p"),
    ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100 80GB PCIe", None), ("NVIDIA A100-PCIE-40GB", None), ("TPU v4", None), ("TPU v6 lite", None),
    ("cpu", None),
])
def test_by_device_kind(kind, key):
    assert by_device_kind(kind) is (HARDWARE[key] if key else None)


def test_hardware_defaults():
    hw = Hardware("x", 1e15, 1e12, 2**30, 100e9, 10e9, "test")
    assert hw.ring_bandwidth == 100e9 and hw.usable_bytes == pytest.approx(0.92 * 2**30)
    assert (hw.matmul_fraction, hw.attention_fraction, hw.hbm_fraction, hw.devices_per_node) == (1.0, 1.0, 1.0, 8)


# ----------------------------------------------------------------------------- plan


@pytest.mark.parametrize("n", [1, 6, 8, 12])
def test_factorizations_are_every_ordered_triple_once(n):
    brute = {(d, f, t) for d, f, t in itertools.product(range(1, n + 1), repeat=3) if d * f * t == n}
    got = list(plan._factorizations(n))
    assert len(got) == len(set(got)) and set(got) == brute


def test_accums_divide_the_batch_and_leave_the_batch_axes_a_whole_share():
    cfg = small_cfg(batch=16)
    assert plan._accums(cfg, acc.MeshShape(1, 4, 1)) == [1, 2, 4]  # 16/a split 4 ways
    assert plan._accums(cfg, acc.MeshShape(1, 1, 4)) == [1, 2, 4, 8, 16]  # tensor splits no batch
    assert plan._accums(small_cfg(batch=6), acc.MeshShape(1, 4, 1)) == []


def test_candidate_meshes_keep_tensor_in_a_node_and_divisible():
    cfg = small_cfg(batch=16)
    pcie = get_hardware("h100_pcie")  # NVLink bridges pairs: tensor <= 2
    meshes = plan.candidate_meshes(cfg, pcie, 4)
    shapes = {(x.data, x.fsdp, x.tensor) for x in meshes}
    # Every shape of 4 but tensor=4 (over a pair, and K=2 kv heads would not divide anyway).
    assert shapes == {(1, 4, 1), (4, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)}
    pairs = plan.candidate_meshes(cfg, pcie, 2)
    assert {(x.data, x.fsdp, x.tensor) for x in pairs} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}


def test_search_returns_the_fastest_fitting_candidates_in_order():
    """Brute force: per (mesh, policy) the smallest grad_accum that fits (more accumulation
    only repeats the same work in more pieces), ranked by the calibrated step time."""
    hw = get_hardware("h100")
    cfg = small_cfg(batch=16)
    best = []
    for mesh in plan.candidate_meshes(cfg, hw, 4):
        for policy in plan.SEARCH_POLICIES:
            fitting = [plan.evaluate(cfg, mesh, hw, policy, a) for a in plan._accums(cfg, mesh)]
            fitting = [c for c in fitting if c.memory.total <= hw.usable_bytes]
            if fitting:
                best.append(fitting[0])
    best.sort(key=lambda c: c.time.seconds)
    got = plan.search(cfg, hw, 4, top=5)
    assert [(c.mesh, c.policy, c.grad_accum) for c in got] == [(c.mesh, c.policy, c.grad_accum) for c in best[:5]]
    assert all(c.grad_accum == 1 for c in got)  # SMALL fits anywhere without accumulation


def test_search_stops_at_the_smallest_grad_accum_that_fits():
    """A device just big enough for `none` at two micro-batches: `none` appears once, with
    grad_accum 2 (4, 8, 16 also fit but only repeat the work in smaller pieces)."""
    import dataclasses

    cfg = small_cfg(batch=16)
    h100 = get_hardware("h100")
    need = plan.evaluate(cfg, acc.MeshShape(), h100, R.none, 2).memory.total
    assert plan.evaluate(cfg, acc.MeshShape(), h100, R.none, 1).memory.total > need
    hw = dataclasses.replace(h100, hbm_bytes=need, usable_fraction=1.0)
    got = plan.search(cfg, hw, 1, top=100)
    expected = []
    for policy in plan.SEARCH_POLICIES:
        fits = [a for a in plan._accums(cfg, acc.MeshShape())
                if plan.evaluate(cfg, acc.MeshShape(), hw, policy, a).memory.total <= need]
        expected += [(policy, fits[0])] if fits else []
    assert sorted((c.policy, c.grad_accum) for c in got) == sorted(expected)
    assert (R.none, 2) in expected


def test_evaluate_prices_the_candidate_policy():
    """The search table's roofline column is the candidate's policy's, not the config's."""
    hw = get_hardware("h100")
    cfg = small_cfg()  # remat none
    full = plan.evaluate(cfg, acc.MeshShape(), hw, R.full, 1)
    none = plan.evaluate(cfg, acc.MeshShape(), hw, R.none, 1)
    assert full.roofline.hardware_flops - none.roofline.hardware_flops == pytest.approx(233_472 * 32)
    assert full.memory.activations.per_layer == X_IN * 32


def test_candidate_fits_at_exactly_the_usable_bytes():
    hw = get_hardware("h100")
    c = plan.evaluate(small_cfg(), acc.MeshShape(), hw, R.none, 1)
    at = plan.Candidate(c.mesh, c.policy, 1, c.memory, c.roofline, c.time, c.memory.total)
    below = plan.Candidate(c.mesh, c.policy, 1, c.memory, c.roofline, c.time, c.memory.total - 1)
    assert at.fits and not below.fits


def test_plan_report_numbers_by_hand(capsys):
    """The printed params, devices and tokens per device, for SMALL on 4 H100s (fsdp 2 x tensor 2),
    two micro-batches of 8."""
    cfg = small_cfg("--mesh.fsdp=2", "--mesh.tensor=2", "--train.grad_accum=2", batch=16)
    out = plan.report(cfg, acc.MeshShape(1, 2, 2), get_hardware("h100"))
    assert f"params     {SMALL_PARAMS:,} (35,904 per device)" in out
    assert "= 4 devices, rules=default" in out
    assert f"tokens/device/micro-batch {16 * 16 // 2 // 2:,}; compute-bound above: hbm 295," in out
    assert f"dense {3 * 2 * (L * LAYER_MATMUL + D * V):.3e} + attention (causal) {3 * 2 * 16 * N * H * L:.3e}" in out
    assert f"6N = {6 * SMALL_PARAMS:.3e}" in out


def test_plan_devices_default_to_the_fixed_mesh(capsys):
    assert plan.main(["--config", f"{PRESETS}/tiny.yaml", "--mesh.data=2", "--mesh.fsdp=2", "--mesh.tensor=1"]) == 0
    assert "{'data': 2, 'fsdp': 2, 'tensor': 1} = 4 devices" in capsys.readouterr().out
    assert plan.main(["--config", f"{PRESETS}/tiny.yaml"]) == 0  # fsdp=-1: 8 devices
    assert "{'data': 1, 'fsdp': 8, 'tensor': 1} = 8 devices" in capsys.readouterr().out
    assert plan.main(["--config", f"{PRESETS}/tiny.yaml", "--devices", "1"]) == 0
    assert "= 1 devices" in capsys.readouterr().out
