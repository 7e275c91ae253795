"""The book's accounting checked against the real model and XLA (CPU, small configs)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from scaling import accounting as acc
from scaling import plan
from scaling.config import ModelConfig, load_config
from scaling.model import build_model, count_params
from scaling.sharding.params import logical_axes

PRESETS = sorted(Path(__file__).parent.parent.joinpath("configs", "models").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_param_count_equals_model_for_every_preset(path):
    m = load_config(path).model
    abstract = nnx.eval_shape(lambda: build_model(m))  # nothing allocated, even for 8B
    assert count_params(abstract) == acc.param_count(m)
    # The shapes and logical axes the accounting shards by are the model's own.
    names = jax.tree.leaves(logical_axes(abstract), is_leaf=lambda x: isinstance(x, tuple))
    shapes = [tuple(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))]
    assert sorted(zip(shapes, names)) == sorted((s, n) for s, n in acc.param_shapes(m).values())


def test_dense_flops_match_xla_cost_analysis():
    # Unrolled layers: XLA's cost analysis counts a while-loop body once, not per trip.
    # Seq 4: attention is < 1% of the FLOPs; XLA counts a multiply-add as 2 FLOPs, as we do.
    m = ModelConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=384,
                    max_seq_len=16, scan_layers=False, compute_dtype="float32")
    model = build_model(m)
    gd, params = nnx.split(model)
    b, t = 4, 4
    tokens = jnp.zeros((b, t), jnp.int32)
    compiled = jax.jit(lambda p, x: nnx.merge(gd, p)(x)).lower(params, tokens).compile()
    xla = compiled.cost_analysis()["flops"]
    f = acc.flops_per_token(m, t, training=False, causal=False)  # the xla core computes all T^2
    assert abs(xla - f.dense * b * t) / xla < 0.02
    assert abs(xla - f.total * b * t) / xla < 0.02


def test_six_n_is_close_to_the_exact_count():
    m = load_config(PRESETS[0].parent / "1b.yaml").model
    f = acc.flops_per_token(m, 2048)
    # 6N [K20] counts the embedding table, which does no matmul; the rest agrees exactly.
    norms = (2 * m.num_layers + 1) * m.hidden_size
    assert f.dense == 6 * (acc.param_count(m) - m.vocab_size * m.hidden_size - norms)
    assert abs(f.dense - f.six_n) / f.six_n < 0.07


def test_per_device_params_and_comms():
    m = load_config(PRESETS[0].parent / "llama3_8b.yaml").model
    one = acc.params_per_device(m, acc.MeshShape(1, 1, 1))
    assert one == acc.param_count(m)
    fsdp8 = acc.params_per_device(m, acc.MeshShape(1, 8, 1))
    assert abs(fsdp8 * 8 - one) / one < 1e-3  # only the 1-D norm scales stay replicated
    assert acc.params_per_device(m, acc.MeshShape(8, 1, 1, rules="dp")) == one


def test_collective_formulas():
    # [HSM-S]: AllGather of V bytes over n devices moves (n-1)/n V per device; AllReduce 2x.
    assert acc.collective_seconds("all-gather", 8e9, 8, 1e9) == pytest.approx(7.0)
    assert acc.collective_seconds("all-reduce", 8e9, 8, 1e9) == pytest.approx(14.0)
    assert acc.collective_seconds("all-reduce", 8e9, 1, 1e9) == 0.0


def test_kv_cache_bytes():
    m = load_config(PRESETS[0].parent / "llama2_7b.yaml").model
    # Llama 2 7B, 4096 tokens, bf16: 2 * 32 * 32 * 128 * 4096 * 2 bytes = 2 GiB per sequence.
    assert acc.kv_cache_bytes(m, 1, 4096) == 2 * 2**30


@pytest.mark.parametrize("preset", ["llama2_7b", "llama3_8b", "tiny"])
def test_plan_cli_runs_without_allocating(preset, capsys):
    cfg = str(PRESETS[0].parent / f"{preset}.yaml")
    assert plan.main(["--config", cfg, "--devices", "8", "--search", "--train.batch_size=16", "--train.seq_len=256"]) == 0
    out = capsys.readouterr().out
    assert "roofline per step" in out and "| data | fsdp |" in out
