"""scaling.kernels.row_dot (the backward's delta = rowsum(dO ∘ O)) in interpret mode against a
float64 NumPy reference; its Hopper lowering is in test_gpu_lowering.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from scaling.kernels import row_dot


@pytest.mark.parametrize("shape,dtype,blocks", [
    ((2, 48, 4, 64), jnp.bfloat16, (16, 4)),
    ((1, 32, 8, 128), jnp.float16, (8, 8)),
    ((3, 16, 2, 32), jnp.float32, (16, 8)),  # block_h narrowed to H
])
def test_matches_float64(shape, dtype, blocks):
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    o = jnp.asarray(rng.normal(size=shape), dtype)
    do = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    got = row_dot.output_row_dot(o, do, block_t=blocks[0], block_h=blocks[1])
    want = np.einsum("bthd,bthd->bht", np.asarray(o, np.float64), np.asarray(do, np.float64))
    assert got.shape == (shape[0], shape[2], shape[1]) and got.dtype == jnp.float32
    # inputs are exact in f64; only the f32 sum of D products rounds
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4 * np.sqrt(shape[3]), err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(got), np.asarray(row_dot.reference(o, do)), rtol=1e-5, atol=1e-4)


def test_rejects_what_it_cannot_tile():
    o = jnp.zeros((1, 24, 4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="T=24 and H=4 must be multiples of block_t=16"):
        row_dot.output_row_dot(o, o)
    with pytest.raises(ValueError, match="head_dim=48 must be a power of two"):
        row_dot.output_row_dot(jnp.zeros((1, 16, 4, 48)), jnp.zeros((1, 16, 4, 48)))
    with pytest.raises(ValueError, match="o and do must match"):
        row_dot.output_row_dot(o, o.astype(jnp.float32))
    assert row_dot.unsupported_reason((1, 4096, 32, 128)) is None
