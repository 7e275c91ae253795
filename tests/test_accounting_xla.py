"""The accounting's per-device numbers on 8 simulated CPU devices, against what XLA compiles.

Each test compares one quantity with an independent reference read from the compiled program
(output shardings, the collectives of the backward scan's body, the cost analysis), not with
the whole-step memory total, where XLA:CPU's own buffers (the copied AdamW moments, the
all-reduced [D, V] head gradient, layout copies) blur a few-percent term. Tiny shapes: B=16,
T=32 on the tiny preset (D=128, N=4, K=2, H=32, F=384, V=1024, L=4).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaling import accounting as acc
from scaling.config import ModelConfig, RematConfig, RematPolicyName as R, load_config
from scaling.model import build_model
from scaling.sharding import sharding_rules
from scaling.train import abstract_state, cross_entropy, make_setup, make_train_step, model_loss

B, T = 16, 32
BF16 = "--model.compute_dtype=bfloat16"
F32 = "--model.compute_dtype=float32"


def tiny(mesh, policy, *extra):
    d, f, t = mesh
    return load_config("configs/models/tiny.yaml", [
        "--data.source=synthetic", f"--train.batch_size={B}", f"--train.seq_len={T}", f"--mesh.data={d}",
        f"--mesh.fsdp={f}", f"--mesh.tensor={t}", f"--remat.policy={policy}", *extra])


def c_bytes(cfg):
    return acc.dtype_bytes(cfg.model.compute_dtype, accelerator=False)


_STEPS = {}


def compiled_step(mesh, policy, *extra):
    """The real train step's compiled HLO text, per (mesh, policy, overrides), compiled once."""
    key = (mesh, policy, extra)
    if key not in _STEPS:
        cfg = tiny(mesh, policy, *extra)
        setup = make_setup(cfg, devices=jax.devices()[:8])
        batch = jax.ShapeDtypeStruct((B, T + 1), jnp.int32, sharding=setup.batch_sharding)
        _STEPS[key] = cfg, make_train_step(setup).lower(abstract_state(setup), batch).compile()
    return _STEPS[key]


# ------------------------------------------------------------------------- HLO reading

_DTYPE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}
_ARRAY = re.compile(r"\b(f32|bf16|f16|s32|u32|pred)\[([0-9,]*)\]")
_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(t, tuple(int(x) for x in dims.split(",") if x)) for t, dims in _ARRAY.findall(shape)]


