"""The Pallas delta kernel (rowsum(dO ∘ O), [B, H, T]) in interpret mode against float64 NumPy."""

import numpy as np
import pytest

import jax.numpy as jnp

from scaling.kernels import row_dot
from scaling.kernels.flash_attention_mgpu_bwd import MosaicBwdConfig, validate_config


@pytest.mark.parametrize("shape, dtype, tol", [((2, 48, 12, 64), jnp.bfloat16, 1e-5),  # 16-row tiles
                                               ((1, 384, 3, 128), jnp.float16, 1e-5),  # 128-row tiles
                                               ((1, 96, 5, 32), jnp.float32, 1e-5)])  # 32-row tiles
def test_row_dot_matches_float64(shape, dtype, tol):
    rng = np.random.default_rng()
    o = jnp.asarray(rng.standard_normal(shape), dtype)
    do = jnp.asarray(rng.standard_normal(shape), dtype)
    got = np.asarray(row_dot.output_row_dot_pallas(o, do, interpret=True))
    ref = np.einsum("bthd,bthd->bht", np.asarray(o, np.float64), np.asarray(do, np.float64))
    assert got.shape == ref.shape and got.dtype == np.float32
    # f32 sums of D products of unit normals: error relative to the sum's scale, sqrt(D)
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.sqrt(shape[-1]) * 4)


def test_row_dot_refuses_what_it_cannot_tile():
    x = jnp.zeros((1, 24, 4, 64), jnp.bfloat16)
    assert not row_dot.supported(x.shape) and row_dot.supported((1, 32, 4, 64))
    with pytest.raises(ValueError, match="T % 16"):
        row_dot.output_row_dot_pallas(x, x, interpret=True)
    with pytest.raises(ValueError, match="same"):
        row_dot.output_row_dot_pallas(x, x[:, :16], interpret=True)
    with pytest.raises(ValueError, match="choose one"):
        validate_config(MosaicBwdConfig(delta_in_dq=True, delta_kernel=True))
    with pytest.raises(ValueError, match="set dq_from_ds"):
        validate_config(MosaicBwdConfig(ds_dq_head_major=True))
