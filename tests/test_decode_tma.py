"""scaling/kernels/decode_tma.py: the TMA gate/up + SwiGLU in Pallas' GPU interpret mode against
decode_gemv's reference (itself checked against float64 in test_decode_gemv.py), its refusals,
and its lowering for Hopper (the wgmma path that interpret mode replaces by a dot)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from scaling.kernels import decode_gemv as g
from scaling.kernels import decode_tma as t

from mosaic_helpers import non_tma_races


@pytest.mark.parametrize("b, d, f, blocks, in_kernel_norm", [
    (1, 256, 128, t.TmaBlocks(block_f=64, block_k=64, stages=2), False),  # the ring wraps twice; two CTAs
    (3, 512, 192, t.TmaBlocks(block_f=64, block_k=128, stages=3), False),  # 3 rows; steps not a multiple of stages
    (2, 768, 128, t.TmaBlocks(block_f=64, block_k=256, stages=2), True),  # the statistic in the kernel, ring wraps
])
def test_gate_up_swiglu_matches_reference_interpret(b, d, f, blocks, in_kernel_norm, capfd):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((b, d)) * rng.uniform(0.1, 10, (b, 1)), jnp.bfloat16)  # rows of unlike scale
    w = jnp.asarray(rng.standard_normal((2 * f, d)) * 0.05, jnp.bfloat16)
    # padding rows hold anything, even NaN: the rows of the product (and of the statistic) are independent
    x8 = jnp.concatenate([x, jnp.full((8 - b, d), jnp.nan, jnp.bfloat16)])
    r8, eps = (None, 1e-5) if in_kernel_norm else (t.row_rsqrt(x8, 1e-5), None)
    capfd.readouterr()
    got = np.asarray(t.gate_up_swiglu_tma(x8, r8, w, blocks=blocks, norm_eps=eps,
                                          interpret=plgpu.InterpretGPUParams(detect_races=True)), np.float32)
    assert not (races := non_tma_races(capfd.readouterr().out)), races  # mosaic_helpers says which are left out
    assert got.shape == (8, f)
    want = np.asarray(g.gate_up_swiglu_reference(x, w, eps=1e-5), np.float32)
    np.testing.assert_allclose(got[:b], want, rtol=2e-2, atol=2e-2)  # both rounded to bf16 once


@pytest.mark.parametrize("b, k, n, blocks", [
    (1, 512, 192, t.TmaBlocks(block_f=64, block_k=128, stages=2)),  # the ring wraps twice; three CTAs
    (4, 256, 128, t.TmaBlocks(block_f=128, block_k=128, stages=3)),  # steps fewer than stages
])
def test_residual_and_head_projections_match_reference_interpret(b, k, n, blocks, capfd):
    """matmul_residual_tma (the output and down projections on the 8-row residual stream; zero
    padding rows stay zero) and norm_matmul_tma (the head: in-kernel statistic, f32 logits)."""
    rng = np.random.default_rng()
    pad = lambda a: jnp.concatenate([a, jnp.zeros((8 - b, a.shape[1]), a.dtype)])  # noqa: E731
    a = jnp.asarray(rng.standard_normal((b, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((b, n)), jnp.bfloat16)
    params = plgpu.InterpretGPUParams(detect_races=True)
    capfd.readouterr()
    out = t.matmul_residual_tma(pad(a), w, pad(r), blocks=blocks, interpret=params)
    x = jnp.asarray(rng.standard_normal((b, k)) * rng.uniform(0.1, 10, (b, 1)), jnp.bfloat16)
    logits = t.norm_matmul_tma(pad(x), w, eps=1e-5, blocks=blocks, interpret=params)
    assert not (races := non_tma_races(capfd.readouterr().out)), races
    assert out.shape == (8, n) and out.dtype == jnp.bfloat16 and logits.shape == (8, n) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out[:b], np.float32),
                               np.asarray(g.matmul_residual_reference(a, w, r), np.float32), rtol=2e-2, atol=2e-2)
    assert not np.asarray(out[b:], np.float32).any()  # zero rows in, zero rows out
    np.testing.assert_allclose(np.asarray(logits[:b]), np.asarray(g.norm_matmul_reference(x, w, eps=1e-5)),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("b, n, kv, h, d, blocks", [
    (1, 4, 2, 64, 256, t.TmaBlocks(block_f=64, block_k=128, stages=2)),  # two heads per CTA (rows reordered)
    (3, 2, 2, 128, 512, t.TmaBlocks(block_f=64, block_k=256, stages=3)),  # one head per CTA (natural order)
])
def test_qkv_rope_matches_reference_interpret(b, n, kv, h, d, blocks, capfd):
    """q and the new k/v rows of qkv_rope_tma (norm statistic in the kernel, RoPE between its two
    accumulators) against decode_gemv's qkv_rope reference, at positions of unlike size; NaN
    padding rows."""
    from scaling import layers
    from scaling.config import ModelConfig

    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((b, d)) * rng.uniform(0.1, 10, (b, 1)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(((n + 2 * kv) * h, d)) / np.sqrt(d), jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, 4000, b), jnp.int32)
    cfg = ModelConfig(vocab_size=64, hidden_size=d, num_layers=1, num_heads=n, num_kv_heads=kv, head_dim=h, mlp_dim=64)
    inv = layers.rope_frequencies(cfg)
    x8 = jnp.concatenate([x, jnp.full((8 - b, d), jnp.nan, jnp.bfloat16)])
    pos8 = jnp.zeros((8,), jnp.int32).at[:b].set(pos)
    capfd.readouterr()
    order = t.rope_row_order(w.shape[0], h, blocks.block_f)
    assert sorted(np.asarray(order).tolist()) == list(range(w.shape[0]))  # a permutation
    got = t.qkv_rope_tma(x8, w[order], t.rope_tables(pos8, inv, h, blocks.block_f), num_heads=n, num_kv_heads=kv,
                         head_dim=h, norm_eps=1e-5, blocks=blocks, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not (races := non_tma_races(capfd.readouterr().out)), races
    assert got.shape == (8, (n + 2 * kv) * h) and got.dtype == jnp.bfloat16
    got = t.from_rope_order(got, h, blocks.block_f)
    cache = jnp.zeros((b, 4096, kv, h), jnp.float32)
    q, kc, vc = g.qkv_rope_reference(x, w, inv, pos, cache, cache, num_heads=n, eps=1e-5)
    heads = np.asarray(got[:b], np.float32).reshape(b, n + 2 * kv, h)
    rows = np.arange(b)
    for name, a, r in (("q", heads[:, :n], q), ("k", heads[:, n:n + kv], kc[rows, pos]),
                       ("v", heads[:, n + kv:], vc[rows, pos])):
        np.testing.assert_allclose(a, np.asarray(r, np.float32), rtol=2e-2, atol=2e-2, err_msg=name)


def test_refusals_name_the_problem():
    x8, w, r8 = jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((256, 256), jnp.bfloat16), jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match=r"x8 must be \[8, K\]"):
        t.gate_up_swiglu_tma(x8[:1], r8, w)
    with pytest.raises(ValueError, match=r"r8 must be float32 \[8\]"):
        t.gate_up_swiglu_tma(x8, r8[:1], w)
    with pytest.raises(ValueError, match="must be \\[2F, K=256\\]"):
        t.gate_up_swiglu_tma(x8, r8, w[:, :128])
    with pytest.raises(ValueError, match=r"the outputs \(96\) are not a multiple of block_f 64"):
        t.gate_up_swiglu_tma(x8, r8, w[:192])
    with pytest.raises(ValueError, match="16-bit dtype"):
        t.gate_up_swiglu_tma(x8.astype(jnp.float32), r8, w.astype(jnp.float32))
    for r, eps in ((r8, 1e-5), (None, None)):
        with pytest.raises(ValueError, match="exactly one of r8 .* and norm_eps"):
            t.gate_up_swiglu_tma(x8, r, w, norm_eps=eps)
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of 128 for the in-kernel statistic"):
        t.gate_up_swiglu_tma(x8, None, w, norm_eps=1e-5, blocks=t.TmaBlocks(block_k=64))
    # the plain x copies of the statistic (3 x 8 x 256 x 2 bytes) and Mosaic's reduction scratch
    # (reserved for a kernel that reduces) instead of r8's 32 bytes
    assert t.REDUCTION_SCRATCH == plgpu.CompilerParams().reduction_scratch_bytes
    assert t.smem_bytes(t.DEFAULT_BLOCKS, in_kernel_norm=True) == t.smem_bytes(t.DEFAULT_BLOCKS) + 12288 + 2048 - 32
    assert t.unsupported_reason(4096, 11008, in_kernel_norm=True) is None
    assert "shared memory" in t.unsupported_reason(4096, 11008, t.TmaBlocks(block_f=128, block_k=256, stages=4))
    assert "block_f=32" in t.unsupported_reason(4096, 11008, t.TmaBlocks(block_f=32))
    assert t.unsupported_reason(4096, 11008) is None and t.unsupported_reason(2048, 8192) is None
    # qkv_rope_tma: the rope row order's conditions, the weight and the tables named
    x8, cs = jnp.zeros((8, 256), jnp.bfloat16), t.rope_tables(jnp.zeros(8, jnp.int32), jnp.ones(48), 96)
    with pytest.raises(ValueError, match=r"head_dim 96 must be even and divide 2 \* block_f = 128"):
        t.qkv_rope_tma(x8, jnp.zeros((4 * 96, 256), jnp.bfloat16), cs, num_heads=2, num_kv_heads=1, head_dim=96,
                       norm_eps=1e-5)
    cs = t.rope_tables(jnp.zeros(8, jnp.int32), jnp.ones(32), 64)
    with pytest.raises(ValueError, match=r"wqkv_r \(256, 256\) must be \[\(N \+ 2K\) H = 512, D\]"):
        t.qkv_rope_tma(x8, jnp.zeros((256, 256), jnp.bfloat16), cs, num_heads=4, num_kv_heads=2, head_dim=64,
                       norm_eps=1e-5)
    with pytest.raises(ValueError, match=r"cs must be float32 \(2, 2, 64, 8\)"):
        t.qkv_rope_tma(x8, jnp.zeros((512, 256), jnp.bfloat16), cs[:1], num_heads=4, num_kv_heads=2, head_dim=64,
                       norm_eps=1e-5)
    with pytest.raises(ValueError, match="must be even and divide 2 \\* block_f = 128, which must divide the rows"):
        t.rope_row_order(100, 64)


def test_lowers_for_hopper(monkeypatch):
    from test_gpu_lowering import MOSAIC_CALL, lower_for_cuda, sds

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    args = sds((8, 1024)), sds((8,), jnp.float32), sds((512, 1024))
    for pdl in (False, True):  # pdl: the griddepcontrol instructions, and the kernel marked for a PDL launch
        text = lower_for_cuda(lambda x8, r8, w, pdl=pdl: t.gate_up_swiglu_tma(x8, r8, w, pdl=pdl), *args)
        assert text.count(MOSAIC_CALL) == 1
        assert ("griddepcontrol.wait" in text, "mosaic_gpu.uses_pdl" in text) == (pdl, pdl)
    # the residual tile read transposed into the accumulator's layout; f32 logits stored transposed
    assert lower_for_cuda(lambda a8, w, r8: t.matmul_residual_tma(a8, w, r8, pdl=True),
                          args[0], sds((256, 1024)), sds((8, 256))).count(MOSAIC_CALL) == 1
    assert lower_for_cuda(lambda x8, w: t.norm_matmul_tma(x8, w, eps=1e-5), args[0], sds((512, 1024))).count(MOSAIC_CALL) == 1
    for bk in (128, 256):  # the statistic's strided row loads and full reductions (vec_size = block_k / 128)
        fn = lambda x8, w, bk=bk: t.gate_up_swiglu_tma(x8, None, w, norm_eps=1e-5, blocks=t.TmaBlocks(block_k=bk))  # noqa: E731
        assert lower_for_cuda(fn, args[0], args[2]).count(MOSAIC_CALL) == 1


@pytest.mark.parametrize("h", [64, 128])
def test_qkv_rope_lowers_for_hopper(monkeypatch, h):
    """The two-half CTAs, the f32 tables read in the accumulators' layout, the two output halves
    stored transposed side by side: the 1b's (H = 64) and the 7b's (H = 128) heads."""
    from test_gpu_lowering import MOSAIC_CALL, lower_for_cuda, sds

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    n, kv, d = (32, 8, 2048) if h == 64 else (32, 32, 4096)
    fn = lambda x8, w, cs: t.qkv_rope_tma(x8, w, cs, num_heads=n, num_kv_heads=kv, head_dim=h, norm_eps=1e-5)  # noqa: E731
    text = lower_for_cuda(fn, sds((8, d)), sds(((n + 2 * kv) * h, d)), sds((2, 2, 64, 8), jnp.float32))
    assert text.count(MOSAIC_CALL) == 1


def test_projections_by_grid():
    """The CTA-count rule: the 1b's 2048-wide output and down projections stay on the Triton
    kernels (32 CTAs), the 7b's 4096-wide ones (64) and every head go to TMA."""
    import types

    one_b = types.SimpleNamespace(hidden_size=2048)
    seven_b = types.SimpleNamespace(hidden_size=4096)
    assert t.projections_by_grid(one_b, 32000) == ("gate_up", "head")
    assert t.projections_by_grid(seven_b, 32000) == ("gate_up", "out", "down", "head")
    assert t.projections_by_grid(seven_b, 32000, t.TmaBlocks(block_f=128)) == ("gate_up", "head")
