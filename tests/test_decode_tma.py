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


@pytest.mark.parametrize("b, d, f, blocks", [
    (1, 256, 128, t.TmaBlocks(block_f=64, block_k=64, stages=2)),  # the ring wraps twice; two CTAs
    (3, 512, 192, t.TmaBlocks(block_f=64, block_k=128, stages=3)),  # 3 rows; steps not a multiple of stages
])
def test_gate_up_swiglu_matches_reference_interpret(b, d, f, blocks, capfd):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((b, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2 * f, d)) * 0.05, jnp.bfloat16)
    # padding rows hold anything, even NaN: the rows of the product are independent
    x8 = jnp.concatenate([x, jnp.full((8 - b, d), jnp.nan, jnp.bfloat16)])
    capfd.readouterr()
    got = np.asarray(t.gate_up_swiglu_tma(x8, t.row_rsqrt(x8, 1e-5), w, blocks=blocks,
                                          interpret=plgpu.InterpretGPUParams(detect_races=True)), np.float32)
    assert not (races := non_tma_races(capfd.readouterr().out)), races  # mosaic_helpers says which are left out
    assert got.shape == (8, f)
    want = np.asarray(g.gate_up_swiglu_reference(x, w, eps=1e-5), np.float32)
    np.testing.assert_allclose(got[:b], want, rtol=2e-2, atol=2e-2)  # both rounded to bf16 once


def test_refusals_name_the_problem():
    x8, w, r8 = jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((256, 256), jnp.bfloat16), jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match=r"x8 must be \[8, D\]"):
        t.gate_up_swiglu_tma(x8[:1], r8, w)
    with pytest.raises(ValueError, match=r"r8 must be float32 \[8\]"):
        t.gate_up_swiglu_tma(x8, r8[:1], w)
    with pytest.raises(ValueError, match="must be \\[2F, D=256\\]"):
        t.gate_up_swiglu_tma(x8, r8, w[:, :128])
    with pytest.raises(ValueError, match="mlp_dim 96 is not a multiple of block_f 64"):
        t.gate_up_swiglu_tma(x8, r8, w[:192])
    with pytest.raises(ValueError, match="16-bit dtype"):
        t.gate_up_swiglu_tma(x8.astype(jnp.float32), r8, w.astype(jnp.float32))
    assert "shared memory" in t.unsupported_reason(4096, 11008, t.TmaBlocks(block_f=128, block_k=256, stages=4))
    assert "block_f=32" in t.unsupported_reason(4096, 11008, t.TmaBlocks(block_f=32))
    assert t.unsupported_reason(4096, 11008) is None and t.unsupported_reason(2048, 8192) is None


def test_lowers_for_hopper(monkeypatch):
    from test_gpu_lowering import MOSAIC_CALL, lower_for_cuda, sds

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    args = sds((8, 1024)), sds((8,), jnp.float32), sds((512, 1024))
    for pdl in (False, True):  # pdl: the griddepcontrol instructions, and the kernel marked for a PDL launch
        text = lower_for_cuda(lambda x8, r8, w, pdl=pdl: t.gate_up_swiglu_tma(x8, r8, w, pdl=pdl), *args)
        assert text.count(MOSAIC_CALL) == 1
        assert ("griddepcontrol.wait" in text, "mosaic_gpu.uses_pdl" in text) == (pdl, pdl)
