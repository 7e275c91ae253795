"""Remat policies really change what is saved; gradients do not change; the byte model holds."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints

from scaling import accounting as acc
from scaling import remat
from scaling.config import ModelConfig, RematConfig, RematPolicyName as R
from scaling.model import build_model
from scaling.train import cross_entropy

# Distinct sizes so every residual is identifiable: B=2 T=32 D=64 N=4 K=2 H=16 F=160 V=128.
B, T = 2, 32
NAMES = ("mlp_gate", "mlp_up", "attention_out")


def small(layers=2, dtype="float32"):
    return ModelConfig(vocab_size=128, hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                       mlp_dim=160, max_seq_len=64, compute_dtype=dtype)


def loss_and_params(m, policy, names=()):
    model = build_model(m, remat_cfg=RematConfig(policy=policy, names=names))
    gd, params = nnx.split(model)

    def loss(p, tok):
        return cross_entropy(nnx.merge(gd, p)(tok[:, :-1]), tok[:, 1:])

    return loss, params


def tokens():
    return jax.random.randint(jax.random.key(1), (B, T + 1), 0, 128)


def stacked_residual_bytes(m, policy, names=()):
    """Bytes of the residuals the scanned layers keep (leading axis L), per layer."""
    loss, params = loss_and_params(m, policy, names)
    res = [a for a, why in saved_residuals(loss, params, tokens()) if "argument" not in why]
    stacked = [a for a in res if a.shape[:1] == (m.num_layers,)]  # L=3 is no other leading size
    return len(res), sum(math.prod(a.shape) * a.dtype.itemsize for a in stacked) / m.num_layers


@pytest.mark.parametrize("dtype,c", [("float32", 4), ("bfloat16", 2)])
def test_saved_residuals_match_the_accounting_table(dtype, c):
    m = small(3, dtype)
    counts = {}
    for policy, names in [(R.none, ()), (R.full, ()), (R.dots, ()), (R.selective, ()), (R.names, NAMES)]:
        n, per_layer = stacked_residual_bytes(m, policy, names)
        table = acc.activation_bytes(m, T, B, policy, names, c=c, p=4)
        assert per_layer == table.per_layer, (policy, per_layer, table.per_layer)
        counts[policy] = n
    # Each policy really changes what is kept.
    assert counts[R.none] > counts[R.dots] > counts[R.full]
    assert counts[R.names] != counts[R.dots]


@pytest.fixture(scope="module")
def compiled():
    """One compile per policy (f32, the CPU compute dtype): memory analysis and gradients."""
    m = small(2)
    out = {}
    for policy, names in [(R.none, ()), (R.full, ()), (R.dots, ()), (R.selective, ()), (R.names, NAMES),
                          (R.offload, NAMES)]:
        loss, params = loss_and_params(m, policy, names)
        c = jax.jit(jax.value_and_grad(loss)).lower(params, tokens()).compile()
        out[policy] = (names, c, c(params, tokens()))
    return m, out


def test_gradients_identical_across_policies(compiled):
    _, out = compiled
    ref_loss, ref_grads = out[R.none][2]
    for policy, (_, _, (loss, grads)) in out.items():
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=str(policy))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=str(policy)),
                     grads, ref_grads)


@pytest.mark.parametrize("policy", [R.none, R.full, R.dots, R.selective, R.names])
def test_predicted_memory_within_10_percent_of_xla(compiled, policy):
    m, out = compiled
    names, c, _ = out[policy]
    ma = c.memory_analysis()
    xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
    params = acc.param_count(m) * 4
    act = acc.activation_bytes(m, T, B, policy, names, c=4, p=4)
    predicted = params + params + act.total  # args: params (+ tokens); outputs: grads (+ loss)
    assert abs(predicted - xla) / xla < 0.10, (policy, predicted, xla)


def test_offload_on_cpu_runs_and_is_accounted_on_the_host(compiled):
    m, out = compiled
    assert remat.host_offload_supported()  # JAX's CPU devices expose pinned_host
    act = acc.activation_bytes(m, T, B, R.offload, NAMES, c=4)
    assert act.host > 0 and act.per_layer == acc.activation_bytes(m, T, B, R.full, c=4).per_layer


def test_offload_without_host_memory_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(remat, "host_offload_supported", lambda device=None: False)
    with pytest.raises(remat.RematError, match="pinned_host"):
        remat.apply(lambda x: x, RematConfig(policy=R.offload, names=("mlp_gate",)))


def test_policies_are_typed_registry_values():
    assert set(remat.POLICIES) == set(R)
    with pytest.raises(ValueError, match="unknown tag"):
        remat.apply(lambda x: x, RematConfig(policy=R.names, names=("nope",)))
