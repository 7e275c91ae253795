"""Mosaic GPU flash attention backward (scaling/kernels/flash_attention_mgpu_bwd.py).

CPU: the kernels run under Pallas' GPU interpret mode (jax 0.11.2), which simulates the
warpgroups, shared memory, TMA copies and barriers and checks barrier phases. As for the
forward (see tests/test_flash_attention_mgpu.py), the two products with a register A operand
(dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K) are `jnp.dot`s there; the shared-memory wgmmas
(Sᵀ, dPᵀ, S, dP), the rings, masking and stores are the GPU code. The GPU-only test (skipped
off-GPU; on a GPU machine: `JAX_PLATFORMS=cuda python -m pytest tests/test_flash_attention_mgpu_bwd.py
-k hopper`) covers the in-place wgmma path. Fresh random inputs each run (FLASH_SEED=<seed> to
reproduce); interpret mode is slow, so the shapes are small.

Tolerances (relative L2 error against the f32 reference's gradients): bf16 1.5e-2, f16 2e-3
(seen: ~2.5e-3 bf16 on the CPU; the inputs are rounded to the dtype, P and dS are rounded to it
before their matmuls, as in every flash kernel).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from scaling.kernels import attention_reference, flash_attention
from scaling.kernels.flash_attention_mgpu import MosaicConfig, mosaic_forward
from scaling.kernels.flash_attention_mgpu_bwd import (SMEM_BYTES, MosaicBwdConfig, dkv_smem_bytes, dq_smem_bytes,
                                                      mosaic_backward, unsupported_reason)

from mosaic_helpers import ON_HOPPER, TOL, non_tma_races
from mosaic_helpers import inputs as _inputs
from mosaic_helpers import rel as _rel
from mosaic_helpers import seed as _seed

fa = importlib.import_module("scaling.kernels.flash_attention")


def _ref_grads(q, k, v, do, causal):
    f32 = lambda x: x.astype(jnp.float32)
    _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=causal), f32(q), f32(k), f32(v))
    return vjp(f32(do))


def _check(seed, dtype, grads, ref):
    for name, a, r in zip(("dq", "dk", "dv"), grads, ref):
        assert a.dtype == dtype and a.shape == r.shape, (name, a.dtype, a.shape, r.shape)
        err = _rel(a, r)
        assert np.isfinite(err) and err < TOL[dtype], f"{name} rel err {err:.2e} (seed {seed})"


CASES = [  # b, t, s, h, kv, d, causal, dtype, backward config, what it covers
    (1, 256, 256, 2, 2, 64, True, jnp.bfloat16, None,
     "causal MHA D=64: default D=64 tiles (128-row q slots, 128-key dQ slots), two K/V CTAs"),
    (1, 128, 128, 4, 1, 128, True, jnp.float16, None,
     "causal GQA 4 D=128 f16: dK/dV summed over the group in-kernel; both consumers' skip slots"),
    (1, 128, 256, 3, 1, 64, False, jnp.bfloat16,
     MosaicBwdConfig(block_q_dkv=128, block_kv_dq=128, stages_dkv=3, stages_dq=3, delta_in_dq=True),
     "non-causal GQA 3, T != S, wide tiles, 3-stage rings deeper than the step counts, delta in the dQ kernel"),
    (2, 256, 256, 2, 2, 64, True, jnp.bfloat16,
     MosaicBwdConfig(block_q_dkv=128, block_kv_dq=128, persistent=True, persistent_dq=True, persistent_ctas=3),
     "persistent dK/dV and dQ: 3 CTAs each loop over 8 (tile, head, batch) items, the rings run across items"),
    (1, 256, 256, 4, 1, 128, True, jnp.float16,
     MosaicBwdConfig(persistent=True, persistent_dq=True, persistent_ctas=1),
     "persistent dK/dV and dQ, GQA 4 D=128: one CTA runs every item (2 K/V tiles; 8 q tiles)"),
    (1, 256, 256, 4, 2, 128, True, jnp.bfloat16, MosaicBwdConfig(fused_dq=True),
     "fused dQ: causal GQA 2, dS K in the dK/dV kernel split by columns over the consumers, two K/V CTAs' "
     "partial dQ summed (interpret stand-in for the TMA reduce-add)"),
    (2, 256, 256, 1, 1, 128, True, jnp.bfloat16,
     MosaicBwdConfig(dq_from_ds=True, ds_dq_tiles=4, stages_dq=3, ds_workspace_max_bytes=1),
     "dq from stored dS, causal MHA D=128: one batch row per chunk (the smallest budget), written in place, "
     "4 q tiles per dQ CTA whose accumulators drop out one by one"),
    (1, 128, 256, 4, 2, 64, False, jnp.float16,
     MosaicBwdConfig(dq_from_ds=True, ds_workspace_max_bytes=1 << 17),
     "dq from stored dS, non-causal GQA 2, T != S: one KV head per chunk, each writing its heads of dQ, dK, dV "
     "in place"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[-1].split(":")[0] for c in CASES])
def test_backward_matches_reference_interpret(case, capfd):
    """Gradients against the f32 reference, and no race (other than the detector's false ones on TMA loads) under the interpreter's race
    detector (a race need not show in the numbers: the fused dQ once staged dK into K rows its
    partner was still reading, and failed 1 run in ~20)."""
    b, t, s, h, kv, d, causal, dtype, cfg, _ = case
    seed = _seed()
    q, k, v, do = _inputs(seed, b, t, s, h, kv, d, dtype)
    o, lse = mosaic_forward(q, k, v, causal=causal, config=MosaicConfig(block_kv=64), interpret=True)
    capfd.readouterr()
    grads = mosaic_backward(q, k, v, o, lse, do, causal=causal, config=cfg,
                            interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(grads)
    assert not (races := non_tma_races(capfd.readouterr().out)), races
    _check(seed, dtype, grads, _ref_grads(q, k, v, do, causal))


def test_flash_attention_dispatches_mosaic_backward_interpret(monkeypatch):
    """backend="mosaic": Mosaic forward and backward through the custom_vjp (GQA 2, causal)."""
    calls = []
    real = fa.mgpu_bwd.mosaic_backward
    monkeypatch.setattr(fa.mgpu_bwd, "mosaic_backward", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    seed = _seed()
    b, t, h, kv, d, dtype = 1, 128, 4, 2, 64, jnp.bfloat16
    q, k, v, do = _inputs(seed, b, t, t, h, kv, d, dtype)
    bwd_cfg = MosaicBwdConfig(stages_dkv=3)
    ours = lambda q, k, v: flash_attention(q, k, v, causal=True, backend="mosaic",
                                           mosaic_config=MosaicConfig(block_kv=64), mosaic_bwd_config=bwd_cfg)
    _, vjp = jax.vjp(ours, q, k, v)
    grads = vjp(do)
    assert calls and calls[0]["config"] == bwd_cfg, "the Mosaic backward was not used"
    _check(seed, dtype, grads, _ref_grads(q, k, v, do, True))


def test_backward_switch_and_fallback(monkeypatch):
    """mosaic_backward=False, or a shape the Mosaic backward refuses, keeps the Triton backward."""
    monkeypatch.setattr(fa.mgpu_bwd, "mosaic_backward", lambda *a, **kw: pytest.fail("Mosaic backward used"))
    x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    plans = []
    monkeypatch.setattr(fa, "_flash", lambda q, k, v, seg, plan: plans.append(plan) or q)
    flash_attention(x, x, x, backend="mosaic", mosaic_backward=False)
    flash_attention(x, x, x, backend="mosaic", mosaic_bwd_config=MosaicBwdConfig(block_kv_dkv=128))  # S=128 < 2*128
    flash_attention(x, x, x, backend="mosaic")
    assert [p.mosaic is not None for p in plans] == [True, True, True]
    assert [p.mosaic_bwd is not None for p in plans] == [False, False, True]
    with pytest.raises(TypeError, match="mosaic_bwd_config"):
        flash_attention(x, x, x, backend="mosaic", mosaic_bwd_config={"stages_dq": 3})
    with pytest.raises(ValueError, match="stages_dq"):
        flash_attention(x, x, x, backend="mosaic", mosaic_bwd_config=MosaicBwdConfig(stages_dq=1))
    with pytest.raises(TypeError, match="mosaic_backward"):
        flash_attention(x, x, x, backend="mosaic", mosaic_backward="yes")


H100 = "NVIDIA H100 80GB HBM3"


def test_auto_backend_rule(monkeypatch):
    """backend="auto" on Hopper: the measured forward rule per device, the Mosaic backward
    whenever it supports the call (also behind a Triton forward), Triton off Hopper."""
    plans = []
    monkeypatch.setattr(fa, "_flash", lambda q, k, v, seg, plan: plans.append(plan) or q)
    monkeypatch.setattr(fa.mgpu, "device_kind", lambda: H100)
    z = lambda t, h, d: jnp.zeros((1, t, h, d), jnp.bfloat16)
    run = lambda q, k, **kw: flash_attention(q, k, k, backend="auto", **kw)

    monkeypatch.setattr(fa, "is_hopper", lambda: False)
    run(z(128, 2, 128), z(128, 2, 128))  # not Hopper: all Triton
    monkeypatch.setattr(fa, "is_hopper", lambda: True)
    run(z(128, 2, 128), z(128, 2, 128))  # H100, MHA D=128 short: Mosaic fwd + bwd (persistent fwd)
    run(z(128, 4, 128), z(128, 1, 128))  # H100, GQA 4 (head pairing): Mosaic fwd + bwd
    run(z(128, 2, 128), z(128, 2, 128), causal=False)  # non-causal MHA D=128: Mosaic fwd + bwd
    run(z(128, 2, 96), z(128, 2, 96))  # D=96: neither Mosaic kernel
    run(z(128, 2, 128), z(128, 2, 128), segment_ids=jnp.zeros((1, 128), jnp.int32))  # segments: Triton
    run(z(128, 2, 128), z(128, 2, 128), mosaic_backward=False)
    monkeypatch.setattr(fa.mgpu, "device_kind", lambda: "NVIDIA H200")
    run(z(128, 2, 128), z(128, 2, 128))  # H200: Mosaic fwd + bwd
    assert [(p.mosaic is not None, p.mosaic_bwd is not None) for p in plans] == [
        (False, False), (True, True), (True, True), (True, True), (False, False), (False, False),
        (True, False), (True, True)]
    assert plans[1].mosaic_bwd.dq_from_ds and plans[2].mosaic_bwd.dq_from_ds  # MHA / GQA 4, D=128
    long_t = fa.mgpu_bwd.LONG_KV_DQ[0]  # dQ from the stored dS at every length, GQA or not
    run(z(long_t, 2, 128), z(long_t, 1, 128))
    run(z(long_t, 1, 128), z(long_t, 1, 128))
    assert plans[-2].mosaic_bwd.dq_from_ds and plans[-1].mosaic_bwd.dq_from_ds
    assert fa.mgpu_bwd.default_config(128, long_t, workspace_bytes=0) == fa.mgpu_bwd.LONG_KV_DQ[1]
    assert fa.mgpu_bwd.default_config(64, long_t) == fa.mgpu_bwd.DEFAULT_CONFIGS[64]
    assert fa.mgpu_bwd.unsupported_reason((1, long_t, 2, 128), (1, long_t, 2, 128), jnp.bfloat16, causal=True,
                                          segmented=False) is None
    plans[8:] = []
    assert plans[2].mosaic == fa.mgpu.H100_CONFIGS[128] and plans[7].mosaic == fa.mgpu.DEFAULT_CONFIGS[128]
    for kind in (H100, "NVIDIA H200"):
        cfg = fa.mgpu.default_config(128, kind)
        assert cfg.persistent and cfg.stages == 2 and fa.mgpu.default_config(64, kind).persistent
        assert not fa.mgpu.default_config(256, kind).persistent  # a second Q-sized buffer does not fit
    assert fa.mgpu.default_config(96, H100) is None


def test_triton_forward_mosaic_backward_interpret(monkeypatch):
    """backend="auto" where the rule picks the Triton forward: its lse converted to [B, H, T]
    for the Mosaic backward; gradients against the reference. GQA 2 folds two query heads into
    the Triton forward's rows, so the conversion has to unfold them (the rule is forced to
    Triton here: on the H100 it picks the Mosaic forward for even groups)."""
    calls = []
    real = fa.mgpu_bwd.mosaic_backward
    monkeypatch.setattr(fa.mgpu_bwd, "mosaic_backward", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(fa.mgpu, "mosaic_forward", lambda *a, **kw: pytest.fail("Mosaic forward used"))
    monkeypatch.setattr(fa, "is_hopper", lambda: True)
    monkeypatch.setattr(fa, "mosaic_forward_preferred", lambda *a, **kw: False)
    seed = _seed()
    b, t, h, kv, d, dtype = 1, 128, 4, 2, 64, jnp.bfloat16
    q, k, v, do = _inputs(seed, b, t, t, h, kv, d, dtype)
    ours = lambda q, k, v: flash_attention(q, k, v, causal=True, backend="auto")
    o, vjp = jax.vjp(ours, q, k, v)
    grads = vjp(do)
    assert calls, "the Mosaic backward was not used"
    _check(seed, dtype, grads, _ref_grads(q, k, v, do, True))


@pytest.mark.parametrize("kwargs, reason", [
    (dict(segmented=True), "segment ids"),
    (dict(dtype=jnp.float32), "dtype float32"),
    (dict(d=256), "head dim 256"),
    (dict(t=192, s=256, causal=False), "q length 192"),
    (dict(t=256, s=320, causal=False), "kv length 320"),
    (dict(t=256, s=512, causal=True), "causal with q length"),
    (dict(config=MosaicBwdConfig(fused_dq=True, stages_dkv=4)), "dK/dV kernel would need"),
    (dict(d=64, config=MosaicBwdConfig(fused_dq=True)), "fused_dq needs head dim 128"),
    (dict(config=MosaicBwdConfig(block_kv_dq=128, stages_dq=3)), "dQ kernel would need"),
])
def test_unsupported_reasons(kwargs, reason):
    args = dict(t=256, s=256, h=4, kv=2, d=128, dtype=jnp.bfloat16, causal=True, segmented=False, config=None)
    args.update(kwargs)
    got = unsupported_reason((1, args["t"], args["h"], args["d"]), (1, args["s"], args["kv"], args["d"]),
                             args["dtype"], causal=args["causal"], segmented=args["segmented"], config=args["config"])
    assert got is not None and reason in got, got
    assert unsupported_reason((1, 256, 4, 128), (1, 256, 2, 128), jnp.bfloat16, causal=True, segmented=False) is None


def bwd_defaults():
    from scaling.kernels.flash_attention_mgpu_bwd import DEFAULT_CONFIGS
    return DEFAULT_CONFIGS.items()


def test_shared_memory_estimates_match_mosaic():
    """Mosaic GPU refused the dQ kernel with 128-key slots and 3 stages on an H200 with
    "smem_bytes=264352 > max_smem_bytes=232448" (attention_session6/); our estimates leave out
    only the barriers (about a kilobyte). The default tiles fit, fused dQ's too."""
    assert dkv_smem_bytes(MosaicBwdConfig(fused_dq=True), 128, 2) <= SMEM_BYTES
    two = MosaicBwdConfig(fused_dq=True, dq_stage_buffers=2)  # + 2 x 16 KB: 230,400 bytes, a kilobyte to spare
    assert dkv_smem_bytes(two, 128, 2) - dkv_smem_bytes(MosaicBwdConfig(fused_dq=True), 128, 2) == 2 * 64 * 64 * 4
    assert dkv_smem_bytes(two, 128, 2) <= SMEM_BYTES - 1024
    # the dQ kernel with 128-key slots and 3 stages: "smem_bytes=264352" on an H200
    est = dq_smem_bytes(MosaicBwdConfig(block_kv_dq=128, stages_dq=3), 128, 2)
    assert 264352 - 2048 <= est <= 264352
    for d, cfg in bwd_defaults():
        assert dkv_smem_bytes(cfg, d, 2) <= SMEM_BYTES and dq_smem_bytes(cfg, d, 2) <= SMEM_BYTES


