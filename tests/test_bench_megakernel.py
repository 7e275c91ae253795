"""experiments/bench_megakernel.py: the profile summary (each phase's wall time per layer) on a
made-up trace whose answer is known; the profiler's shared memory is checked before a launch."""

import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_megakernel as bm  # noqa: E402
from scaling.kernels import decode_megakernel as mk  # noqa: E402


def _trace(combine: bool = False):
    """Two CTAs, two layers 100 µs apart; CTA i finishes each phase i µs later (attention 5 i);
    with `combine`, a combine phase (attn_splits > 1) ending at 30 + i."""
    events = []

    def region(tid, name, a, b):
        events.extend([dict(ph="B", tid=tid, name=name, ts=a), dict(ph="E", tid=tid, name=name, ts=b)])

    for i in range(2):
        for l in range(2):
            t = 100 * l
            region(i, "qkv", t, t + 10 + i)
            region(i, "norm", t + 11 + i, t + 12 + i)
            region(i, "wait_attn", t + 13, t + 15)
            region(i, "attn", t + 15, t + 20 + 5 * i)
            if combine:
                region(i, "combine", t + 26, t + 30 + i)
            region(i, "out", t + 26, t + 40 + i)
            region(i, "gate_up", t + 42, t + 60 + i)
            region(i, "down", t + 62, t + 90 + i)
        region(10 + i, "producer_only", 0, 1)  # another warpgroup: no qkv region, ignored
    return {"traceEvents": events}


def test_phase_walls_on_a_known_trace():
    out = bm.phase_walls(_trace())
    assert out["layers"] == 2
    # last finishers: qkv 11, attn 25, out 41, gate_up 61, down 91 (+100 in layer 1)
    assert out["wall_qkv_us"] == 20 and out["wall_attn_us"] == 14 and out["wall_out_us"] == 16
    assert out["wall_gate_up_us"] == 20 and out["wall_down_us"] == 30 and out["wall_layer_us"] == 100
    assert out["cta_attn_us"] == 7.5 and out["cta_attn_max_us"] == 10
    assert out["cta_wait_attn_us"] == 2 and "cta_wait_out_us" not in out
    # the signal after q/k/v: from its end (10 + i) to the CTA's wait (13), the norm between ignored
    assert out["signal_qkv_us"] == 2.5 and "signal_attn_us" not in out


def test_phase_walls_with_a_combine_phase():
    out = bm.phase_walls(_trace(combine=True))
    assert out["wall_combine_us"] == 6 and out["wall_out_us"] == 10 and out["wall_layer_us"] == 100


def test_phase_walls_refuses_a_trace_without_consumers():
    with pytest.raises(ValueError, match="no consumer regions"):
        bm.phase_walls({"traceEvents": [dict(ph="B", tid=0, name="x", ts=0), dict(ph="E", tid=0, name="x", ts=1)]})


def test_profiling_refuses_a_plan_without_room_for_the_profiler(tmp_path):
    """(A profiled kernel cannot be lowered on the CPU: the profiler's trace dump needs the GPU
    backend. The named scopes are in every lowering test of the kernel.)"""
    big = mk.plan_for(bm.preset("llama2_7b"), 384, ctas=132)  # 8 x stages: no room for the profiler
    with pytest.raises(ValueError, match="profiling needs"):
        mk.megakernel_step(jnp.zeros((4096,)), jnp.zeros((2, 128)), 0, {}, jnp.zeros((32, 384, 32, 256), jnp.bfloat16),
                           plan=big, profile_dir=str(tmp_path))


