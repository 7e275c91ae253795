"""The book's accounting checked against the real model and XLA (CPU, small configs)."""

import dataclasses
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


# ------------------------------------------------------------------ calibrated step time


def _cfg_1b(policy, batch=4):
    return load_config(PRESETS[0].parent / "1b.yaml", ["--model.compute_dtype=bfloat16", f"--train.batch_size={batch}",
                                                        "--train.seq_len=2048", f"--remat.policy={policy}"])


def test_calibrated_time_counts_work_at_achievable_rates():
    from scaling.hardware import get_hardware

    hw = get_hardware("h200")
    mesh = acc.MeshShape()
    rates = acc.Rates(matmul=600e12, attention=200e12, hbm=3e12)
    none, dots, full = (acc.training_time(_cfg_1b(p), mesh, hw, rates=rates) for p in ("none", "dots", "full"))
    m, tokens = _cfg_1b("none").model, 4 * 2048
    f = acc.flops_per_token(m, 2048)
    # Matmuls: the dense training FLOPs, + the layer forward again under full but its down
    # projection (whose output no backward op reads: tests/test_accounting_xla.py); the output
    # head's backward (dx, dW: 4·D·V per token) in f32 with the one-pass loss; the causal
    # flash core at the attention rate, its forward again whenever the policy recomputes.
    head_bwd = 4 * m.hidden_size * m.vocab_size * tokens
    assert none.f32_matmul_flops == pytest.approx(head_bwd)
    assert none.matmul_flops + none.f32_matmul_flops == pytest.approx(f.dense * tokens)
    assert full.matmul_flops + full.f32_matmul_flops == pytest.approx(
        (f.dense + 2 * (acc.layer_matmul_params(m) - m.mlp_dim * m.hidden_size) * m.num_layers) * tokens)
    assert none.attention_flops == pytest.approx(f.attention * tokens)
    assert dots.attention_flops == pytest.approx(f.attention * tokens * 4 / 3)
    # The optimizer reads grads for the norm, then params, grads, m, v and writes params, m, v.
    assert none.traffic["optimizer (grad norm + fused AdamW)"] == 8 * 4 * acc.param_count(m)
    # Kernels on one stream add up; the result is the sum of the parts (f32 at the bf16 rate
    # here: Rates.f32_matmul = 0).
    assert none.seconds == pytest.approx((none.matmul_flops + none.f32_matmul_flops) / 600e12
                                         + none.attention_flops / 200e12 + sum(none.traffic.values()) / 3e12)
    # The chunked loss runs all head matmuls in bf16: faster where f32 matmuls are slower
    # (docs/benchmarks.md measured -8.4 ms at batch 8).
    chunked_cfg = load_config(PRESETS[0].parent / "1b.yaml", [
        "--model.compute_dtype=bfloat16", "--train.batch_size=4", "--train.seq_len=2048", "--remat.policy=none",
        "--train.loss_chunk=512"])
    tf32 = dataclasses.replace(rates, f32_matmul=277e12)
    chunked = acc.training_time(chunked_cfg, mesh, hw, rates=tf32)
    assert chunked.f32_matmul_flops == 0 and chunked.matmul_flops == pytest.approx(f.dense * tokens)
    assert chunked.seconds < acc.training_time(_cfg_1b("none"), mesh, hw, rates=tf32).seconds
    # Scanned `none` copies 4x more saved residuals into the stack than dots; dots recomputes.
    stack = "saved residuals copied into the scan stack"
    assert none.traffic[stack] > 3 * dots.traffic[stack]
    assert dots.traffic["recomputed elementwise forward"] > 0 == none.traffic["recomputed elementwise forward"]
    # The roofline at datasheet peaks with perfect overlap is a lower bound of the calibrated time.
    for p, st in (("none", none), ("dots", dots), ("full", full)):
        assert acc.training_roofline(_cfg_1b(p), mesh, hw).step_seconds < st.seconds


def test_default_rates_come_from_the_hardware_table():
    from scaling.hardware import get_hardware

    hw = get_hardware("h200")
    r = acc.Rates.of(hw)
    assert r.matmul == pytest.approx(744e12) and r.hbm == pytest.approx(2.91e12)
    assert "measured" in r.source
    assert acc.training_time(_cfg_1b("dots"), acc.MeshShape(), hw).rates == r