def test_mosaic_backward_raises_before_running():
    x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="lse must be float32"):
        mosaic_backward(x, x, x, x, lse.astype(jnp.bfloat16), x)
    with pytest.raises(ValueError, match="lse must be float32"):
        mosaic_backward(x, x, x, x, lse[:, :1], x)
    with pytest.raises(ValueError, match="o and do"):
        mosaic_backward(x, x, x, x[:, :64], lse, x)
    with pytest.raises(ValueError, match="share a dtype"):
        mosaic_backward(x, x, x, x, lse, x.astype(jnp.float16))
    with pytest.raises(ValueError, match="4-D"):
        mosaic_backward(x[0], x, x, x, lse, x)
    with pytest.raises(ValueError, match="head dim 96"):
        y = jnp.zeros((1, 128, 2, 96), jnp.bfloat16)
        mosaic_backward(y, y, y, y, lse, y)
    with pytest.raises(ValueError, match="block_q_dq"):
        mosaic_backward(x, x, x, x, lse, x, config=MosaicBwdConfig(block_q_dq=128))
    with pytest.raises(ValueError, match="block_kv_dkv"):
        mosaic_backward(x, x, x, x, lse, x, config=MosaicBwdConfig(block_kv_dkv=96))
    with pytest.raises(TypeError, match="MosaicBwdConfig"):
        mosaic_backward(x, x, x, x, lse, x, config=MosaicConfig())
    with pytest.raises(ValueError, match="fused_dq"):
        mosaic_backward(x, x, x, x, lse, x, config=MosaicBwdConfig(fused_dq=True, delta_in_dq=True))
    with pytest.raises(ValueError, match="persistent"):
        mosaic_backward(x, x, x, x, lse, x, config=MosaicBwdConfig(fused_dq=True, persistent=True))
    with pytest.raises(ValueError, match="persistent_ctas"):
        mosaic_backward(x, x, x, x, lse, x, config=MosaicBwdConfig(persistent_ctas=-2))
    for bad in (MosaicBwdConfig(dq_stage_buffers=2), MosaicBwdConfig(fused_dq=True, dq_stage_buffers=3)):
        with pytest.raises(ValueError, match=r"dq_stage_buffers=\d must be 1, or 2 with fused_dq"):
            mosaic_backward(x, x, x, x, lse, x, config=bad)
    for bad in (MosaicBwdConfig(dq_stage_swizzle=0), MosaicBwdConfig(fused_dq=True, dq_stage_swizzle=16)):
        with pytest.raises(ValueError, match=r"dq_stage_swizzle=\d+ must be 128, or 0, 32 or 64 with fused_dq"):
            mosaic_backward(x, x, x, x, lse, x, config=bad)
    with pytest.raises(ValueError, match="persistent_dq"):
        mosaic_backward(x, x, x, x, lse, x, config=MosaicBwdConfig(persistent_dq=True, delta_in_dq=True))


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (the in-place wgmma path)")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h, kv, d, dtype", [(8, 8, 128, jnp.bfloat16), (8, 2, 128, jnp.bfloat16),
                                             (6, 2, 64, jnp.float16), (4, 1, 64, jnp.bfloat16)])
