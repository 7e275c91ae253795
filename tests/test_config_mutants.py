"""Tests that kill mutants the config, sharding and checkpoint tests let through.

Each test compares against values written out by hand (expected configs, PartitionSpecs,
mesh shapes, mismatch lines), never against a recomputation by the code under test.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from scaling import checkpoint as C
from scaling.config import ConfigError, MeshConfig, load_config
from scaling.sharding import MeshError, ShardingError, logical_to_spec, resolve_mesh_shape
from scaling.sharding import axes as A
from scaling.sharding.params import spec_for
from scaling.sharding.rules import RULE_SETS


# ----------------------------------------------------------------------------- config


def test_override_beats_yaml_and_yaml_beats_defaults(tmp_path):
    """Precedence defaults < inherited YAML < YAML < overrides, on the same keys."""
    (tmp_path / "base.yaml").write_text("model:\n  num_layers: 3\n  hidden_size: 64\ntrain:\n  steps: 11\n")
    (tmp_path / "exp.yaml").write_text("inherit: base.yaml\nmodel:\n  num_layers: 5\n")
    cfg = load_config(tmp_path / "exp.yaml", ["--model.num_layers=9", "--train.steps=2"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.steps, cfg.model.mlp_dim) == (9, 64, 2, 384)
    cfg = load_config(tmp_path / "exp.yaml", ["--model={num_layers: 7}"])  # a section override too
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (7, 64)


def test_inherit_replaces_lists_rather_than_merging_them(tmp_path):
    (tmp_path / "base.yaml").write_text("remat:\n  policy: names\n  names: [a, b]\nprofile:\n  steps: [5, 8]\n")
    (tmp_path / "exp.yaml").write_text("inherit: base.yaml\nremat:\n  names: [c]\nprofile:\n  steps: [1, 2]\n")
    cfg = load_config(tmp_path / "exp.yaml")
    assert cfg.remat.names == ("c",)
    assert cfg.profile.steps == (1, 2)


@pytest.mark.parametrize(
    "overrides",
    [
        ["--train.seq_len=2048"],  # == model.max_seq_len (2048 by default)
        ["--checkpoint.keep=1"],
        ["--train.eval_every=0"],  # 0 disables eval
        ["--data.tokenizer=byte", "--model.vocab_size=257"],  # 256 bytes + EOS
        ["--model.vocab_size=260"],  # BPE minimum
        ["--optimizer.b1=0", "--optimizer.b2=0"],
        ["--train.seq_len=128", "--train.loss_chunk=128"],
    ],
)
def test_validation_bounds_accept_the_boundary(overrides):
    load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--train.seq_len=2049"], "train.seq_len"),
        (["--checkpoint.keep=0"], "checkpoint.keep"),
        (["--train.eval_every=-1"], "train.eval_every"),
        (["--data.tokenizer=byte", "--model.vocab_size=256"], "model.vocab_size"),
        (["--model.vocab_size=259"], "model.vocab_size"),
        (["--optimizer.b1=1.0"], "optimizer.b1/b2"),
        (["--optimizer.b2=1.0"], "optimizer.b1/b2"),
        (["--checkpoint.keep_period=-1"], "checkpoint.keep_period"),
        (["--train.seq_len=128", "--train.loss_chunk=48"], "train.loss_chunk"),
    ],
)
def test_validation_bounds_refuse_one_past(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, overrides)


# --------------------------------------------------------------------------- sharding


def test_logical_to_spec_uses_each_mesh_axis_once():
    mapping = {"a": ("fsdp",), "b": ("fsdp", "tensor"), "c": ("tensor",)}
    assert logical_to_spec(("a", "b"), mapping) == P("fsdp", "tensor")
    assert logical_to_spec(("a", "c", "b"), mapping) == P("fsdp", "tensor", None)
    assert logical_to_spec((None, "b", "a"), mapping) == P(None, ("fsdp", "tensor"), None)


def _mesh(devices, shape):
    return Mesh(np.asarray(devices).reshape(shape), ("data", "fsdp", "tensor"))


def test_logical_to_spec_refuses_an_axis_the_mesh_lacks(devices):
    with pytest.raises(MeshError, match="maps to mesh axis 'pipe', which this mesh does not have"):
        logical_to_spec(("x",), {"x": ("pipe",)}, _mesh(devices, (2, 2, 2)))


def test_divisibility_is_checked_against_the_product_of_all_mesh_axes(devices):
    """fsdp rules put embed over fsdp x tensor (2 x 4 = 8): 12 divides by 2 but not by 8."""
    mesh = _mesh(devices, (1, 2, 4))
    params = RULE_SETS["fsdp"].params
    assert spec_for("w", (16, 3), (A.EMBED, A.MLP), params, mesh) == P(("fsdp", "tensor"), None)
    with pytest.raises(ShardingError, match=r"w: dimension 0 \(embed\) has size 12.*fsdpxtensor of size 8"):
        spec_for("w", (12, 3), (A.EMBED, A.MLP), params, mesh)


def test_two_minus_one_axes_are_refused_by_name():
    with pytest.raises(MeshError, match="at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1"):
        resolve_mesh_shape(MeshConfig(data=-1, fsdp=-1, tensor=2), 8)


@pytest.mark.parametrize("cfg, n, shape", [
    (MeshConfig(data=2, fsdp=1, tensor=-1), 8, (2, 1, 4)),
    (MeshConfig(data=3, fsdp=-1, tensor=2), 12, (3, 2, 2)),
    (MeshConfig(data=-1, fsdp=2, tensor=3), 6, (1, 2, 3)),
])
def test_minus_one_axis_by_hand(cfg, n, shape):
    assert resolve_mesh_shape(cfg, n) == shape


# ------------------------------------------------------------------------- checkpoint


def _s(*shape):
    return jax.ShapeDtypeStruct(shape, np.float32)


def _tree(a=(2,), b=(3,), c=(4,), mu_b=(3,)):
    return {"params": {"a": _s(*a), "b": _s(*b), "c": _s(*c)}, "opt": {"mu": {"b": _s(*mu_b)}}}


@pytest.mark.parametrize("leaf", ["a", "b", "c"])
def test_shape_mismatch_of_any_one_leaf_is_named(leaf):
    saved = _tree(**{leaf: (5, 5)})
    assert C.shape_mismatches(_tree(), saved) == [f"params.{leaf}: config shape {dict(a=(2,), b=(3,), c=(4,))[leaf]}, checkpoint shape (5, 5)"]
    assert C.shape_mismatches(_tree(), _tree()) == []


def test_leaves_only_in_the_checkpoint_and_optimizer_only_mismatches_are_named():
    saved = _tree()
    saved["params"]["d"] = _s(1)
    assert C.shape_mismatches(_tree(), saved) == ["params.d: in the checkpoint but not in the config's model"]
    assert C.shape_mismatches(_tree(), _tree(mu_b=(7,))) == ["opt.mu.b: config shape (3,), checkpoint shape (7,)"]


def test_latest_step_is_the_newest_complete_one(tmp_path):
    cfg = load_config(None, ["--checkpoint.keep=5", "--checkpoint.every=1", "--checkpoint.async_save=false"]).checkpoint
    ck = C.Checkpointer(tmp_path, cfg)
    assert ck.latest_step() is None
    for step in (2, 3, 5):
        assert ck.save(step, {"w": np.full((2,), float(step), np.float32)}, {"step": step})
    ck.close()
    (tmp_path / "checkpoints" / "9").mkdir()  # uncommitted (no commit_success.txt)
    assert C.complete_steps(tmp_path / "checkpoints") == [2, 3, 5]
    assert C.Checkpointer(tmp_path, cfg).latest_step() == 5


def test_load_config_of_a_run_reads_the_newest_complete_step(tmp_path):
    from scaling.config import to_dict

    cfg = load_config(None, ["--checkpoint.keep=5", "--checkpoint.async_save=false"]).checkpoint
    ck = C.Checkpointer(tmp_path, cfg)
    for step, layers in ((1, 2), (2, 3)):
        meta = {"config": to_dict(load_config(None, [f"--model.num_layers={layers}"]))}
        assert ck.save(step, {"w": np.zeros((2,), np.float32)}, meta)
    ck.close()
    (tmp_path / "checkpoints" / "3").mkdir()  # uncommitted: not a step to read
    assert C.load_config_of(tmp_path).model.num_layers == 3
