"""train.loss_chunk: chunked cross-entropy equals the one-pass loss (value and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling.config import ConfigError, load_config
from scaling.train import (
    abstract_state,
    chunked_cross_entropy,
    cross_entropy,
    global_batch,
    init_state,
    make_setup,
    make_train_step,
    model_loss,
)
from scaling.sharding import use_sharding


def _inputs(dtype, layout, b=2, t=16, d=8, v=40):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (b, t, d), jnp.float32).astype(dtype)
    w = jax.random.normal(k[1], (d, v) if layout == "dv" else (v, d), jnp.float32).astype(dtype)
    tgt = jax.random.randint(k[2], (b, t), 0, v)
    return x, w, tgt


def _reference(x, w, tgt, layout):
    spec = "btd,dv->btv" if layout == "dv" else "btd,vd->btv"
    return cross_entropy(jnp.einsum(spec, x, w, preferred_element_type=jnp.float32), tgt)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_f32_equals_one_pass(layout, chunk):
    x, w, tgt = _inputs(jnp.float32, layout)
    l0, g0 = jax.value_and_grad(lambda x, w: _reference(x, w, tgt, layout), (0, 1))(x, w)
    l1, g1 = jax.jit(jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, tgt, chunk, layout), (0, 1)))(x, w)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(g0, g1):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_bf16_within_bf16_rounding(layout):
    x, w, tgt = _inputs(jnp.bfloat16, layout)
    l0, g0 = jax.value_and_grad(lambda x, w: _reference(x, w, tgt, layout), (0, 1))(x, w)
    l1, g1 = jax.jit(jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, tgt, 4, layout), (0, 1)))(x, w)
    # Same f32 loss computation in another order; gradients differ by rounding d logits to bf16.
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    for a, b in zip(g0, g1):
        assert b.dtype == jnp.bfloat16
        assert _rel(a, b) < 2e-2


def test_config_validation():
    with pytest.raises(ConfigError, match="train.loss_chunk"):
        load_config("configs/models/tiny.yaml", ["--train.seq_len=128", "--train.loss_chunk=48"])
    with pytest.raises(ConfigError, match="train.loss_chunk"):
        load_config("configs/models/tiny.yaml", ["--train.loss_chunk=-1"])
    assert load_config("configs/models/tiny.yaml", ["--train.seq_len=128", "--train.loss_chunk=32"]).train.loss_chunk == 32


def _one_step(chunk, devices, tie):
    cfg = load_config(
        "configs/models/tiny.yaml",
        ["--data.source=synthetic", "--train.batch_size=8", "--train.seq_len=32", f"--train.loss_chunk={chunk}",
         "--checkpoint.enabled=false", "--model.num_layers=1", f"--model.tie_embeddings={str(tie).lower()}"],
    )
    setup = make_setup(cfg, devices=devices)
    state = init_state(setup)
    rows = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 33), dtype=np.int32)
    with use_sharding(setup.mesh, setup.rules):
        new, metrics = make_train_step(setup)(state, global_batch(setup, rows))
    return jax.device_get((new["params"], metrics))


def test_train_step_on_8_devices_equals_one_pass(devices):
    """The whole sharded step (fsdp=8): same loss, grad norm and updated parameters."""
    p0, m0 = _one_step(0, devices, tie=False)
    p1, m1 = _one_step(8, devices, tie=False)
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_gradients(devices):
    """Tied head ([V, D] embedding table): loss and every parameter's gradient match."""
    cfg = load_config("configs/models/tiny.yaml", ["--model.num_layers=1", "--model.tie_embeddings=true",
                                                   "--train.seq_len=32", "--train.loss_chunk=8"])
    setup = make_setup(cfg, devices=devices[:1])
    params = init_state(setup)["params"]
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (4, 33), dtype=np.int32))
    grad = lambda chunk: jax.jit(jax.value_and_grad(lambda p: model_loss(setup.model(p), tokens, chunk)))(params)  # noqa: E731
    (l0, g0), (l1, g1) = grad(0), grad(8)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)


def test_head_gradient_reduced_once_on_a_sharded_batch(devices):
    """fsdp=8: no collective on the [D, V] head gradient inside the chunk loop (each device
    sums its own rows' partial), one after it. The compiled HLO's while bodies are searched."""
    import re

    cfg = load_config("configs/models/tiny.yaml", ["--data.source=synthetic", "--train.batch_size=8",
                                                   "--train.seq_len=32", "--train.loss_chunk=8",
                                                   "--checkpoint.enabled=false", "--model.num_layers=1",
                                                   "--mesh.fsdp=8"])
    setup = make_setup(cfg, devices=devices)
    spec = jax.ShapeDtypeStruct((8, 33), np.int32, sharding=setup.batch_sharding)
    with use_sharding(setup.mesh, setup.rules):
        text = make_train_step(setup).lower(abstract_state(setup), spec).compile().as_text()
    head = f"f32[{cfg.model.hidden_size},{cfg.model.vocab_size}]"
    collective = re.compile(r"= [^=]*\b(all-reduce|reduce-scatter|all-gather)(-start)?\(")
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    assert bodies, "no while loop in the compiled step"
    in_loop, total = [], 0
    for comp in re.split(r"\n(?=(?:ENTRY )?%?[\w.\-]+ (?:\(|\{))", text):
        name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", comp).group(1)
        hits = [ln for ln in comp.splitlines() if collective.search(ln) and head in ln.split("=", 1)[1][:80]]
        total += len(hits)
        if name in bodies:
            in_loop += hits
    assert in_loop == [], in_loop
    assert total >= 1  # the one reduction after the loop
