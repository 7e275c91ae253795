"""The test run's own shortcuts through jax change nothing they touch (see conftest.py)."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import _fast_io_callback as fast_io
import _memo_mosaic_transfers as memo_mosaic
from scaling.kernels import decode_tma as t


def test_memoized_layout_inference_lowers_the_same_module(monkeypatch):
    """A Mosaic GPU kernel (the 1b's q/k/v + RoPE by TMA) exported for Hopper with Mosaic GPU's
    own transfer check and with the memoized one: the same module, and the memo was asked."""
    if memo_mosaic._ORIGINAL is None:
        pytest.skip("the memo is not installed (another jax, or SCALING_TESTS_PLAIN_MOSAIC=1)")
    from test_gpu_lowering import MOSAIC_CALL, lower_for_cuda, sds

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    n, kv, d, h = 32, 8, 2048, 64

    def lower():
        fn = lambda x8, w, cs: t.qkv_rope_tma(x8, w, cs, num_heads=n, num_kv_heads=kv, head_dim=h,  # noqa: E731
                                              norm_eps=1e-5)
        return lower_for_cuda(fn, sds((8, d)), sds(((n + 2 * kv) * h, d)), sds((2, 2, 64, 8), jnp.float32))

    memo_mosaic.MEMO.clear()
    texts, memo_sizes = [], []
    for mode in (memo_mosaic.plain, contextlib.nullcontext):
        with mode():
            texts.append(lower())  # (one line: the caller's location is in the module)
        memo_sizes.append(len(memo_mosaic.MEMO))
    assert memo_sizes[0] == 0 < memo_sizes[1]  # plain() bypassed the memo; then it answered
    assert texts[0].count(MOSAIC_CALL) == 1

    # Two lowerings in one process name the kernel anonymous_0, anonymous_1 (and so hash it apart)
    def same_names(text):
        return re.sub(r'kernel_hash = "[^"]*"', "kernel_hash", re.sub(r"anonymous_\d+", "anonymous", text))

    assert same_names(texts[0]) == same_names(texts[1])


def test_interpreter_callbacks_on_numpy_compute_the_same_kernel():
    """A Mosaic GPU kernel in interpret mode (the TMA gate/up + SwiGLU: two CTAs, a ring of TMA
    copies, barriers, wgmma, race detection on) run with jax's own io_callback and with the
    interpreter's callbacks handed numpy copies: the same bits out, and the numpy path was taken."""
    if fast_io._ORIGINAL is None:
        pytest.skip("the fast io_callback is not installed (another jax, or SCALING_TESTS_PLAIN_IO_CALLBACK=1)")
    rng = np.random.default_rng(0)
    x8 = jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 512)) * 0.05, jnp.bfloat16)
    blocks = t.TmaBlocks(block_f=64, block_k=128, stages=2)

    def run():
        return np.asarray(t.gate_up_swiglu_tma(x8, None, w, blocks=blocks, norm_eps=1e-5,
                                               interpret=plgpu.InterpretGPUParams(detect_races=True)))

    before = fast_io.NUMPY_CALLS[0]
    with fast_io.plain():
        want = run()
    assert fast_io.NUMPY_CALLS[0] == before  # plain() bypassed it
    got = run()
    assert fast_io.NUMPY_CALLS[0] > before + 50  # every load, store, copy and barrier of the kernel
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)