def test_backward_on_hopper(causal, h, kv, d, dtype):
    seed = _seed()
    q, k, v, do = _inputs(seed, 2, 512, 512, h, kv, d, dtype)
    ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="mosaic")
    grads = jax.jit(lambda q, k, v, do: jax.vjp(ours, q, k, v)[1](do))(q, k, v, do)
    with jax.default_matmul_precision("highest"):
        ref = _ref_grads(q, k, v, do, causal)
    _check(seed, dtype, grads, ref)


def test_ds_workspace_layout_and_chunks():
    """The dq_from_ds workspace: every visible (q tile, key tile) pair gets its own rows inside
    the workspace, the pairs a causal mask hides get none; the chunks cover every (batch row,
    KV head) once, stay within the budget wherever one KV head does, and are as few and as
    even as the budget allows."""
    from scaling.kernels import flash_attention_mgpu_bwd as bwd

    tile = 64
    for t, s_len, causal in ((512, 512, True), (256, 384, False), (64, 64, True)):
        cfg = MosaicBwdConfig(dq_from_ds=True)
        geo = bwd._Geometry(batch=1, q_len=t, kv_len=s_len, heads=2, kv_heads=1, head_dim=64, causal=causal,
                            sm_scale=1.0, cfg=cfg)
        visible = [(i, j) for i in range(t // tile) for j in range(s_len // tile) if not causal or j <= i]
        tiles = bwd.ds_workspace_tiles(t, s_len, tile, causal)
        assert tiles == len(visible)
        rows = {int(bwd._ds_row(geo, i, j)) for i, j in visible}
        assert len(rows) == len(visible) and all(r % tile == 0 and 0 <= r < tiles * tile for r in rows)
        assert bwd.ds_workspace_bytes((3, t, 4, 64), (3, s_len, 2, 64), 2, causal=causal, cfg=cfg) == \
            3 * 4 * len(visible) * tile * tile * 2

    def chunks(batch, kv_heads, budget, group=2):
        cfg = MosaicBwdConfig(dq_from_ds=True, ds_workspace_max_bytes=budget)
        geo = bwd._Geometry(batch=batch, q_len=256, kv_len=256, heads=group * kv_heads, kv_heads=kv_heads,
                            head_dim=64, causal=True, sm_scale=1.0, cfg=cfg)
        return bwd._ds_chunks(geo, 2)

    per_kv_head = 2 * 10 * tile * tile * 2  # group 2, 4 * 5 / 2 visible tiles
    for batch, kv_heads, budget in ((3, 4, 1 << 40), (3, 4, 2 * 4 * per_kv_head), (3, 4, 3 * per_kv_head),
                                    (2, 3, 1)):
        got = chunks(batch, kv_heads, budget)
        covered = sorted((b, h) for b0, nb, h0, nh in got for b in range(b0, b0 + nb) for h in range(h0, h0 + nh))
        assert covered == [(b, h) for b in range(batch) for h in range(kv_heads)], got
        assert all(nb * nh * per_kv_head <= budget or nb * nh == 1 for _, nb, _, nh in got), got
    assert chunks(3, 4, 1 << 40) == [(0, 3, 0, 4)]
    assert chunks(3, 4, 2 * 4 * per_kv_head) == [(0, 2, 0, 4), (2, 1, 0, 4)]
    assert chunks(2, 3, 1) == [(b, 1, h, 1) for b in range(2) for h in range(3)]
    # As few chunks as the budget allows, of even sizes: 32 KV heads at 15 per chunk are
    # 12 + 10 + 10, not 15 + 15 + 2 (the 16k benchmark shape under the 4 GiB default), nor
    # 11 + 11 + 10: runs of heads hold an even number of heads where the count and the budget
    # allow, even at the price of a chunk (the dK/dV kernel takes as long for an odd number of
    # heads as for one more).
    for group in (1, 2):
        per_head = per_kv_head * group // 2
        assert chunks(1, 32, 15 * per_head, group) == [(0, 1, 0, 12), (0, 1, 12, 10), (0, 1, 22, 10)]
        assert chunks(1, 8, 3 * per_head, group) == [(0, 1, h, 2) for h in (0, 2, 4, 6)]
        assert chunks(1, 33, 15 * per_head, group) == [(0, 1, 0, 11), (0, 1, 11, 11), (0, 1, 22, 11)]
        assert chunks(1, 4, per_head, group) == [(0, 1, h, 1) for h in range(4)]
    assert chunks(5, 1, 2 * per_kv_head) == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 1, 0, 1)]
    assert [nb for _, nb, _, _ in chunks(7, 1, 3 * per_kv_head)] == [3, 2, 2]


