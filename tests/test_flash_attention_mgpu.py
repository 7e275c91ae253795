"""Mosaic GPU flash attention forward (scaling/kernels/flash_attention_mgpu.py).

On the CPU the kernel runs under Pallas' GPU interpret mode (jax 0.11.2), which simulates the
warpgroups, shared memory, TMA copies and barriers (and checks barrier phases). One difference
from the GPU: interpret mode supports neither `pl.run_state` nor a wgmma with its A operand in
registers, so the P·V product is a `jnp.dot` there (see `_Geometry.in_place`); the Q·Kᵀ wgmma,
the ring, masking, softmax and stores are the GPU code. The GPU test (skipped off-GPU) and
experiments/check_mgpu.py cover the in-place wgmma path (conftest.py defaults JAX_PLATFORMS to cpu:
on a GPU machine run `JAX_PLATFORMS=cuda python -m pytest tests/test_flash_attention_mgpu.py -k hopper`). Fresh random inputs each run
(FLASH_SEED=<seed> to reproduce); interpret mode is slow, so the shapes are small.
"""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from scaling.kernels import attention_reference, flash_attention
from scaling.kernels.flash_attention_mgpu import MosaicConfig, mosaic_forward, unsupported_reason

from mosaic_helpers import ON_HOPPER, TOL, non_tma_races
from mosaic_helpers import inputs as _inputs
from mosaic_helpers import rel as _rel
from mosaic_helpers import seed as _seed

fa = importlib.import_module("scaling.kernels.flash_attention")  # the module (the package exports the function)


def _ref_lse(q, k, causal, scale):
    h, kv = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), h // kv, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kf, precision="highest") * scale
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), logits, -jnp.inf)
    return jax.nn.logsumexp(logits, axis=-1) * math.log2(math.e)


CASES = [  # b, t, s, h, kv, d, causal, dtype, config, what it covers
    (1, 256, 256, 2, 2, 64, True, jnp.bfloat16, MosaicConfig(block_kv=64, stages=2),
     "token pairing, causal: the lower consumer skips ring slots; ping-pong"),
    (1, 256, 256, 4, 2, 64, True, jnp.float16, MosaicConfig(block_kv=64, stages=3),
     "head pairing (GQA 2), causal, ring deeper than some CTAs' step count"),
    (1, 128, 192, 3, 1, 64, False, jnp.bfloat16, MosaicConfig(block_kv=64, stages=2, pingpong=False),
     "GQA 3 -> token pairing, non-causal, T != S, no ping-pong"),
    (1, 128, 128, 2, 2, 128, True, jnp.bfloat16, None, "D=128 default tiles (T=S=128 causal)"),
    (2, 256, 256, 2, 2, 64, True, jnp.bfloat16, MosaicConfig(block_kv=64, stages=2, persistent=True, persistent_ctas=3),
     "persistent, token pairing, causal: 3 CTAs loop over 8 items of unequal length, the ring runs across items"),
    (1, 128, 192, 4, 2, 64, False, jnp.float16,
     MosaicConfig(block_kv=64, stages=3, persistent=True, persistent_ctas=3, pingpong=False),
     "persistent, head pairing, non-causal, T != S: 3 CTAs for 4 items (one CTA runs two)"),
    (1, 384, 384, 2, 2, 64, True, jnp.bfloat16, MosaicConfig(block_kv=64, stages=2, persistent=True, persistent_ctas=4),
     "persistent, causal, odd tile count (3 per head): single items, not heavy/light pairs"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[-1] for c in CASES])
def test_forward_and_lse_interpret(case, capfd):
    """Output and L against the f32 reference; no race but the detector's false ones on TMA loads."""
    b, t, s, h, kv, d, causal, dtype, cfg, _ = case
    seed = _seed()
    q, k, v, _ = _inputs(seed, b, t, s, h, kv, d, dtype)
    capfd.readouterr()
    o, lse = jax.block_until_ready(mosaic_forward(q, k, v, causal=causal, config=cfg,
                                                  interpret=plgpu.InterpretGPUParams(detect_races=True)))
    assert not (races := non_tma_races(capfd.readouterr().out)), races
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (b, h, t) and lse.dtype == jnp.float32
    ref = attention_reference(q, k, v, causal=causal)
    err = _rel(o, ref)
    assert err < TOL[dtype], f"out rel err {err:.2e} (seed {seed})"
    lerr = _rel(lse, _ref_lse(q, k, causal, 1 / math.sqrt(d)))
    assert lerr < 1e-5, f"lse rel err {lerr:.2e} (seed {seed})"


