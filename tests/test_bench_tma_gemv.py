"""experiments/bench_tma_gemv.py (the TMA-fed Mosaic GPU GEMV experiment): its products in
Pallas' GPU interpret mode against float64, the tile candidates and their errors, and its
lowering for Hopper (the wgmma path interpret mode replaces by a dot)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_tma_gemv as g  # noqa: E402


@pytest.mark.parametrize("n, k, b, cfg", [
    (128, 256, 1, g.TmaGemvConfig(block_n=128, block_k=64, stages=2, splits=2)),  # K split over two CTAs
    (256, 512, 3, g.TmaGemvConfig(block_n=64, block_k=128, stages=3, splits=1)),  # ring wraps; 4 output blocks
])
def test_products_match_float64_interpret(n, k, b, cfg):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((b, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
    got = np.asarray(g.tma_gemv(x, w, cfg, interpret=True))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.shape == (b, n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_candidates_fill_the_grid_and_bad_shapes_are_refused():
    for n, k in ((3072, 2048), (2048, 8192), (22016, 4096), (4096, 11008)):
        for cfg in g.candidates(n, k):
            assert g.check_config(n, k, cfg) is None
            assert n // cfg.block_n * cfg.splits >= 132 or cfg.splits == k // cfg.block_k
    with pytest.raises(ValueError, match="not a multiple of block_n"):
        g.tma_gemv(jnp.zeros((1, 256), jnp.bfloat16), jnp.zeros((100, 256), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="batch 9 > 8"):
        g.tma_gemv(jnp.zeros((9, 256), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16), interpret=True)


def test_lowers_for_hopper(monkeypatch):
    from test_gpu_lowering import MOSAIC_CALL, lower_for_cuda, sds

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = g.TmaGemvConfig(block_n=128, block_k=128, stages=4, splits=2)
    text = lower_for_cuda(lambda x, w: g.tma_gemv(x, w, cfg), sds((1, 1024)), sds((256, 1024)))
    assert text.count(MOSAIC_CALL) == 1


@pytest.mark.parametrize("name", ["out", "head"])
def test_decoder_kernel_rows_check_against_jnp_interpret(monkeypatch, name):
    """decoder_kernel_row: the decoder's own TMA kernel for a projection, checked against jnp (its
    timing, a GPU profile, is stubbed here)."""
    monkeypatch.setattr(g, "profile", lambda fn, args, reps, copies: (0.0, "kernel", 1.0))
    ws = [jax.random.normal(jax.random.key(i), (128, 256), jnp.bfloat16) * 0.05 for i in range(2)]
    x = jax.random.normal(jax.random.key(9), (1, 256), jnp.bfloat16)
    row = {}
    g.decoder_kernel_row(row, name, x, ws, type("Args", (), {"reps": 1})())
    assert row["tma_decode_tma_us"] == 1.0 and row["tma_decode_tma_err"] < 2e-2, row