def test_dq_from_ds_default_and_refusals():
    """D=128 takes dQ from the stored dS by default, grouped heads too; D=64 does not.
    Its settings are checked before anything runs."""
    from scaling.kernels.flash_attention_mgpu_bwd import default_config

    assert default_config(128, 4096).dq_from_ds and default_config(128, 16384).dq_from_ds
    assert not default_config(64, 4096).dq_from_ds  # GQA takes the same: test_auto_backend_rule
    assert not default_config(128, 4096, workspace_bytes=0).dq_from_ds
    assert dq_smem_bytes(default_config(128), 128, 2) <= SMEM_BYTES
    assert dkv_smem_bytes(default_config(128), 128, 2) <= SMEM_BYTES
    four = MosaicBwdConfig(dq_from_ds=True, ds_dq_tiles=4, stages_dq=3)
    assert dq_smem_bytes(four, 128, 2) <= SMEM_BYTES < dq_smem_bytes(dataclasses.replace(four, stages_dq=4), 128, 2)
    x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 128), jnp.float32)
    for bad, match in ((dict(fused_dq=True), "cannot be combined"), (dict(persistent=True), "cannot be combined"),
                       (dict(block_q_dkv=128), "block_q_dkv == block_kv_dkv"), (dict(ds_dq_tiles=3), "ds_dq_tiles=3"),
                       (dict(ds_workspace_max_bytes=0), "ds_workspace_max_bytes=0")):
        with pytest.raises(ValueError, match=match):
            mosaic_backward(x, x, x, x, lse, x, config=MosaicBwdConfig(dq_from_ds=True, **bad))
    with pytest.raises(ValueError, match="set dq_from_ds too"):  # the launch order of a kernel not there
        mosaic_backward(x, x, x, x, lse, x, config=MosaicBwdConfig(ds_dq_head_major=True))
    y = jnp.zeros((1, 384, 2, 64), jnp.bfloat16)  # 384 rows: not 4 q tiles of 64 per dQ CTA
    assert "multiple of 256" in unsupported_reason(y.shape, y.shape, jnp.bfloat16, causal=True, segmented=False,
                                                   config=dataclasses.replace(four, stages_dq=2))