def test_dispatch_mosaic_forward_with_triton_backward_interpret(monkeypatch):
    """backend="mosaic": Mosaic forward, its lse feeding the existing Pallas backward (GQA 4)."""
    calls = []
    real = fa.mgpu.mosaic_forward
    monkeypatch.setattr(fa.mgpu, "mosaic_forward", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    seed = _seed()
    b, t, h, kv, d, dtype = 1, 192, 4, 1, 64, jnp.bfloat16  # fold 4; T=192 -> Triton q_pad 256
    q, k, v, do = _inputs(seed, b, t, t, h, kv, d, dtype)
    cfg = MosaicConfig(block_kv=64, stages=2)
    ours = lambda q, k, v: flash_attention(q, k, v, causal=True, backend="mosaic", mosaic_config=cfg)
    ref = lambda q, k, v: attention_reference(q, k, v, causal=True)
    o, vjp = jax.vjp(ours, q, k, v)
    g = vjp(do)
    assert calls and calls[0]["config"] == cfg, "the Mosaic forward was not used"
    f32 = lambda x: x.astype(jnp.float32)
    o_r, vjp_r = jax.vjp(ref, f32(q), f32(k), f32(v))
    g_r = vjp_r(f32(do))
    for name, a, r in (("out", o, o_r), *zip(("dq", "dk", "dv"), g, g_r)):
        err = _rel(a, r)
        assert err < TOL[dtype], f"{name} rel err {err:.2e} (seed {seed})"


@pytest.mark.parametrize("kwargs, reason", [
    (dict(segmented=True), "segment ids"),
    (dict(dtype=jnp.float32), "dtype float32"),
    (dict(d=96), "head dim 96"),
    (dict(t=200, s=200), "q length 200"),
    (dict(t=256, s=200, causal=False), "kv length 200"),
    (dict(t=256, s=512, causal=True), "causal with q length"),
    (dict(config=MosaicConfig(stages=3, persistent=True)), "shared memory"),  # + the output staging
])
def test_unsupported_reasons(kwargs, reason):
    args = dict(b=1, t=256, s=256, h=4, kv=4, d=128, dtype=jnp.bfloat16, causal=True, segmented=False, config=None)
    args.update(kwargs)
    got = unsupported_reason((args["b"], args["t"], args["h"], args["d"]), (args["b"], args["s"], args["kv"], args["d"]),
                             args["dtype"], causal=args["causal"], segmented=args["segmented"], config=args["config"])
    assert got is not None and reason in got
    assert unsupported_reason((1, 256, 4, 128), (1, 256, 4, 128), jnp.bfloat16, causal=True, segmented=False) is None


def test_persistent_grid_geometry():
    """Which calls run persistent, and with how many CTAs: long causal rows keep one CTA per
    tile (measured faster there), a grid never has more CTAs than work items."""
    from scaling.kernels import flash_attention_mgpu as mgpu

    cfg = MosaicConfig(persistent=True, persistent_ctas=132)

    def geo(t, causal, b=1, h=32, kv=32, cfg=cfg):
        return mgpu._Geometry(batch=b, q_len=t, kv_len=t, heads=h, kv_heads=kv, head_dim=128, causal=causal,
                              scale_log2=1.0, cfg=cfg)

    limit = mgpu.PERSISTENT_MAX_CAUSAL_LEN
    assert geo(limit, True).persistent and not geo(2 * limit, True).persistent and geo(2 * limit, False).persistent
    assert not geo(1024, True, cfg=MosaicConfig()).persistent
    assert geo(4096, True, b=4).num_items == 32 * 32 * 4 and geo(4096, True, b=4).num_ctas == 132
    assert geo(128, True, h=2, kv=2).num_items == 2 and geo(128, True, h=2, kv=2).num_ctas == 2
    assert geo(256, True, h=8, kv=2).num_items == 4 * 4  # head pairing: 4 q tiles x 4 head slots
    assert geo(4096, True, b=4).paired and not geo(4096, False, b=4).paired
    assert geo(256, True, h=4, kv=4).num_items == 8 and geo(256, True, h=4, kv=4).num_ctas == 4  # dealt as 4 pairs
    assert not geo(128, True, h=4, kv=4).paired  # one tile per head: nothing to pair
    with pytest.raises(ValueError, match="persistent_ctas"):
        mosaic_forward(*(jnp.zeros((1, 128, 2, 128), jnp.bfloat16),) * 3, config=MosaicConfig(persistent_ctas=-1))


@pytest.mark.parametrize("tiles,heads,batch,ctas", [(128, 16, 1, 132), (64, 32, 2, 132), (8, 3, 2, 5), (6, 1, 1, 4)])
def test_persistent_schedule_pairs_balance_causal_work(tiles, heads, batch, ctas):
    """item_of: every (tile, head, batch) runs exactly once, and with heavy/light pairs each CTA's
    causal work (tile rank r costs tiles - r K/V steps) is within one pair of the mean. The
    first case is the shape that ran at 0.79x cuDNN with single items dealt round-robin."""
    from scaling.kernels.flash_attention_mgpu import item_of

    items = tiles * heads * batch

    def schedule(paired):
        n = min(ctas, items // 2 if paired else items)
        units = items // 2 if paired else items
        runs = {c: [tuple(int(x) for x in item_of(c, k, tiles=tiles, heads=heads, num_ctas=n, paired=paired))
                    for k in range((2 if paired else 1) * ((units - c + n - 1) // n))] for c in range(n)}
        flat = [it for r in runs.values() for it in r]
        assert sorted(flat) == sorted((t, h, b) for t in range(tiles) for h in range(heads) for b in range(batch))
        return [sum(tiles - t for t, _, _ in r) for r in runs.values()]

    cost = schedule(paired=True)
    assert max(cost) - min(cost) <= tiles + 1  # one pair
    single = schedule(paired=False)
    if (tiles, heads, batch) == (128, 16, 1):  # the aliasing that pairs remove: the heavy half on half the CTAs
        assert max(single) > 2 * min(single)


def test_mosaic_forward_raises_value_errors():
    q = jnp.zeros((1, 200, 4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="q length 200"):
        mosaic_forward(q, q, q)
    with pytest.raises(ValueError, match="dtype float32"):
        mosaic_forward(q.astype(jnp.float32)[:, :128], q.astype(jnp.float32)[:, :128], q.astype(jnp.float32)[:, :128])
    with pytest.raises(ValueError, match="4-D"):
        mosaic_forward(q[0], q, q)
    good = jnp.zeros((1, 128, 4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_q"):
        mosaic_forward(good, good, good, config=MosaicConfig(block_q=128))
    with pytest.raises(ValueError, match="stages"):
        mosaic_forward(good, good, good, config=MosaicConfig(stages=1))


def test_backend_argument_validated_and_fallback():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40, 2, 32)), jnp.float32)
    with pytest.raises(ValueError, match="backend"):
        flash_attention(q, q, q, backend="cuda")
    with pytest.raises(TypeError, match="mosaic_config"):
        flash_attention(q, q, q, backend="mosaic", mosaic_config={"block_kv": 64})
    # Unsupported by Mosaic (f32, D=32, T=40): silently the Triton forward, same result.
    a = flash_attention(q, q, q, backend="mosaic")
    b = flash_attention(q, q, q)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU (the in-place wgmma P·V path)")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("h, kv, d", [(8, 8, 128), (8, 2, 128), (6, 2, 64), (4, 4, 256)])
def test_forward_on_hopper(causal, h, kv, d):
    seed = _seed()
    q, k, v, do = _inputs(seed, 2, 512, 512, h, kv, d, jnp.bfloat16)
    o, lse = jax.jit(lambda q, k, v: mosaic_forward(q, k, v, causal=causal))(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = attention_reference(f32(q), f32(k), f32(v), causal=causal)
        lse_r = _ref_lse(q, k, causal, 1 / math.sqrt(d))
    assert _rel(o, ref) < TOL[jnp.bfloat16], f"seed {seed}"
    assert _rel(lse, lse_r) < 1e-4, f"seed {seed}"
