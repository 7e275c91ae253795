"""experiments/bench_weight_stream.py: its persistent kernel (global semaphores between phases,
which interpret mode cannot run) lowers for sm_90 on the CPU, as one Mosaic GPU kernel for all
phases, and its launcher refuses shapes it cannot run."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import export

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_weight_stream as ws  # noqa: E402

MOSAIC_CALL = "mosaic_gpu_v2"


def sds(shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def lower(fn, *args) -> str:
    return export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


def test_persistent_and_separate_chains_lower_for_hopper():
    phases, n, k = 3, 512, 256
    text = lower(ws.chain_persistent, sds((8, k)), sds((phases, n, k)))
    assert text.count(MOSAIC_CALL) == 1
    assert lower(lambda x, w: ws.chain_persistent(x, w, barrier=False), sds((8, k)),
                 sds((phases, n, k))).count(MOSAIC_CALL) == 1
    text = lower(lambda x, *w: ws.chain_separate(x, w), sds((8, k)), *[sds((1, n, k))] * phases)
    # one launch per phase (the phases after the first share one function: x is [8, N] there)
    assert text.count("call @stream_phases") == phases


def test_refusals():
    with pytest.raises(ValueError, match="N=256 >= K"):
        ws.stream_phases(jnp.zeros((8, 512), jnp.bfloat16), jnp.zeros((1, 256, 512), jnp.bfloat16))
    with pytest.raises(ValueError, match="block_k=256"):
        ws.stream_phases(jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((1, 256, 128), jnp.bfloat16))


def test_model_chain_kernel_lowers_for_hopper():
    """The heterogeneous chain (phases of different N and K, CTAs looping over tiles, phases
    with fewer tiles than CTAs) lowers as one kernel; one launch per phase as one kernel each."""
    shapes = [(384, 256), (256, 256), (1024, 256), (256, 512), (640, 256)]
    ws_ = [sds(s) for s in shapes]
    text = lower(lambda x, *w: ws.stream_chain(x, w, ctas=4)[-1], sds((8, 256)), *ws_)
    assert text.count(MOSAIC_CALL) == 1
    with pytest.raises(ValueError, match="phase 1"):
        ws.stream_chain(jnp.zeros((8, 256), jnp.bfloat16), [jnp.zeros((64, 256), jnp.bfloat16),
                                                             jnp.zeros((64, 128), jnp.bfloat16)], ctas=2)


def test_model_chain_shapes_follow_the_preset():
    shapes = ws.model_chain_shapes("1b")
    from bench_decode import preset

    m = preset("1b")
    assert len(shapes) == 4 * m.num_layers + 1 and shapes[-1] == (m.vocab_size, m.hidden_size)
    assert shapes[2] == (2 * m.mlp_dim, m.hidden_size) and shapes[3] == (m.hidden_size, m.mlp_dim)
    assert shapes[0][0] == (m.num_heads + 2 * m.num_kv_heads) * m.resolved_head_dim
