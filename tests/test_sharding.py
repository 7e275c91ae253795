"""Sharded training is one-device training, laid out differently.

The core check: from the same initial state, three AdamW steps of the tiny model on six
(data, fsdp, tensor) meshes of 8 simulated devices give the losses, gradient norms and
parameters of a one-device run. Tolerances (f32 compute, "highest" matmul precision,
measured on 8 CPU devices):

- loss and grad_norm: rtol 1e-5. Measured <= 3e-7: only the summation order of the
  cross-device reductions differs, an f32 rounding effect of a few ulps.
- parameters: max |diff| <= 1e-5 for the weight matrices, measured <= 3e-6. The one larger
  difference is in the embedding table (measured 3.7e-5, bound 1e-4): Adam divides each
  element's update by its own RMS, so an element whose gradient is ~1e-7 (rows that few
  tokens touch) turns an f32 rounding difference of ~1e-8 into an O(lr) change of its
  update. Gradients themselves agree to ~2e-8 there. A real sharding bug moves every
  element by O(lr) = 1e-4..3e-4 and changes loss and grad_norm at once; grad_norm also
  catches the scale errors (a double-counted reduction) that Adam's normalisation hides.

Compile time dominates on CPU, so each mesh compiles one train step (at XLA backend
optimisation level 0: same numerics contract, half the compile time), and every mesh
starts from the one-device initial state moved into its shardings with device_put.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from scaling.config import MeshConfig, load_config
from scaling.data import make_dataset
from scaling.sharding import MeshError, ShardingError, make_mesh, resolve_mesh_shape, use_sharding
from scaling.train import abstract_state, global_batch, init_state, make_setup, make_train_step

TINY = "configs/models/tiny.yaml"
STEPS = 3
# tiny with 8 query / 4 kv heads (GQA groups of 2, like tiny's 4/2) so that tensor=4 divides
# the kv heads: one model, and so one one-device reference, serves all six meshes.
BASE = [
    "data.source=synthetic",
    "model.compute_dtype=float32",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "train.batch_size=8",
    "train.seq_len=32",
    f"train.steps={STEPS}",
    "checkpoint.enabled=false",
]
FAST_COMPILE = {"xla_backend_optimization_level": 0}
MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 1, 4)]


def tiny_config(mesh=(1, 1, 1), *extra):
    data, fsdp, tensor = mesh
    return load_config(TINY, [*BASE, f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", *extra])


def train_steps(setup, state):
    """STEPS steps on the synthetic batches; host copies of losses, grad norms, final state."""
    data = make_dataset(setup.cfg)
    losses, norms = [], []
    with use_sharding(setup.mesh, setup.rules):
        batch = global_batch(setup, next(data.train))
        step = make_train_step(setup).lower(state, batch).compile(compiler_options=FAST_COMPILE)
        for i in range(STEPS):
            if i:
                batch = global_batch(setup, next(data.train))
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(norms), state


@pytest.fixture(scope="module")
def reference(devices):
    setup = make_setup(tiny_config(), devices=devices[:1])
    init = jax.device_get(init_state(setup))
    losses, norms, state = train_steps(setup, jax.device_put(init, setup.state_shardings))
    return {"init": init, "losses": losses, "norms": norms, "params": jax.device_get(state["params"])}


def _flat(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="."): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _param_tolerance(name: str) -> float:
    return 1e-4 if name == "embed.table_vd" else 1e-5  # see the module docstring


def assert_specs_follow_rules(state, setup):
    """The arrays' actual shardings are the ones the rule set asks for."""
    want = _flat(setup.state_shardings["params"])
    for name, x in _flat(state["params"]).items():
        assert x.sharding.spec == want[name].spec, (name, x.sharding.spec, want[name].spec)
        assert x.sharding.mesh.shape == setup.mesh.shape


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_sharded_training_matches_one_device(mesh, reference, devices):
    setup = make_setup(tiny_config(mesh), devices=devices)
    assert dict(setup.mesh.shape) == dict(zip(("data", "fsdp", "tensor"), mesh))
    if mesh == (1, 8, 1):
        # Sharded init under jit gives bit-identical values: the PRNG is partitionable.
        state = init_state(setup)
        for name, x in _flat(state["params"]).items():
            np.testing.assert_array_equal(np.asarray(x), _flat(reference["init"]["params"])[name], err_msg=name)
    else:
        state = jax.device_put(reference["init"], setup.state_shardings)
    losses, norms, state = train_steps(setup, state)

    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(norms, reference["norms"], rtol=1e-5, atol=0)
    ref = _flat(reference["params"])
    for name, x in _flat(jax.device_get(state["params"])).items():
        diff = float(np.max(np.abs(x - ref[name])))
        assert diff <= _param_tolerance(name), f"{name}: max |diff| {diff:.2e} on mesh {mesh}"
    assert_specs_follow_rules(state, setup)