def test_memory_phases_on_the_1b_preset():
    """The transients are live in different phases: the peak is the larger one, not the sum."""
    from scaling.hardware import get_hardware

    mem = acc.training_memory(_cfg_1b("dots"), acc.MeshShape(), hw=get_hardware("h200"))
    act = mem.activations
    state = mem.params + mem.optimizer
    assert mem.phases["layer backward"] == pytest.approx(state + mem.grads - mem.grads_embed + act.layers
                                                         + act.working_layer)
    assert mem.phases["loss and output head"] == pytest.approx(state + mem.grads_head + act.layers + act.head)
    assert mem.total == max(mem.phases.values()) < state + mem.grads + act.layers + act.head + act.working_layer
    # 1b, batch 4 x 2048, bf16: two f32 [8192, 32000] buffers (1.95 GiB) + final norm + head cast.
    assert act.head / 2**30 == pytest.approx(2.23, abs=0.01)


def test_plan_prints_roofline_and_calibrated_time(capsys):
    cfg = str(PRESETS[0].parent / "1b.yaml")
    assert plan.main(["--config", cfg, "--hardware", "h200", "--devices", "1", "--train.batch_size=4",
                      "--train.seq_len=2048", "--remat.policy=dots"]) == 0
    out = capsys.readouterr().out
    assert "roofline per step" in out and "calibrated step time" in out and "<- peak" in out


def test_plan_cli_errors_name_the_flag(capsys):
    cfg = str(PRESETS[0].parent / "1b.yaml")
    assert plan.main(["--config", cfg, "--hardware", "h300"]) == 2
    assert "--hardware: unknown hardware 'h300'; allowed: h100, h200, a100" in capsys.readouterr().err
    assert plan.main(["--config", cfg, "--devices", "0"]) == 2  # (0 had meant the default, 8)
    assert "--devices must be >= 1, got 0" in capsys.readouterr().err


def test_plan_cli_bad_rules_top_and_mesh_exit_2_on_stderr(capsys):
    cfg = str(PRESETS[0].parent / "tiny.yaml")
    from scaling.__main__ import main

    assert main(["plan", "--config", cfg, "--mesh.rules=bogus"]) == 2  # was SystemExit(1), naming neither
    err = capsys.readouterr().err
    assert "mesh.rules: 'bogus' is not a rule set; allowed: default, dp, fsdp, fsdp_tp" in err
    assert plan.main(["--config", cfg, "--search", "--top", "-3"]) == 2  # was rows[:-3]: all but the best 3
    assert "--top must be >= 1, got -3" in capsys.readouterr().err
    assert plan.main(["--config", cfg, "--devices", "6", "--mesh.fsdp=4"]) == 2
    out = capsys.readouterr()
    assert "mesh error: mesh {'data': 1, 'fsdp': 4, 'tensor': 1} has 4 devices but 6" in out.err and not out.out


# Llama 3 8B's published parameter count and its RMSNorm scales (2 per layer + the final one).
LLAMA3_8B_PARAMS = 8_030_261_248
LLAMA3_8B_NORMS = (2 * 32 + 1) * 4096


