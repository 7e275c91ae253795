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
    # one phase may be narrower than its input (the separate launches of a model's down projection)
    assert lower(lambda x, w: ws.stream_phases(x, w), sds((8, 512)), sds((1, 256, 512))).count(MOSAIC_CALL) == 1


def test_refusals():
    with pytest.raises(ValueError, match="N=256 >= K"):  # phases chain only if each output is as wide as x
        ws.stream_phases(jnp.zeros((8, 512), jnp.bfloat16), jnp.zeros((2, 256, 512), jnp.bfloat16))
    with pytest.raises(ValueError, match="block_k=256"):
        ws.stream_phases(jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((1, 256, 128), jnp.bfloat16))


def test_layer_chain_kernel_lowers_for_hopper():
    """The layer-looped chain (phases of different N and K, CTAs looping over tiles, phases with
    fewer tiles than CTAs) lowers as one kernel, and refuses a chain whose K outgrows x."""
    layers, d, f, nq, v = 2, 256, 512, 384, 640
    args = [sds((8, d)), sds((layers, nq, d)), sds((layers, d, d)), sds((layers, 2 * f, d)), sds((layers, d, f)),
            sds((v, d))]
    text = lower(lambda x, *w: ws.stream_layers(x, *w, ctas=4)[-1], *args)
    assert text.count(MOSAIC_CALL) == 1
    text = lower(lambda x, *w: ws.stream_layers(x, *w, ctas=4, barrier=False)[-1], *args)
    assert text.count(MOSAIC_CALL) == 1
    z = jnp.zeros
    with pytest.raises(ValueError, match="down"):
        ws.stream_layers(z((8, d), jnp.bfloat16), z((1, nq, d), jnp.bfloat16), z((1, d, d), jnp.bfloat16),
                         z((1, 2 * d, d), jnp.bfloat16), z((1, d, 4 * d), jnp.bfloat16), z((v, d), jnp.bfloat16),
                         ctas=2)


def test_model_chain_shapes_follow_the_preset():
    from bench_decode import preset

    shapes = ws.model_chain_shapes("1b")
    m = preset("1b")
    assert shapes["head"] == (m.vocab_size, m.hidden_size)
    assert shapes["gate_up"] == (m.num_layers, 2 * m.mlp_dim, m.hidden_size)
    assert shapes["down"] == (m.num_layers, m.hidden_size, m.mlp_dim)
    assert shapes["qkv"] == (m.num_layers, (m.num_heads + 2 * m.num_kv_heads) * m.resolved_head_dim, m.hidden_size)
    # the 1b's chain fits in shared memory with all of x (K up to the MLP width) and 3 ring slots
    assert ws.chain_smem_bytes(m.mlp_dim, 256, 3) <= ws.SMEM_BYTES


def _rel(a, b):
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_one_phase_matches_xla_in_interpret_mode():
    """The tile product and store (shared by both kernels), run by Pallas' GPU interpreter on the
    CPU: one phase against XLA's product of the same bf16 inputs."""
    keys = jax.random.split(jax.random.key(1), 2)
    n, k = 192, 512
    w = (jax.random.normal(keys[0], (1, n, k)) / k**0.5).astype(jnp.bfloat16)
    x = jax.random.normal(keys[1], (8, k)).astype(jnp.bfloat16)
    got = ws.stream_phases(x, w, stages=2, interpret=True)[0]
    assert _rel(got, ws.reference_first_phase(x, w[0])) < 1e-2


def test_layer_chain_with_one_cta_matches_xla_in_interpret_mode():
    """stream_layers' loops (layers, phases, each CTA's tiles, the ring's global step count, the x
    sources), run by the interpreter with one CTA (which then computes every tile in order, so no
    barrier is needed) against the same chain in XLA, bf16 between phases as the kernel stores."""
    layers, d, f, nq, v = 2, 128, 256, 192, 320
    shapes = [(layers, nq, d), (layers, d, d), (layers, 2 * f, d), (layers, d, f), (v, d)]
    keys = jax.random.split(jax.random.key(2), len(shapes) + 1)
    wq, wo, wgu, wd, wh = [(jax.random.normal(key, s) / s[-1] ** 0.5).astype(jnp.bfloat16)
                           for key, s in zip(keys[1:], shapes)]
    x = jnp.zeros((8, d), jnp.bfloat16).at[0].set(jax.random.normal(keys[0], (d,)).astype(jnp.bfloat16))
    got = ws.stream_layers(x, wq, wo, wgu, wd, wh, ctas=1, block_k=128, stages=2, barrier=False, interpret=True)

    def mm(x, w):
        return ws.reference_first_phase(x, w)

    h, want = x, {"qkv": [], "out": [], "gate_up": [], "down": []}
    for l in range(layers):
        for name, w in zip(("qkv", "out", "gate_up", "down"), (wq, wo, wgu, wd)):
            h = mm(h, w[l])
            want[name].append(h)
    for i, name in enumerate(("qkv", "out", "gate_up", "down")):
        assert _rel(got[i], jnp.stack(want[name])) < 2e-2, name
    assert _rel(got[4], mm(h, wh)) < 2e-2
    with pytest.raises(ValueError, match="interpret mode has no global semaphores"):
        ws.stream_layers(x, wq, wo, wgu, wd, wh, ctas=1, interpret=True)


def test_repeated_chains_runs_and_refuses_zero():
    """`repeated` leaves x unchanged in value (its dependency is zero-weighted) but does run fn: a
    NaN output reaches x, which a skipped or merged call would not do."""
    x = jnp.arange(8, dtype=jnp.float32)
    assert jnp.array_equal(ws.repeated(lambda x, w: x * w, 3)(x, jnp.float32(2)), x)
    assert jnp.isnan(ws.repeated(lambda x, w: x * w, 2)(x, jnp.float32(jnp.nan))).all()
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        ws.repeated(lambda x: x, 0)


def test_repeated_keeps_all_of_an_xla_output():
    """The dependency covers the whole output: a NaN in its last element still reaches x (one
    element would let XLA compute only that part of an XLA-only chain)."""
    x = jnp.zeros(4, jnp.float32)
    f = ws.repeated(lambda x, w: jnp.concatenate([x, w]), 2)
    assert jnp.isnan(f(x, jnp.array([0.0, jnp.nan]))).all()
