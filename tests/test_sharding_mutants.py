"""The sharding layer against docs/sharding.md, written out by hand, where mutation testing found the
existing tests blind (a mutant of the code passed all of them).

- Activations: the constraints in the lowered forward pass of a tiny model on 8 simulated devices,
  read off the StableHLO text (lowering only, nothing compiles), against the doc's table
  (`X[B_DF, T, D]`, `Q[B_DF, T, N_t, H]`, `H[B_DF, T, F_t]`, `Logits[B_DF, T, V_t]`; the `fsdp`
  and `dp` sets: batch over all three axes, nothing else).
- Parameters: every weight's spec under every rule set (the existing test wrote out `default`
  only), on an AbstractMesh (no devices needed).
- Divisibility errors for the vocabulary and the MLP width, and the mesh sizes they suggest.
- The context that `constrain` reads, `logical_to_spec`'s one-use-per-axis rule, make_mesh's
  device order.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from scaling.config import DType, MeshConfig, ModelConfig, load_config
from scaling.model import build_model
from scaling.sharding import (MeshError, ShardingError, active, constrain, logical_to_spec, make_mesh, sharding_rules,
                              use_sharding)
from scaling.sharding.report import abstract_layout

TINY = "configs/models/tiny.yaml"

# ------------------------------------------------------------------ activations in the lowered HLO

# Every dimension a different size, so that an activation's shape names it.
B, T, D, N, K, H, F, V = 8, 5, 24, 4, 2, 6, 40, 48
SHAPE_NAMES = {(B, T, D): "x", (B, T, N, H): "q", (B, T, K, H): "kv", (B, T, F): "mlp_hidden", (B, T, V): "logits"}
# Constraint sites per shape in one forward pass (the scanned body appears once): the residual
# stream after the embedding, the attention output projection, the MLP and the block; q after RoPE
# and the attention core's output; k and v; the SwiGLU hidden; the logits.
SITES = {"x": 4, "q": 2, "kv": 2, "mlp_hidden": 1, "logits": 1}

_CONSTRAINT = re.compile(r"sdy\.sharding_constraint %\S+ <@\w+, \[(.*?)\]> : tensor<([\dx]+)xf32>")


def lowered_constraints(mesh_shape, rules):
    """{activation name: [per-dimension tuples of mesh axes, one entry per constraint site]}."""
    cfg = ModelConfig(vocab_size=V, hidden_size=D, num_layers=2, num_heads=N, num_kv_heads=K, head_dim=H, mlp_dim=F,
                      compute_dtype=DType.float32)
    graphdef, state = nnx.split(build_model(cfg))
    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))

    def forward(state, tokens):
        with sharding_rules(mesh, rules):
            return nnx.merge(graphdef, state)(tokens)

    text = jax.jit(forward).lower(state, jnp.zeros((B, T), jnp.int32)).as_text()
    found: dict[str, list] = {}
    for dims, shape in _CONSTRAINT.findall(text):
        spec = tuple(tuple(re.findall(r'"(\w+)"', d)) for d in re.findall(r"\{[^}]*\}", dims))
        found.setdefault(SHAPE_NAMES[tuple(int(s) for s in shape.split("x"))], []).append(spec)
    return found


BDF = ("data", "fsdp")
ALL = ("data", "fsdp", "tensor")
TP_LAYOUT = {  # docs/sharding.md, `default`: batch over data x fsdp, heads / MLP / vocabulary over tensor
    "x": (BDF, (), ()), "q": (BDF, (), ("tensor",), ()), "kv": (BDF, (), ("tensor",), ()),
    "mlp_hidden": (BDF, (), ("tensor",)), "logits": (BDF, (), ("tensor",)),
}
BATCH_ONLY = {  # `fsdp` and `dp`: batch over all three axes, no activation sharded otherwise
    "x": (ALL, (), ()), "q": (ALL, (), (), ()), "kv": (ALL, (), (), ()), "mlp_hidden": (ALL, (), ()), "logits": (ALL, (), ()),
}
FSDP_ONLY_MESH = {  # `default` on data=1, fsdp=8: the size-1 axes drop out
    "x": (("fsdp",), (), ()), "q": (("fsdp",), (), (), ()), "kv": (("fsdp",), (), (), ()),
    "mlp_hidden": (("fsdp",), (), ()), "logits": (("fsdp",), (), ()),
}


@pytest.mark.parametrize("mesh_shape,rules,layout", [
    ((2, 2, 2), "default", TP_LAYOUT),
    ((2, 2, 2), "fsdp_tp", TP_LAYOUT),
    ((2, 2, 2), "fsdp", BATCH_ONLY),
    ((2, 2, 2), "dp", BATCH_ONLY),
    ((1, 8, 1), "default", FSDP_ONLY_MESH),
], ids=lambda x: x if isinstance(x, str) else None)
def test_activation_constraints_follow_the_documented_layout(mesh_shape, rules, layout):
    found = lowered_constraints(mesh_shape, rules)
    assert {name: len(specs) for name, specs in found.items()} == SITES
    for name, specs in found.items():
        assert set(specs) == {layout[name]}, (name, specs)


# ------------------------------------------------------------------ parameter specs, every rule set

DEFAULT_PARAMS = {  # docs/sharding.md's `default` table; the leading stacked-layer axis never sharded
    "blocks.attn.q_dnh": P(None, "fsdp", "tensor", None),
    "blocks.attn.k_dkh": P(None, "fsdp", "tensor", None),
    "blocks.attn.v_dkh": P(None, "fsdp", "tensor", None),
    "blocks.attn.o_nhd": P(None, "tensor", None, "fsdp"),
    "blocks.mlp.gate_df": P(None, "fsdp", "tensor"),
    "blocks.mlp.up_df": P(None, "fsdp", "tensor"),
    "blocks.mlp.down_fd": P(None, "tensor", "fsdp"),
    "embed.table_vd": P("tensor", "fsdp"),
    "head_dv": P("fsdp", "tensor"),
    "blocks.attn_norm.scale": P(None, None),
    "blocks.mlp_norm.scale": P(None, None),
    "final_norm.scale": P(None),
}
FT = ("fsdp", "tensor")
FSDP_PARAMS = {  # `fsdp`: D over fsdp x tensor, nothing else
    "blocks.attn.q_dnh": P(None, FT, None, None),
    "blocks.attn.k_dkh": P(None, FT, None, None),
    "blocks.attn.v_dkh": P(None, FT, None, None),
    "blocks.attn.o_nhd": P(None, None, None, FT),
    "blocks.mlp.gate_df": P(None, FT, None),
    "blocks.mlp.up_df": P(None, FT, None),
    "blocks.mlp.down_fd": P(None, None, FT),
    "embed.table_vd": P(None, FT),
    "head_dv": P(FT, None),
    "blocks.attn_norm.scale": P(None, None),
    "blocks.mlp_norm.scale": P(None, None),
    "final_norm.scale": P(None),
}
DP_PARAMS = {name: P(*(None,) * len(spec)) for name, spec in DEFAULT_PARAMS.items()}  # `dp`: all replicated


def layout_of(overrides, num_devices=8):
    return abstract_layout(load_config(TINY, ["model.num_heads=8", "model.num_kv_heads=4", *overrides]), num_devices)


@pytest.mark.parametrize("rules,want", [("default", DEFAULT_PARAMS), ("fsdp_tp", DEFAULT_PARAMS), ("fsdp", FSDP_PARAMS),
                                        ("dp", DP_PARAMS)])
def test_every_parameter_spec_of_every_rule_set(rules, want):
    layout = layout_of([f"mesh.rules={rules}", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    got = jax.tree_util.tree_flatten_with_path(layout.state_shardings["params"])[0]
    got = {jax.tree_util.keystr(path, simple=True, separator="."): s.spec for path, s in got}
    assert got == want


# ------------------------------------------------------------------ divisibility

@pytest.mark.parametrize("overrides,num_devices,message", [
    # the vocabulary over tensor: 1020's divisors that are also 8's
    (["model.vocab_size=1020", "model.num_kv_heads=8", "mesh.fsdp=1", "mesh.tensor=8"], 8,
     r"parameter embed\.table_vd: dimension 0 \(vocab\) has size 1020, which mesh axis tensor of size 8 cannot "
     r"divide; make mesh\.tensor one of 1, 2, 4, or model\.vocab_size=1020 a multiple of 8"),
    # the MLP width over tensor (down_fd is the first MLP weight in the tree)
    (["model.mlp_dim=100", "model.num_kv_heads=8", "mesh.fsdp=1", "mesh.tensor=8"], 8,
     r"parameter blocks\.mlp\.down_fd: dimension 1 \(mlp\) has size 100, which mesh axis tensor of size 8 cannot "
     r"divide; make mesh\.tensor one of 1, 2, 4, or model\.mlp_dim=100 a multiple of 8"),
    # the model width over fsdp on 6 devices: 4 divides 64 but not the 6 devices
    (["model.hidden_size=64", "mesh.fsdp=-1"], 6,
     r"dimension 1 \(embed\) has size 64, which mesh axis fsdp of size 6 cannot divide; make mesh\.fsdp one of 1, 2, "
     r"or model\.hidden_size=64 a multiple of 6"),
], ids=["vocab", "mlp", "embed-6-devices"])
def test_indivisible_dimension_names_its_field_and_the_mesh_sizes_that_fit(overrides, num_devices, message):
    """The suggested sizes divide the dimension and the device count (a mesh axis must divide the
    devices too: mesh.tensor=5 on 8 devices is no mesh at all)."""
    with pytest.raises(ShardingError, match=message):
        layout_of(overrides, num_devices)


# ------------------------------------------------------------------ logical_to_spec and the context

def test_a_mesh_axis_is_used_once_per_spec(devices):
    """The first dimension that asks for an axis gets it; a later one gets what is left."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    rules = {"a": ("fsdp",), "b": ("fsdp", "tensor"), "c": ("data", "fsdp", "tensor")}
    assert logical_to_spec(("a", "b"), rules, mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("b", "a", "c"), rules, mesh) == P(("fsdp", "tensor"), None, "data")
    assert logical_to_spec(("c", "unmapped", None), rules, mesh) == P(("data", "fsdp", "tensor"), None, None)


