"""Flash attention (Pallas, interpret mode on the CPU) against the pure-jnp reference.

Fresh random inputs every run: each case draws its seed from SeedSequence and puts it in the
failure message (re-run a failure with FLASH_SEED=<seed>). Errors are relative norms
‖out − ref‖ / ‖ref‖ against the reference evaluated in f32 on the same (upcast) inputs.
Shapes are tiny and tiles small (16/32) so that every case still spans several tiles, a
padded tail, and the causal diagonal inside and across tiles.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling.kernels import BlockSizes, attention_reference, flash_attention
from scaling.kernels.flash_attention import _kv_ranges, _make_plan, _q_ranges

SMALL = BlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16)
FUSED = dataclasses.replace(SMALL, fused_dq=True)  # dQ by atomic adds inside the dK/dV kernel

# Relative-norm tolerances per input dtype. f32 runs full-f32 dots (not tf32): observed ~3e-7.
# bf16 / f16: probabilities and dS are rounded to the input dtype before the P·V, dS·K and
# dSᵀ·Q matmuls, as in every flash kernel: observed ~2e-3 (bf16) and ~3e-4 (f16).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2, jnp.float16: 2e-3}


def _seed() -> int:
    return int(os.environ.get("FLASH_SEED", np.random.SeedSequence().entropy % 2**32))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _segments(rng, b, n, num_ids):
    """Sorted ids (packed documents), every id a run of consecutive positions."""
    return jnp.asarray(np.sort(rng.integers(0, num_ids, (b, n)), axis=1), jnp.int32)


def _check(*, b, t, s, h, kv, d, causal, seg_mode, dtype, blocks, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    do = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    seg = None
    if seg_mode == "single":
        seg = _segments(rng, b, t, 3)
    elif seg_mode == "pair":  # q ids 0..3, kv ids 0..2: queries with id 3 see no key at all
        seg = (_segments(rng, b, t, 4), _segments(rng, b, s, 3))
    scale = float(rng.uniform(0.05, 0.3))

    def ours(q, k, v):
        # Default tiles also leave interpret=False: the CPU backend must switch to interpret mode.
        return flash_attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=scale, block_sizes=blocks,
                               interpret=blocks is not None)

    def ref(q, k, v):
        return attention_reference(q, k, v, causal=causal, segment_ids=seg, sm_scale=scale)

    def value_and_grads(f):
        return jax.jit(lambda q, k, v, do: (f(q, k, v), jax.vjp(f, q, k, v)[1](do)))

    out, grads = value_and_grads(ours)(q, k, v, do)
    f32 = lambda x: x.astype(jnp.float32)
    out_ref, grads_ref = value_and_grads(ref)(f32(q), f32(k), f32(v), f32(do))

    msg = f"seed={seed} (FLASH_SEED={seed} to reproduce)"
    assert out.shape == q.shape and out.dtype == q.dtype, msg
    tol = TOL[dtype]
    for name, x, r in (("out", out, out_ref), *zip(("dq", "dk", "dv"), grads, grads_ref)):
        x = np.asarray(f32(x))
        assert np.isfinite(x).all(), f"{name} has NaN/inf; {msg}"
        err = _rel(x, r)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e} ({dtype.__name__}); {msg}"
    if seg_mode == "pair":  # fully masked rows: output exactly 0 and no gradient through them
        q_ids, kv_ids = (np.asarray(x) for x in seg)
        empty = ~(q_ids[:, :, None] == kv_ids[:, None, :]).any(-1)  # [B, T]
        assert empty.any(), f"test setup: no fully masked row; {msg}"
        assert (np.asarray(f32(out))[empty] == 0).all(), msg
        assert (np.asarray(f32(grads[0]))[empty] == 0).all(), msg
    return out


CASES = [
    # b, t, s, h, kv, d, causal, segments, dtype, blocks (None: the tuned table, auto-interpret)
    pytest.param(1, 64, 64, 2, 2, 64, True, None, jnp.float32, None, id="causal-mha-d64-f32-default-tiles"),
    pytest.param(2, 50, 50, 4, 2, 64, True, None, jnp.bfloat16, FUSED, id="causal-gqa2-unaligned-bf16-fused"),
    pytest.param(1, 40, 40, 8, 2, 128, True, None, jnp.float16, SMALL, id="causal-gqa4-d128-f16"),
    pytest.param(1, 24, 24, 2, 1, 256, True, None, jnp.bfloat16, SMALL, id="causal-gqa2-d256-bf16"),
    pytest.param(2, 40, 70, 4, 2, 64, False, None, jnp.float32, SMALL, id="cross-t-ne-s-gqa2-f32"),
    pytest.param(2, 48, 48, 8, 1, 64, True, "single", jnp.bfloat16, SMALL, id="causal-segments-gqa8-bf16"),
    pytest.param(2, 36, 19, 6, 2, 64, False, "pair", jnp.float16, FUSED, id="cross-segment-pair-gqa3-f16-fused"),
    pytest.param(1, 40, 40, 4, 4, 64, True, "pair", jnp.float32, SMALL, id="causal-segment-pair-f32"),
]


@pytest.mark.parametrize("b,t,s,h,kv,d,causal,seg_mode,dtype,blocks", CASES)
def test_matches_reference(b, t, s, h, kv, d, causal, seg_mode, dtype, blocks):
    _check(b=b, t=t, s=s, h=h, kv=kv, d=d, causal=causal, seg_mode=seg_mode, dtype=dtype, blocks=blocks,
           seed=_seed())


def _visible_tiles(causal, n_q, n_k, q_tokens, block_k, kv_len):
    """Brute force: which (q tile, K/V tile) pairs hold at least one visible, resp. masked, entry."""
    t = np.arange(n_q * q_tokens)[:, None]
    s = np.arange(n_k * block_k)[None, :]
    vis = (t >= s) if causal else np.broadcast_to(s < kv_len, (t.shape[0], s.shape[1]))
    vis = vis.reshape(n_q, q_tokens, n_k, block_k)
    return vis.any(axis=(1, 3)), ~vis.all(axis=(1, 3))


@pytest.mark.parametrize("causal,t,s", [(True, 96, 96), (False, 40, 70), (False, 64, 64)])
def test_loop_bounds_skip_invisible_tiles(causal, t, s):
    """The loops visit exactly the tiles with a visible entry, and mask only the tiles that need it."""
    q = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, s, 2, 64), jnp.bfloat16)
    blocks = BlockSizes(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16)
    plan = _make_plan(q, k, causal=causal, segmented=False, sm_scale=1.0, blocks=blocks, interpret=True)
    for tiles, by_q in ((plan.fwd, True), (plan.dkv, False)):
        n_q, n_k = plan.q_pad // tiles.q_tokens, plan.kv_pad // tiles.k
        visible, needs_mask = _visible_tiles(causal, n_q, n_k, tiles.q_tokens, tiles.k, plan.kv_len)
        visited = np.zeros((n_q, n_k), bool)
        masked = np.zeros((n_q, n_k), bool)
        for outer in range(n_q if by_q else n_k):
            if by_q:
                ranges = _kv_ranges(plan, outer * tiles.q_tokens, tiles.q_tokens, tiles.k)
            else:
                ranges = _q_ranges(plan, outer * tiles.k, tiles.q_tokens, tiles.k)
            for (lo, hi), is_masked in zip(ranges, (False, True)):
                for inner in range(int(lo), int(hi)):
                    i, j = (outer, inner) if by_q else (inner, outer)
                    assert not visited[i, j], f"tile {(i, j)} visited twice"
                    visited[i, j], masked[i, j] = True, is_masked
        # Padded query rows may see padded keys; only real rows are required to be exact.
        np.testing.assert_array_equal(visited, visible)
        assert not (needs_mask & ~masked & visible).any(), "a tile needing a mask ran unmasked"
        if causal:
            assert visited.sum() < n_q * n_k, "causal loops must skip tiles above the diagonal"


def test_gqa_kernels_read_unrepeated_kv():
    """Every pallas_call gets K and V with KV heads, never repeated up to H."""
    q = jnp.zeros((1, 32, 8, 64), jnp.bfloat16)
    k = jnp.zeros((1, 32, 2, 64), jnp.bfloat16)
    f = lambda q, k, v: flash_attention(q, k, v, block_sizes=SMALL, interpret=True)
    jaxpr = jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, k)
    shapes = []

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "pallas_call":
                shapes.append([tuple(x.aval.shape) for x in eqn.invars])
            for p in eqn.params.values():
                if hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
                    walk(p.jaxpr)
                elif hasattr(p, "eqns"):
                    walk(p)

    walk(jaxpr.jaxpr)
    assert len(shapes) >= 2, shapes  # forward and backward kernels
    for operands in shapes:
        assert (1, 32, 2, 64) in operands, operands  # K/V with their 2 heads
        # q-like operands are folded 5-D views [B, T, H // fold, fold, D]; a 4-D operand with
        # all 8 heads would be K or V repeated per query head.
        assert all(x[2] == 2 for x in operands if len(x) == 4), operands


def _qkv(t=32, s=32, h=4, kv=2, d=64, dtype=jnp.float32):
    return (jnp.zeros((1, t, h, d), dtype), jnp.zeros((1, s, kv, d), dtype), jnp.zeros((1, s, kv, d), dtype))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(q=jnp.zeros((32, 4, 64))), ValueError, r"q must be 4-D"),
        (dict(q=jnp.zeros((1, 32, 4, 64), jnp.int32)), TypeError, r"q\.dtype=int32 .* allowed: bfloat16, float16, float32"),
        (dict(k=jnp.zeros((1, 32, 2, 64), jnp.bfloat16)), TypeError, r"must share a dtype"),
        (dict(q=jnp.zeros((1, 32, 3, 64))), ValueError, r"q heads h=3 must be a multiple of k/v heads kv=2"),
        (dict(q=jnp.zeros((1, 32, 4, 32))), ValueError, r"k head dim 64 must equal q head dim 32"),
        (dict(q=jnp.zeros((1, 32, 4, 512)), k=jnp.zeros((1, 32, 2, 512)), v=jnp.zeros((1, 32, 2, 512))),
         ValueError, r"head dim d=512 must be in \[1, 256\]"),
        (dict(k=jnp.zeros((2, 32, 2, 64)), v=jnp.zeros((2, 32, 2, 64))), ValueError, r"k batch 2 must equal q batch 1"),
        (dict(v=jnp.zeros((1, 16, 2, 64))), ValueError, r"k and v must have the same shape"),
        (dict(k=jnp.zeros((1, 48, 2, 64)), v=jnp.zeros((1, 48, 2, 64))), ValueError, r"causal=True needs equal q and kv lengths, got t=32 and s=48"),
        (dict(segment_ids=jnp.zeros((1, 31), jnp.int32)), ValueError, r"q_segment_ids must have shape \[B, T\]=\(1, 32\)"),
        (dict(segment_ids=jnp.zeros((1, 32), jnp.float32)), TypeError, r"q_segment_ids\.dtype=float32 must be an integer"),
        (dict(causal=False, k=jnp.zeros((1, 48, 2, 64)), v=jnp.zeros((1, 48, 2, 64)), segment_ids=jnp.zeros((1, 32), jnp.int32)),
         ValueError, r"single segment_ids array needs equal q and kv lengths"),
        (dict(causal=False, k=jnp.zeros((1, 48, 2, 64)), v=jnp.zeros((1, 48, 2, 64)),
              segment_ids=(jnp.zeros((1, 32), jnp.int32), jnp.zeros((1, 32), jnp.int32))),
         ValueError, r"kv_segment_ids must have shape \[B, S\]=\(1, 48\)"),
        (dict(sm_scale=-1.0), ValueError, r"sm_scale must be a finite Python number > 0"),
        (dict(block_sizes=BlockSizes(block_q=48)), ValueError, r"block_sizes\.block_q=48 must be a power of two >= 16"),
        (dict(block_sizes=BlockSizes(block_k=8)), ValueError, r"block_sizes\.block_k=8 must be a power of two >= 16"),
        (dict(block_sizes=BlockSizes(num_warps_fwd=3)), ValueError, r"block_sizes\.num_warps_fwd=3 must be a power of two"),
        (dict(block_sizes=(128, 64)), TypeError, r"block_sizes must be a BlockSizes or None, got tuple"),
    ],
)
def test_validation_errors(kwargs, error, match):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, causal=True)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), interpret=True, **args)


@pytest.mark.parametrize("setting, want", [("tensorfloat32", "DEFAULT"), (None, "DEFAULT"), ("highest", "HIGHEST"),
                                           ("float32", "HIGHEST")])
def test_f32_dots_follow_the_default_matmul_precision(setting, want):
    """The kernel's f32 dots take jax's default matmul precision, as XLA's f32 dots do: TF32
    (DEFAULT) unless "highest"/"float32" is asked for. They were always HIGHEST, full f32 on the
    FMA units: 1.8 TFLOP/s on an H200, the 1b's f32 step 6.95x slower (docs/benchmarks.md)."""
    import re

    q = jnp.ones((1, 64, 2, 64), jnp.float32)
    kv = jnp.ones((1, 64, 1, 64), jnp.float32)
    with jax.default_matmul_precision(setting):
        text = str(jax.make_jaxpr(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True))(q, kv, kv))
    assert set(re.findall(r"precision=\(?Precision\.([A-Z]+)", text)) == {want}
    bf = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    bkv = jnp.ones((1, 64, 1, 64), jnp.bfloat16)
    with jax.default_matmul_precision(setting):  # 16-bit inputs: the tensor cores' own precision always
        text = str(jax.make_jaxpr(lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True))(bf, bkv, bkv))
    assert set(re.findall(r"precision=\(?Precision\.([A-Z]+)", text)) == {"DEFAULT"}
