"""experiments/bench_grid_barrier.py on the CPU: the phase sums with and without the barrier and
the prefetch (one program: a barrier of one only arrives), and the refusal of a multi-program
barrier in interpret mode. tests/test_gpu_lowering.py lowers the spinning GPU version."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_grid_barrier as gb  # noqa: E402


def test_phase_sums_match_jnp_in_every_mode():
    w = jax.random.normal(jax.random.key(0), (3, 1, 4096), jnp.bfloat16)
    expect = np.asarray(jnp.sum(w.astype(jnp.float32), axis=-1))
    for barrier, prefetch in ((False, False), (True, False), (True, True)):
        got = np.asarray(gb.run_phases(w, block=1024, barrier=barrier, prefetch=prefetch))
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(gb.run_kernels(w, block=1024)), expect, rtol=1e-5, atol=1e-3)
    # a later phase alone: reads its own slice of w
    np.testing.assert_allclose(np.asarray(gb.run_phases(w, block=1024, barrier=False, prefetch=False, first_phase=2,
                                                        phases=1)), expect[2:], rtol=1e-5, atol=1e-3)


def test_multi_program_barrier_is_refused_in_interpret_mode():
    with pytest.raises(ValueError, match="cannot run in interpret mode"):
        gb.run_phases(jnp.zeros((2, 4, 1024), jnp.bfloat16), block=1024, barrier=True, prefetch=False)


def test_several_rows_per_program_sum_per_program():
    """rows=3: each program's sum covers its own three rows (and only those)."""
    w = jax.random.normal(jax.random.key(1), (2, 3, 2048), jnp.bfloat16)  # one program x 3 rows
    expect = np.asarray(jnp.sum(w.astype(jnp.float32), axis=(1, 2)))[:, None]
    for barrier, prefetch in ((False, False), (True, True)):
        got = np.asarray(gb.run_phases(w, block=512, barrier=barrier, prefetch=prefetch, rows=3))
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-2)
    w2 = jax.random.normal(jax.random.key(2), (2, 4, 1024), jnp.bfloat16)  # two programs x 2 rows, no barrier
    expect2 = np.asarray(jnp.sum(w2.astype(jnp.float32).reshape(2, 2, 2048), axis=-1))
    np.testing.assert_allclose(np.asarray(gb.run_kernels(w2, block=512, rows=2)), expect2, rtol=1e-5, atol=1e-2)
    with pytest.raises(ValueError, match="not a multiple of rows=3"):
        gb.run_phases(w2, block=512, barrier=False, prefetch=False, rows=3)