def test_fsdp_weight_traffic_is_the_gathered_weights():
    """Under FSDP every device's matmuls read the all-gathered weights, not its 1/n shard
    [HSM-TR]: the roofline's 3 weight reads (forward, twice backward) are priced on the
    gathered sizes; only the tensor-parallel split remains. The casts and gradient
    conversions run on the stored shard (XLA:GPU casts before the gather, converts after the
    reduction: the collectives move c bytes)."""
    from scaling.hardware import get_hardware

    hw = get_hardware("h100")
    cfg = load_config(PRESETS[0].parent / "llama3_8b.yaml", ["--train.batch_size=16", "--train.seq_len=1024"])
    m = cfg.model
    c, p = 2, 4  # compute `auto` is bf16 on an accelerator; params f32
    matrices = LLAMA3_8B_PARAMS - LLAMA3_8B_NORMS
    for mesh, gathered in ((acc.MeshShape(1, 8, 1), LLAMA3_8B_PARAMS),
                           (acc.MeshShape(1, 4, 2), matrices // 2 + LLAMA3_8B_NORMS),  # Megatron halves stay split
                           (acc.MeshShape(2, 4, 1), LLAMA3_8B_PARAMS)):
        roof = acc.training_roofline(cfg, mesh, hw)
        mem = acc.training_memory(cfg, mesh, hw=hw)
        act = mem.activations
        weights = roof.hbm_bytes - 2 * (act.layers + act.head) - 7 * mem.params
        assert weights == pytest.approx(3 * gathered * c, rel=1e-12)  # was 3 x the 1/n shard
        st = acc.training_time(cfg, mesh, hw)
        shard = matrices / (mesh.sizes["fsdp"] * mesh.sizes["tensor"]) + LLAMA3_8B_NORMS  # norm scales replicated
        assert st.traffic["weight gradients c -> f32"] == pytest.approx((p + c) * shard, rel=1e-12)
        assert acc.gathered_params_per_device(m, mesh) == gathered
    # Without FSDP nothing is gathered: the shard is what the matmuls read.
    one = acc.MeshShape(1, 1, 1)
    assert acc.gathered_params_per_device(m, one) == acc.params_per_device(m, one) == LLAMA3_8B_PARAMS


def test_collectives_over_several_batch_axes_are_one_ring():
    """A gather or reduction spanning several mesh axes moves (N-1)/N of the array per device
    in all, as one ring over the N devices would [HSM-S]; not (n-1)/n of it on every axis."""
    from scaling.hardware import get_hardware

    hw = get_hardware("h100")  # 8 devices: every axis inside one NVLink node, 450 GB/s each
    cfg = load_config(PRESETS[0].parent / "llama3_8b.yaml", ["--train.batch_size=16", "--train.seq_len=1024"])
    w, ring = 450e9, 7 / 8
    table = 128_256 * 4096  # the embedding and the (untied) head, each
    layers = LLAMA3_8B_PARAMS - LLAMA3_8B_NORMS - 2 * table

    def seconds(comms, kind, what=None):
        return sum(x.seconds for x in comms if x.kind == kind and (what is None or x.what == what))

    # `fsdp` rules, tensor as a second FSDP axis: the matrices are split 8 ways over (fsdp, tensor),
    # the norm scales replicated (their grads all-reduced). On a GPU the weights move in bf16,
    # the layers' grads too, the head's and the norms' in f32; the embedding is an all-to-all.
    comms = acc.training_comms(cfg, acc.MeshShape(1, 2, 4, rules="fsdp"), hw)
    assert seconds(comms, "all-gather", "weights (forward)") == pytest.approx(ring * (layers + table) * 2 / w)
    assert seconds(comms, "reduce-scatter") == pytest.approx(ring * (layers * 2 + table * 4) / w)
    assert seconds(comms, "all-reduce") == pytest.approx(2 * ring * LLAMA3_8B_NORMS * 4 / w)
    # `dp` rules over three axes: one all-reduce of the whole gradient over 8 devices.
    comms = acc.training_comms(cfg, acc.MeshShape(2, 2, 2, rules="dp"), hw)
    grads = (layers + table) * 2 + (table + LLAMA3_8B_NORMS) * 4
    assert seconds(comms, "all-reduce") == pytest.approx(2 * ring * grads / w)
    assert not seconds(comms, "all-gather")
    # One axis is unchanged: FSDP over 8 gathers the 8-way-split weights.
    comms = acc.training_comms(cfg, acc.MeshShape(1, 8, 1), hw)
    assert seconds(comms, "all-gather", "weights (forward)") == pytest.approx(ring * (layers + table) * 2 / w)


def test_plan_tokens_per_device_and_search_without_a_valid_shape(capsys):
    cfg = str(PRESETS[0].parent / "llama3_8b.yaml")
    # Tensor parallelism splits the weights, not the batch: a device holds 16 x 1024 / (fsdp 4) tokens.
    assert plan.main(["--config", cfg, "--devices", "8", "--mesh.fsdp=4", "--mesh.tensor=2", "--train.batch_size=16",
                      "--train.seq_len=1024"]) == 0
    assert f"tokens/device/micro-batch {16 * 1024 // 4:,}; compute-bound above" in capsys.readouterr().out  # was 2,048
    # 64 sequences cannot be split over 6 devices' batch axes, and D=4096 not 6 ways: no shape is
    # valid, which is not the same as nothing fitting in memory.
    assert plan.main(["--config", cfg, "--devices", "6", "--search", "--train.batch_size=64"]) == 2
    out = capsys.readouterr().out
    assert "no data x fsdp x tensor shape of 6 devices can run this" in out and "nothing fits" not in out
