"""experiments/recompute_kernels.py: a step's kernels grouped by the accounting's traffic terms (by
hand on a made-up trace), and the committed H200 profiles held to `recomputed_bytes_per_token`."""

import gzip
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import recompute_kernels as R  # noqa: E402

from scaling import accounting as acc  # noqa: E402
from scaling.config import RematPolicyName, load_config  # noqa: E402
from scaling.hardware import get_hardware  # noqa: E402

RESULTS = ROOT / "docs" / "results" / "remat_session50"

HLO = """HloModule jit_step_fn

fused_norm {
  p = bf16[2,8,12]{2,1,0} parameter(0)
  ROOT r = bf16[2,8,12]{2,1,0} multiply(p, p)
}

ENTRY main {
  %x = bf16[2,8,12]{2,1,0} parameter(0)
  %w = f32[12,12]{1,0} parameter(1)
  %logits = f32[2,8,50]{2,1,0} parameter(2)
  %fwd_norm = bf16[2,8,12]{2,1,0} fusion(%x), kind=kLoop, calls=fused_norm, metadata={op_name="jit(step_fn)/jvp()/mul"}
  %cast = bf16[12,12]{1,0} fusion(%w), kind=kLoop, calls=fused_norm, metadata={op_name="jit(step_fn)/jvp()/convert_element_type"}
  %scale_grad = f32[128,12]{1,0} fusion(%x), kind=kInput, calls=fused_norm, metadata={op_name="jit(step_fn)/transpose(jvp())/reduce_sum"}
  %again = bf16[2,8,12]{2,1,0} fusion(%x), kind=kLoop, calls=fused_norm, metadata={op_name="jit(step_fn)/transpose(jvp())/checkpoint/rematted_computation/mul"}
  %bwd = bf16[2,8,12]{2,1,0} fusion(%again), kind=kLoop, calls=fused_norm, metadata={op_name="jit(step_fn)/transpose(jvp())/mul"}
  %lse = f32[2,8]{1,0} fusion(%logits), kind=kInput, calls=fused_norm, metadata={op_name="jit(step_fn)/jvp()/reduce_max"}
  %head = f32[2,8,50]{2,1,0} fusion(%logits), kind=kLoop, calls=fused_norm, metadata={op_name="jit(step_fn)/transpose(jvp())/mul"}
  %adam = f32[12,12]{1,0} fusion(%w), kind=kLoop, calls=fused_norm, metadata={op_name="jit(step_fn)/mul"}
  %mpmd_map = bf16[2,8,12]{2,1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step_fn)/jvp(jit(_forward))/flash_attention_fwd/mpmd_map"}
  %zeros = bf16[4,2,8,12]{3,2,1,0} fusion(), kind=kLoop, calls=fused_norm, metadata={op_name="jit(step_fn)/broadcast_in_dim"}
  ROOT %t = (bf16[2,8,12]{2,1,0}) tuple(%bwd)
}
"""


