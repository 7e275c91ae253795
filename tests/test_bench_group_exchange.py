"""experiments/bench_group_exchange.py on the CPU: each mode's kernel lowers for Hopper (clusters,
peer shared memory and global semaphores have no interpret mode), the known sums, and the
refusals."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import export

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_group_exchange as bx  # noqa: E402


def test_expected_sum_counts_every_round_and_member():
    for rounds in (2, 6, 800):
        brute = sum((i + 1) * (m + 1) for i in range(rounds) for m in range(bx.MEMBERS))
        assert bx.expected_sum(rounds) == brute
    assert bx.expected_sum(800) < 2**24  # (exact in f32: the check compares for equality)


@pytest.mark.parametrize("mode", bx.MODES)
def test_every_mode_lowers_for_hopper(mode):
    fn = bx.exchange(mode, 4, clusters=2, floats=512, pad_kib=16)
    text = export.export(fn, platforms=["cuda"])(jax.ShapeDtypeStruct((8,), jnp.float32)).mlir_module()
    assert "mosaic_gpu" in text


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="mode must be one of"):
        bx.exchange("dsmem", 4)
    with pytest.raises(ValueError, match="rounds must be even"):
        bx.exchange("cluster", 3)
    with pytest.raises(ValueError, match="floats must be a multiple of 256"):
        bx.exchange("group", 4, floats=300)