def test_output_row_dot_matches_float64():
    """delta = rowsum(dO ∘ O), [B, H, T] from [B, T, H, D] bf16 inputs, against numpy float64."""
    from scaling.kernels.flash_attention_mgpu_bwd import output_row_dot

    rng = np.random.default_rng()
    o, do = (jnp.asarray(rng.standard_normal((2, 5, 3, 64)), jnp.bfloat16) for _ in range(2))
    got = np.asarray(output_row_dot(o, do))
    want = np.einsum("bthd,bthd->bht", np.asarray(o, np.float64), np.asarray(do, np.float64))
    assert got.shape == (2, 3, 5) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_workspace_budget_reaches_the_backward(monkeypatch):
    """`attention.bwd_workspace_mb` from the command line reaches the Mosaic backward's default
    tiles through the model's attention core: a budget per chunk, or 0 for the split kernels."""
    from scaling import attention
    from scaling.config import AttentionImpl, load_config

    plans = []
    monkeypatch.setattr(fa, "_flash", lambda q, k, v, seg, plan: plans.append(plan) or q)
    monkeypatch.setattr(fa, "is_hopper", lambda: True)
    x = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    for mb in (None, 64, 0):
        attention.attention_core(AttentionImpl.pallas, bwd_workspace_mb=mb)(x, x, x)
    assert [p.mosaic_bwd.dq_from_ds for p in plans] == [True, True, False]
    assert plans[0].mosaic_bwd.ds_workspace_max_bytes == 4 << 30 and plans[1].mosaic_bwd.ds_workspace_max_bytes == 64 << 20
    with pytest.raises(ValueError, match="bwd_workspace_bytes"):
        flash_attention(x, x, x, backend="mosaic", bwd_workspace_bytes=-1)
    assert load_config("configs/models/tiny.yaml", ["--attention.bwd_workspace_mb=0"]).attention.bwd_workspace_mb == 0
    with pytest.raises(ValueError, match="attention.bwd_workspace_mb"):
        load_config("configs/models/tiny.yaml", ["--attention.bwd_workspace_mb=-5"])