def write_profile(tmp_path, steps=2):
    stem = tmp_path / "profile_tiny-8-2_auto-dots-unrolled"
    kernels = [  # (kernel name, hlo op, duration us per step)
        ("loop_multiply_fusion", "fwd_norm", 10), ("loop_convert_fusion", "cast", 3), ("input_reduce_fusion", "scale_grad", 4),
        ("loop_multiply_fusion_1", "again", 5), ("loop_multiply_fusion_2", "bwd", 7), ("input_reduce_fusion_1", "lse", 2),
        ("loop_multiply_fusion_3", "head", 6), ("loop_multiply_fusion_4", "adam", 9), ("anonymous_mosaic_gpu_kernel", "mpmd_map", 30),
        ("nvjet_sm90_tst_128x128", "custom-call.1", 50), ("Memset 3", "", 1), ("loop_broadcast_fusion", "zeros", 8),
        ("MemcpyD2D", "", 11),
    ]
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 999, "name": "loop_multiply_fusion", "args": {"hlo_op": "fwd_norm"}}]
    ts = 0.0
    for _ in range(steps):
        for name, op, dur in kernels:
            events.append({"ph": "X", "pid": 1, "tid": 7, "ts": ts, "dur": dur, "name": name, "args": {"hlo_op": op}})
            ts += dur + 1
    with gzip.open(f"{stem}.perfetto.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    with gzip.open(f"{stem}.hlo.txt.gz", "wt") as f:
        f.write(HLO)
    return stem


def test_groups_by_hand(tmp_path):
    stem = write_profile(tmp_path)
    got = R.measure(stem, steps=2, vocab=50)
    us = {g: ms * 1e3 for g, ms in got.items()}
    assert us == pytest.approx({
        "layer forward": 10,  # activations in, forward op name
        "weights": 3,  # no activation in or out
        "layer backward": 4 + 7,  # the scale's partial sum reads the activations; the backward op
        "recomputed forward": 5,
        "loss/head/embedding": 2 + 6,  # a vocab-sized operand (the log-sum-exp) or result
        "optimizer": 9,
        "attention": 30,
        "matmul": 50,
        "memsets": 1,
        "scan stacks": 8,
        "copies (no HLO op)": 11,  # not the optimizer's, whose op names are outside autodiff
    })


def test_the_op_map_stands_in_for_the_hlo(tmp_path):
    stem = write_profile(tmp_path)
    assert R.main([str(stem), "--steps", "2", "--write-ops"]) == 0
    ops = json.loads(gzip.open(f"{stem}.ops.json.gz").read())
    assert ops["scale_grad"] == ["f32[128,12]{1,0}", "fusion", "jit(step_fn)/transpose(jvp())/reduce_sum",
                                 ["bf16[2,8,12]{2,1,0}"]]
    assert ops["cast"][3] == ["f32[12,12]{1,0}"]
    before = R.measure(stem, steps=2, vocab=50)
    Path(f"{stem}.hlo.txt.gz").unlink()
    assert R.measure(stem, steps=2, vocab=50) == before


def test_a_stem_it_cannot_place_exits_2(tmp_path, capsys):
    assert R.main([str(tmp_path / "trace")]) == 2
    assert "not a profile_" in capsys.readouterr().err


def predicted_recompute_ms(model, batch, policy, drop_h=False):
    cfg = load_config(ROOT / "configs" / "models" / f"{model}.yaml", [
        "--data.source=synthetic", "--train.seq_len=2048", f"--train.batch_size={batch}", f"--remat.policy={policy}"])
    m, hw = cfg.model, get_hardware("h200")
    per_token = acc.recomputed_bytes_per_token(m, 2048, RematPolicyName(policy), c=2, flash=True)
    if drop_h:  # h's F, written by the SwiGLU backward's fusion (a backward kernel)
        per_token -= m.mlp_dim * 2
    return per_token * batch * 2048 * m.num_layers / acc.Rates.of(hw).hbm * 1e3


@pytest.mark.parametrize("profile, policy", [
    ("1b-2048-8_auto-dots-unrolled", "dots"), ("1b-2048-8_auto-selective-unrolled", "selective"),
    ("1b-2048-8_auto-full-unrolled", "full"), ("1b-2048-8_auto-full-scan", "full"),
    ("350m-2048-4_auto-dots-unrolled", "dots"), ("125m-2048-8_auto-dots-unrolled", "dots")])
def test_the_h200_recompute_is_the_priced_kernels(profile, policy):
    """The kernels JAX names `rematted_computation` in six H200 steps against the term: at most
    1.1x of it, and at least 0.8x of it less, under dots, the h that XLA writes inside a backward
    kernel. (The 1b's dots 2.6 ms in [2.2, 4.2] x; full 6.7 ms in [5.8, 7.2] x; the 350m's dots
    1.2 in [0.8, 1.4] x, its many small kernels slower than the table's rate; the 125m's 0.9 in
    [0.6, 1.2] x.) The whole forward
    pass again, the term until the fiftieth session, is 9.0 ms for the 1b: below neither."""
    model, _, batch = profile.split("_")[0].split("-")
    measured = R.measure(RESULTS / f"profile_{profile}", steps=3, vocab=32000)["recomputed forward"]
    whole = predicted_recompute_ms(model, int(batch), policy)
    beside = predicted_recompute_ms(model, int(batch), policy, drop_h=policy != "full")
    assert 0.8 * beside <= measured <= 1.1 * whole, (measured, beside, whole)