def computations(hlo: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"(?:ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if m:
            cur = m.group(1)
            comps[cur] = []
        elif line.startswith("}"):
            cur = None
        elif cur:
            comps[cur].append(line)
    return comps


def backward_scan_body(hlo: str) -> list[str]:
    """The instructions of the layer scan's backward loop (the while op JAX names transpose(jvp()))."""
    comps = computations(hlo)
    bodies = [re.search(r"body=%([\w.\-]+)", line).group(1) for lines in comps.values() for line in lines
              if " while(" in line and "transpose(jvp())/while" in line]
    assert len(bodies) == 1, bodies
    return comps[bodies[0]]


def ops(lines, opcode):
    for line in lines:
        m = _INSTR.match(line)
        if m and m.group(3) in (opcode, opcode + "-start"):
            yield m.group(2), line


# ----------------------------------------------------------------- the saved residual stack


def residual_stack_bytes_per_device(cfg) -> int:
    """Per-device bytes of the stacked ([L, ...]) residuals JAX saves for the backward pass, as
    XLA shards them: jit a function returning the vjp closure (whose leaves are the residuals)
    under the mesh and read the compiled output shardings. The parameters, also residuals, are
    inputs (not counted, as in tests/test_remat.py)."""
    setup = make_setup(cfg, devices=jax.devices()[:8])
    params = abstract_state(setup)["params"]
    tokens = jax.ShapeDtypeStruct((B, T + 1), jnp.int32, sharding=setup.batch_sharding)

    def residuals(p, tok):
        with sharding_rules(setup.mesh, setup.rules):
            return jax.vjp(lambda q: model_loss(setup.model(q), tok), p)[1]

    lowered = jax.jit(residuals).lower(params, tokens)
    compiled = lowered.compile()
    param_avals = {(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(params)}
    total = 0
    outs = zip(jax.tree.leaves(lowered.out_info), jax.tree.leaves(compiled.output_shardings), strict=True)
    for aval, sharding in outs:
        key = (tuple(aval.shape), np.dtype(aval.dtype))
        if aval.shape[:1] == (cfg.model.num_layers,) and key not in param_avals:
            total += math.prod(sharding.shard_shape(tuple(aval.shape))) * np.dtype(aval.dtype).itemsize
    return total


@pytest.mark.parametrize("mesh,policy", [((1, 8, 1), "none"), ((1, 4, 2), "none"), ((2, 2, 2), "dots")])
def test_saved_residual_stack_per_device_matches_xla(devices, mesh, policy):
    """`none` with c != p saves each layer's weights cast to the compute dtype. Each device casts
    its own shard, so the saved casts are sharded like the parameters (1/8 of the layer on
    fsdp=8, on fsdp=4 x tensor=2): the accounting had counted the whole layer on every device
    (+1.4 MB of 19.7 MB here, +7%; for Llama 3 8B on fsdp=8 about 12 GB)."""
    cfg = tiny(mesh, policy, BF16)
    xla = residual_stack_bytes_per_device(cfg)
    act = acc.activation_bytes(cfg.model, T, B, R(policy), c=2, p=4, mesh=acc.MeshShape(*mesh))
    assert act.layers == xla, (act.layers, xla)


def zero_filled_stacks(hlo: str, layers: int, backward: bool) -> int:
    """Bytes of the [L, ...] buffers a layer scan's while loop starts from that are broadcasts of
    a constant (through copies), not parameters: the stacks XLA fills before the loop (the
    forward's residual stacks, the backward's gradient stacks)."""
    comps = computations(hlo)
    defs = {}
    for lines in comps.values():
        for line in lines:
            if m := _INSTR.match(line):
                defs[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    tag = "transpose(jvp())/while" if backward else "jvp()/while"
    loops = [line for lines in comps.values() for line in lines
             if " while(" in line and tag in line and (backward or "transpose(" not in line)]
    assert len(loops) == 1, loops
    total = 0
    for name in re.findall(r"%([\w.\-]+)", defs[re.search(r"while\(%([\w.\-]+)\)", loops[0]).group(1)][2]):
        (dtype, dims), = arrays(defs[name][0])
        root = name
        while defs[root][1] in ("copy", "bitcast"):
            root = re.search(r"%([\w.\-]+)", defs[root][2]).group(1)
        _, op, args = defs[root]
        filled = op == "broadcast" or (op == "fusion" and all(defs[a][1] == "constant"
                                                               for a in re.findall(r"%([\w.\-]+)", args.split(")")[0])))
        if dims[:1] == (layers,) and filled:
            total += math.prod(dims) * _DTYPE[dtype]
    return total


@pytest.mark.parametrize("policy", ["none", "dots"])
def test_scan_stacks_are_zero_filled_before_the_loops(devices, policy):
    """lax.scan's stacked outputs start as zeros: the forward loop starts from zero-filled residual
    stacks (the saved residuals, per device), the backward loop from zero-filled gradient stacks
    (every layer parameter, per device, in the param dtype). training_time's zero-fill term is
    those bytes; on an H200 the same broadcasts ran before the loops (docs/benchmarks.md,
    "Forty-ninth session")."""
    mesh = (1, 8, 1)
    cfg, compiled = compiled_step(mesh, policy, BF16)
    hlo, layers = compiled.as_text(), cfg.model.num_layers
    fwd, bwd = zero_filled_stacks(hlo, layers, backward=False), zero_filled_stacks(hlo, layers, backward=True)
    shape = acc.MeshShape(*mesh)
    act = acc.activation_bytes(cfg.model, T, B, R(policy), c=2, p=4, mesh=shape)
    assert fwd == act.layers > 0
    assert bwd == 4 * acc.weight_elems_per_device(cfg.model, shape, acc.LAYER_PARAMS, gathered=False) > 0
    st = acc.training_time(cfg, shape, rates=acc.Rates(1e12, 1e12, 1e12), accelerator=False)
    assert st.traffic["scan stacks zero-filled before the loops"] == fwd + bwd


# ------------------------------------------------------- the layer backward's weights in use


def activation_terms(rs, tokens, mesh, weight_elems) -> float:
    """A residual list's entries, per device, but the weight-shaped one (`weight_elems` elements)."""
    return sum(r.bytes(tokens, mesh.split(r.tp_axis) if r.tp_axis else 1) for r in rs
               if r.per_token or r.elems != weight_elems)


@pytest.mark.parametrize("mesh,dtype", [((1, 8, 1), F32), ((1, 4, 2), BF16)])
def test_layer_working_set_holds_the_weights_the_backward_gathers(devices, mesh, dtype):
    """While a layer is differentiated its matmuls read its weights all-gathered over FSDP and
    split over `tensor`: the backward scan's all-gathers produce exactly those elements each
    trip (one layer), in the parameter dtype; with bf16 compute the matmuls read their bf16
    cast. The working set had left them out with f32 compute (0 of 786 kB per layer on
    fsdp=8) and counted the whole, unsplit layer under tensor parallelism (2x on tensor=2)."""
    cfg, compiled = compiled_step(mesh, "full", dtype)
    gathered = sum(math.prod(dims) for shape, _ in ops(backward_scan_body(compiled.as_text()), "all-gather")
                   for _, dims in arrays(shape))
    m, c, ms = cfg.model, c_bytes(cfg), acc.MeshShape(*mesh)
    tokens = B * T / ms.split("batch")
    act = acc.activation_bytes(m, T, B, R.full, c=c, p=4, mesh=ms)
    w = acc.layer_matmul_params(m)
    activations = activation_terms(acc.layer_residuals(m, T, R.none, c=c, p=4), tokens, ms, w)
    activations += activation_terms(acc.backward_temporaries(m, c=c), tokens, ms, w)
    assert act.working_layer - activations == gathered * c, (act.working_layer - activations, gathered * c)


@pytest.mark.parametrize("mesh,dtype", [((1, 4, 2), F32), ((1, 4, 2), BF16)])
def test_head_phase_holds_the_head_weight_as_its_matmuls_read_it(devices, mesh, dtype):
    """The head phase holds the output head's weight as its matmuls read it: all-gathered over
    fsdp (XLA's all-gather of head_dv) and split over `tensor` like the logits, [D, V/2], in the
    compute dtype. The accounting had counted a whole [D, V] cast (2x on tensor=2) and, with
    f32 compute, nothing, though FSDP gathers the weight."""
    cfg, compiled = compiled_step(mesh, "full", dtype)
    hlo = compiled.as_text()
    entry = re.search(r"^ENTRY %([\w.\-]+)", hlo, re.M).group(1)
    head = [math.prod(dims) for shape, line in ops(computations(hlo)[entry], "all-gather")
            if "head_dv" in line or "btd,dv->btv" in line for _, dims in arrays(shape)]
    assert head, "no all-gather of the head weight"
    m, c, ms = cfg.model, c_bytes(cfg), acc.MeshShape(*mesh)
    tokens = B * T / ms.split("batch")
    act = acc.activation_bytes(m, T, B, R.full, c=c, p=4, mesh=ms)
    weight = act.head - activation_terms(acc.head_residuals(m, c=c, p=4), tokens, ms, m.hidden_size * m.vocab_size)
    assert weight == max(head) * c, (weight, max(head) * c)


# ------------------------------------------------------------------- recomputation under full


def test_full_remat_recomputes_all_but_the_down_projection():
    """jax.checkpoint re-runs only what the backward reads: the down projection's output feeds
    only the residual add that makes the layer output, so `full` never recomputes it. XLA's
    FLOP count (unrolled layers: a while body is counted once) of full minus none is the
    prediction within the elementwise recompute XLA also counts (norms, RoPE, SwiGLU, softmax:
    1.5%); the old formula, the whole layer forward again, was 31% over."""
    m = ModelConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=384,
                    max_seq_len=16, scan_layers=False, compute_dtype="float32")
    b, t = 4, 8
    tok = jnp.zeros((b, t + 1), jnp.int32)
    flops = {}
    for policy in (R.none, R.full):
        gd, params = nnx.split(build_model(m, remat_cfg=RematConfig(policy=policy)))
        grad = jax.jit(jax.grad(lambda p, x: cross_entropy(nnx.merge(gd, p)(x[:, :-1]), x[:, 1:])))
        flops[policy] = grad.lower(params, tok).compile().cost_analysis()["flops"]
    xla = (flops[R.full] - flops[R.none]) / (b * t)
    predicted = acc.recompute_flops_per_token(m, t, R.full, causal=False)  # the xla core computes all T^2
    assert 0 < (xla - predicted) / xla < 0.03, (xla, predicted)


def tensor_allreduce_elems(hlo: str, mesh) -> int:
    """Elements of [B/(data x fsdp), T, D] all-reduces over the tensor axis (the Megatron ones),
    summed over the step: the layer scans' bodies run L times."""
    d, f, t = mesh
    groups = f"[{d * f},{t}]<=[{d * f * t}]"  # iota groups of `tensor` consecutive devices: the last mesh axis
    comps = computations(hlo)
    trips = {}
    for lines in comps.values():
        for line in lines:
            if " while(" in line:
                trips[re.search(r"body=%([\w.\-]+)", line).group(1)] = int(
                    re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1))
    total = 0
    for name, lines in comps.items():
        for shape, line in ops(lines, "all-reduce"):
            if f"replica_groups={groups}," in line or "{'tensor'}" in line:
                total += trips.get(name, 1) * sum(math.prod(dims) for _, dims in arrays(shape)
                                                  if dims == (B // (d * f), T, 128))
    return total


def test_full_remat_reruns_one_tensor_parallel_allreduce_per_layer(devices):
    """Megatron's forward all-reduces follow the out and the down projection; `full` recomputes
    the first (the MLP's input needs it) and never the second (nothing reads the layer output).
    XLA:CPU: full - none = one [B, T, D] all-reduce per layer; the accounting had two."""
    from scaling.hardware import get_hardware

    mesh = (2, 2, 2)

    def predicted(cfg):
        comms = acc.training_comms(cfg, acc.MeshShape(*mesh), get_hardware("h100"), accelerator=False)
        return sum(x.bytes for x in comms if x.axis == "tensor")

    (cfg_full, full), (cfg_none, none) = compiled_step(mesh, "full", F32), compiled_step(mesh, "none", F32)
    xla = (tensor_allreduce_elems(full.as_text(), mesh) - tensor_allreduce_elems(none.as_text(), mesh)) * 4
    assert xla == predicted(cfg_full) - predicted(cfg_none) == cfg_full.model.num_layers * B // 4 * T * 128 * 4


# ---------------------------------------------------------------------- state per device


@pytest.mark.parametrize("mesh", [(1, 8, 1), (1, 4, 2), (2, 2, 2)])
def test_params_and_optimizer_state_per_device_are_xlas_arguments(devices, mesh):
    """XLA's argument bytes are the params + AdamW moments the accounting predicts, plus the
    batch shard and the step's scalars (count, step, rng, non-finite counters: 32 bytes)."""
    policy, dtype = {(1, 8, 1): ("full", F32), (1, 4, 2): ("full", BF16), (2, 2, 2): ("full", F32)}[mesh]
    cfg, compiled = compiled_step(mesh, policy, dtype)
    mem = acc.training_memory(cfg, acc.MeshShape(*mesh), accelerator=False)
    batch = B // (mesh[0] * mesh[1]) * (T + 1) * 4
    assert compiled.memory_analysis().argument_size_in_bytes == mem.params + mem.optimizer + batch + 32