@pytest.mark.parametrize("model", ["1b", "llama2_7b"])
def test_profile_plan_keeps_the_most_x_stages_that_fit_beside_the_profiler(model):
    """The profiled plan must pass the kernel's own checks (the 1b's 4 q heads per KV head need
    more than 4 x stages) and leave room for the profiler; one more x stage would not fit."""
    plan = mk.plan_for(bm.preset(model), 384, ctas=132)
    p = bm.profile_plan(plan)
    p.check()
    assert p.smem_bytes(profile=True) <= mk.SMEM_BYTES
    # Mosaic GPU's profiler: per warpgroup (2) 4 i32 entries (4 bytes each) per profiled range
    assert p.smem_bytes(profile=True) - p.smem_bytes() == 2 * 4 * 4 * mk.PROFILE_EVENTS
    assert p == dataclasses.replace(plan, x_stages=p.x_stages)  # nothing else changed
    if p.x_stages < plan.x_stages:
        assert dataclasses.replace(p, x_stages=p.x_stages + 1).smem_bytes(profile=True) > mk.SMEM_BYTES
    # (the splits kept; 2 ring slots leave the 7b room for the 4 x stages its splits need)
    assert bm.profile_plan(dataclasses.replace(plan, attn_splits=4, stages=2)).attn_splits == 4


def test_profile_plan_refuses_when_no_x_stages_fit():
    big = mk.plan_for(bm.preset("llama2_7b"), 384, ctas=132, stages=3)
    big = dataclasses.replace(big, norm_prefetch=True)  # all of h in the x and up stages: 8 x stages, no room
    with pytest.raises(ValueError, match="leaves room for the profiler"):
        bm.profile_plan(big)


def test_variants_join_with_plus():
    assert bm.variant_fields("pairs+norm_prefetch+splits4") == {"block_k": 256, "norm_prefetch": True,
                                                                 "attn_splits": 4}
    assert bm.variant_fields("base") == {}
    with pytest.raises(KeyError):
        bm.variant_fields("pairs+nope")


def _phase_table(durations):
    """A `phase_walls` table for one phase: CTA c's layer l from 100 l to 100 l + durations[c][l]."""
    import numpy as np

    d = np.asarray(durations, dtype=np.float64)
    start = 100.0 * np.arange(d.shape[1])[None, :] + 0 * d
    return lambda name: np.stack([start, start + d], axis=-1) if name == "mlp" else np.zeros((len(d), 0, 2))


def test_cta_drift_tells_the_same_slow_ctas_every_layer_from_noise():
    # CTA c takes 10 + c µs in every layer (the third slowest every time); the fourth runs no unit
    same = bm.cta_drift(_phase_table([[10 + c + 0.01 * ((c + l) % 2) for l in range(4)] for c in range(3)]
                                     + [[0.0] * 4]))
    assert same["drift_mlp_p50_us"] == pytest.approx(11.005) and same["drift_mlp_max_us"] == pytest.approx(12.005)
    assert same["drift_mlp_layer_corr"] > 0.99
    # a different CTA slow in even layers than in odd ones: no CTA is slow every layer
    noise = bm.cta_drift(_phase_table([[10 + (c + l) % 2 for l in range(4)] for c in range(4)]))
    assert noise["drift_mlp_layer_corr"] == pytest.approx(-1.0) and noise["drift_mlp_max_us"] == 10.5
    assert "drift_qkv_p50_us" not in noise


def test_race_check_pairs_each_variant_with_the_plan_it_must_match():
    plan = mk.plan_for(bm.preset("1b"), 384, ctas=132, hold_slots=2)
    # (its own hold 0 by default; none where it holds nothing)
    assert bm.race_other(plan, "qld", False) == dataclasses.replace(plan, qkv_ld=True, hold_slots=0)
    assert bm.race_other(plan, "hold1", False) == dataclasses.replace(plan, hold_slots=0)
    assert bm.race_other(dataclasses.replace(plan, hold_slots=0), "base", False) is None
    # (--race-base: the base plan, for every variant but base)
    assert bm.race_other(plan, "ctas128", True) == plan
    assert bm.race_other(plan, "base", True) is None
    # `short`: the decoder's plan for a long cache's early steps, with the other parts' fields over it
    short = dataclasses.replace(plan, stages=4)
    assert bm.variant_base(plan, "short+hold1", short) is short and bm.variant_base(plan, "hold1", short) is plan
    assert bm.race_other(plan, "short", False, short) == dataclasses.replace(short, hold_slots=0)
    assert bm.race_other(plan, "short", True, short) == plan
    with pytest.raises(ValueError, match="'short' needs --decoder-plan"):
        bm.variant_base(plan, "short", None)