def test_constrain_is_the_identity_outside_the_context_and_contexts_nest(devices):
    outer = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    inner = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1), devices)
    assert active() is None
    with sharding_rules(outer, "default"):
        assert active()[0] is outer and active()[1].name == "default"
        with sharding_rules(inner, "dp"):
            assert active()[0] is inner and active()[1].name == "dp"
        assert active()[0] is outer and active()[1].name == "default"
    assert active() is None
    with pytest.raises(RuntimeError):  # the context is restored when the block raises, too
        with sharding_rules(outer, "fsdp"):
            raise RuntimeError
    assert active() is None
    text = jax.jit(lambda x: constrain(x * 2, ("batch", "seq"))).lower(jnp.ones((8, 4))).as_text()
    assert "sharding_constraint" not in text


def test_use_sharding_sets_the_ambient_mesh(devices):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    with use_sharding(mesh, "default"):
        assert dict(jax.sharding.get_abstract_mesh().shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert jax.sharding.get_abstract_mesh().empty


def test_make_mesh_keeps_the_order_of_the_devices_given(devices):
    """Devices passed explicitly are laid out in the order given (row-major over data, fsdp, tensor)."""
    order = devices[::-1]
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), order)
    assert list(mesh.devices.flat) == order
    assert mesh.devices[1, 0, 1] == order[5]  # 1 x 4 + 0 x 2 + 1


def test_get_rule_set_names_the_field_and_the_sets():
    from scaling.sharding import get_rule_set

    with pytest.raises(ValueError, match=r"mesh\.rules='tp' is not a rule set; allowed: default, dp, fsdp, fsdp_tp"):
        get_rule_set("tp")

