"""Audit of scaling.optim and scaling.remat as a user drives them (not via train.py only)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scaling.config import OptimizerConfig, Schedule
from scaling.model import build_model
from scaling.optim import decay_mask, learning_rate_schedule, make_optimizer
from test_optim import _tiny


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_decay_mask_of_nnx_state_matches_the_pure_dict(tie, decay_embeddings):
    """`nnx.split(model)` gives an nnx.State whose paths end in each Variable's `.value`: the
    mask must still see the parameter's name (it took `.value` for it, so decayed the stacked
    [L, D] norm scales)."""
    _, state = nnx.split(build_model(_tiny(tie)), nnx.Param)
    pure = decay_mask(nnx.to_pure_dict(state), decay_embeddings)
    assert nnx.to_pure_dict(decay_mask(state, decay_embeddings)) == pure


def test_functional_nnx_loop_does_not_decay_norm_scales():
    """The functional NNX loop (params from nnx.split, jax.grad, tx.update on the State): zero
    gradients leave only weight decay, which shrinks the matrices by lr x wd and leaves every
    norm scale and (decay_embeddings off) the embedding as they were."""
    lr, wd = 0.1, 0.5
    graphdef, params = nnx.split(build_model(_tiny(False)), nnx.Param)
    cfg = OptimizerConfig(learning_rate=lr, warmup_steps=0, schedule=Schedule.constant, weight_decay=wd, clip_norm=1.0)
    tx = make_optimizer(cfg, 10)
    opt_state = tx.init(params)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), opt_state, params)
    before, after = nnx.to_pure_dict(params), nnx.to_pure_dict(optax.apply_updates(params, updates))
    for scale in (after["blocks"]["attn_norm"]["scale"], after["blocks"]["mlp_norm"]["scale"], after["final_norm"]["scale"]):
        np.testing.assert_array_equal(scale, 1.0)
    np.testing.assert_array_equal(after["embed"]["table_vd"], before["embed"]["table_vd"])
    np.testing.assert_allclose(after["blocks"]["mlp"]["up_df"], before["blocks"]["mlp"]["up_df"] * (1 - lr * wd), rtol=1e-6)
    np.testing.assert_allclose(after["head_dv"], before["head_dv"] * (1 - lr * wd), rtol=1e-6)


@pytest.mark.parametrize("field,value,says", [
    # was silently `constant` (the else branch): a typo'd or capitalised name lost the decay
    ("schedule", "cosin", "optimizer.schedule: 'cosin' is not allowed; allowed values: cosine, linear, constant"),
    ("schedule", "Cosine", "optimizer.schedule: 'Cosine' is not allowed"),
    # was a schedule starting part-way down the decay (lr(0) = 0.75 x peak), no warmup
    ("warmup_steps", -5, "optimizer.warmup_steps: must be >= 0, got -5"),
    ("warmup_steps", 2.5, "optimizer.warmup_steps: got 2.5; it takes an integer"),
    # was a "decay" that rises above the peak
    ("min_lr_ratio", 2.0, "optimizer.min_lr_ratio: must be in [0, 1], got 2.0"),
])
def test_schedule_fields_of_a_python_built_config_are_checked(field, value, says):
    """A bare OptimizerConfig (what make_optimizer takes) is checked only inside a whole Config:
    the schedule checks its own fields, with Config's messages."""
    from scaling.config import ConfigError

    cfg = OptimizerConfig(**{"learning_rate": 1.0, "warmup_steps": 2, field: value})
    for build in (learning_rate_schedule, make_optimizer):
        with pytest.raises(ConfigError) as e:
            build(cfg, 10)
        assert says in str(e.value), str(e.value)


def test_schedule_accepts_what_load_config_gives():
    """The plain strings and numpy ints a sweep or a script may pass are the same schedule."""
    a = learning_rate_schedule(OptimizerConfig(warmup_steps=np.int64(3), schedule="linear"), 10)
    b = learning_rate_schedule(OptimizerConfig(warmup_steps=3, schedule=Schedule.linear), 10)
    assert [float(a(i)) for i in range(12)] == [float(b(i)) for i in range(12)]