def test_param_specs_by_hand(devices):
    """The default rule set on data=1, fsdp=4, tensor=2, written out (not recomputed)."""
    setup = make_setup(tiny_config((1, 4, 2)), devices=devices)
    got = {k: v.spec for k, v in _flat(setup.state_shardings["params"]).items()}
    assert got == {
        "blocks.attn.k_dkh": P(None, "fsdp", "tensor", None),
        "blocks.attn.o_nhd": P(None, "tensor", None, "fsdp"),
        "blocks.attn.q_dnh": P(None, "fsdp", "tensor", None),
        "blocks.attn.v_dkh": P(None, "fsdp", "tensor", None),
        "blocks.attn_norm.scale": P(None, None),
        "blocks.mlp.down_fd": P(None, "tensor", "fsdp"),
        "blocks.mlp.gate_df": P(None, "fsdp", "tensor"),
        "blocks.mlp.up_df": P(None, "fsdp", "tensor"),
        "blocks.mlp_norm.scale": P(None, None),
        "embed.table_vd": P("tensor", "fsdp"),
        "final_norm.scale": P(None),
        "head_dv": P("fsdp", "tensor"),
    }
    assert setup.batch_sharding.spec == P("fsdp", None)
    # Optimizer moments follow their parameters.
    mu = _flat(setup.state_shardings["opt_state"])
    assert any(k.endswith("mu.blocks.mlp.down_fd") and v.spec == P(None, "tensor", "fsdp") for k, v in mu.items())


def test_sharded_training_with_the_pallas_kernels_matches_one_device(reference, devices):
    """attention.impl=pallas on a (2, 2, 2) mesh: the kernels run per device inside a shard_map
    (attention.pallas_attention), in the scanned, rematerialised train step; the losses and
    gradient norms are the one-device xla run's (the kernels' f32 math differs from the
    reference's only in summation order)."""
    setup = make_setup(tiny_config((2, 2, 2), "attention.impl=pallas"), devices=devices)
    state = jax.device_put(reference["init"], setup.state_shardings)
    losses, norms, _ = train_steps(setup, state)
    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-4, atol=0)
    np.testing.assert_allclose(norms, reference["norms"], rtol=1e-4, atol=0)


@pytest.mark.parametrize("rules,expected", [("fsdp", P(None, ("fsdp", "tensor"), None, None)), ("dp", P(None, None, None, None))])
def test_other_rule_sets(rules, expected, devices):
    setup = make_setup(tiny_config((1, 4, 2), f"mesh.rules={rules}"), devices=devices)
    assert setup.state_shardings["params"]["blocks"]["attn"]["q_dnh"].spec == expected


def test_fsdp8_holds_an_eighth_per_device(devices):
    """With fsdp=8, each device holds ~1/8 of the parameter and optimizer-state bytes."""
    setup = make_setup(tiny_config((1, 8, 1)), devices=devices)
    state = init_state(setup)
    assert_specs_follow_rules(state, setup)

    def bytes_on(tree, device):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)

    for part in ("params", "opt_state"):
        total = sum(x.nbytes for x in jax.tree.leaves(state[part]))
        for d in devices:
            share = bytes_on(state[part], d) / total
            # Exactly 1/8 but for the replicated RMSNorm scales (and Adam's step count).
            assert 1 / 8 <= share < 1 / 8 + 0.01, (part, d, share)


def test_train_step_keeps_its_constraints_when_lowered_outside_use_sharding(devices):
    """make_train_step's step carries the activation constraints wherever it is traced: lowered
    outside `use_sharding` (a user timing or inspecting the step), it is the program the training
    loop runs. Before, `constrain` was the identity there, and with fsdp=8 XLA kept the whole
    batch on every device (6x the temporary memory)."""
    setup = make_setup(tiny_config((1, 8, 1)), devices=devices)
    state = abstract_state(setup)
    batch = jax.ShapeDtypeStruct((8, 32), np.int32, sharding=setup.batch_sharding)
    outside = make_train_step(setup).lower(state, batch)
    with use_sharding(setup.mesh, setup.rules):
        inside = make_train_step(setup).lower(state, batch)
    assert outside.as_text().count("sharding_constraint") == inside.as_text().count("sharding_constraint") > 0
    temp = [x.compile(compiler_options=FAST_COMPILE).memory_analysis().temp_size_in_bytes for x in (outside, inside)]
    assert temp[0] == temp[1], temp


def test_indivisible_kv_heads_is_a_clear_error(devices):
    cfg = load_config(TINY, [*BASE[:2], "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4"])  # tiny: 2 kv heads
    with pytest.raises(ShardingError, match=r"k_dkh: dimension 2 \(kv_heads\) has size 2.*tensor of size 4"):
        make_setup(cfg, devices=devices)


def test_mesh_product_mismatch_names_both_numbers():
    with pytest.raises(MeshError, match=r"has 12 devices but 8 are available"):
        resolve_mesh_shape(MeshConfig(data=3, fsdp=2, tensor=2), 8)
    with pytest.raises(MeshError, match=r"multiply to 3, which does not divide the 8 devices"):
        resolve_mesh_shape(MeshConfig(data=3, fsdp=-1, tensor=1), 8)


@pytest.mark.parametrize("cfg,shape", [
    (MeshConfig(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
    (MeshConfig(data=-1, fsdp=1, tensor=2), (4, 1, 2)),
    (MeshConfig(), (1, 8, 1)),
])
def test_minus_one_axis_fills_in(cfg, shape, devices):
    assert resolve_mesh_shape(cfg, 8) == shape
    mesh = make_mesh(cfg, devices)
    assert tuple(mesh.shape.values()) == shape and math.prod(shape) == len(mesh.devices.flat)


def test_shardings_cli_prints_the_report(capsys):
    from scaling.__main__ import main

    assert main(["shardings", "--config", TINY, "--mesh.tensor=2"]) == 0
    out = capsys.readouterr().out
    assert "mesh {'data': 1, 'fsdp': 4, 'tensor': 2} rules=default" in out
    assert "blocks.attn.q_dnh" in out and "P(None, 'fsdp', 'tensor', None)" in out
    assert "MiB per device" in out


def test_explicit_axes_fail_at_setup_with_the_reason(devices):
    cfg = tiny_config((2, 2, 2), "mesh.axis_type=explicit")
    with pytest.raises(MeshError, match=r"axis_type=explicit is not supported.*out_sharding.*Use mesh.axis_type=auto"):
        make_setup(cfg, devices=devices)


def test_constrain_in_both_axis_types(devices):
    """`constrain` pins a layout by logical names in Auto and Explicit mode alike."""
    import jax.numpy as jnp

    from scaling.config import AxisType
    from scaling.sharding import axes as A
    from scaling.sharding import constrain

    for axis_type in (AxisType.auto, AxisType.explicit):
        mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2, axis_type=axis_type), devices, allow_explicit=True)
        assert set(mesh.axis_types) == {getattr(jax.sharding.AxisType, axis_type.value.capitalize())}
        with use_sharding(mesh, "default"):
            y = jax.jit(lambda x: constrain(x * 2, (A.BATCH, A.SEQ, A.ACT_MLP)))(jnp.ones((8, 4, 16)))
        assert y.sharding.spec == P(("data", "fsdp"), None, "tensor"), axis_type


def test_shardings_cli_unknown_rule_set_names_the_flag(capsys):
    from scaling.__main__ import main

    assert main(["shardings", "--config", TINY, "--mesh.rules=bogus"]) == 2  # was a ValueError traceback
    assert "mesh.rules: 'bogus' is not a rule set; allowed: default, dp, fsdp, fsdp_tp" in capsys.readouterr().err
