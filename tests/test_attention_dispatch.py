"""`attention.impl=auto`: which core each call runs, per backend, device and shape."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import attention
from scaling.attention import AUTO_PALLAS_MAX_LEN, attention_core, resolve_impl
from scaling.config import AttentionImpl


@pytest.fixture
def recorded(monkeypatch):
    """Replace the cores by recorders of (impl, q length) that return the xla reference (zeros for
    long rows)."""
    calls = []

    def recorder(impl):
        def core(q, k, v, *, causal=True, segment_ids=None):
            calls.append((impl, q.shape[1]))
            if q.shape[1] > 1024:  # long rows only test the choice: skip the [T, T] reference on the CPU
                return jnp.zeros_like(q)
            return attention.xla_attention(q, k, v, causal=causal, segment_ids=segment_ids)
        return core

    monkeypatch.setattr(attention, "ATTENTION_CORES", {i: recorder(i) for i in attention.ATTENTION_CORES})
    return calls


def place(monkeypatch, backend: str, hopper: bool):
    monkeypatch.setattr(attention.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(importlib.import_module("scaling.kernels.flash_attention"), "is_hopper", lambda: hopper)


def qkv(t, s=None, d=128):  # bf16: a call cuDNN can take (auto leaves f32 to xla)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, t, 4, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, s or t, 2, d)), jnp.bfloat16)
    return q, kv, kv


def test_auto_resolves_per_backend_device_and_shape(monkeypatch):
    place(monkeypatch, "cpu", False)
    assert resolve_impl(AttentionImpl.auto, seq_len=128) == AttentionImpl.xla
    place(monkeypatch, "gpu", True)  # Hopper: ours up to the measured length, cuDNN beyond and with segment ids
    assert AUTO_PALLAS_MAX_LEN == {64: 8192, 128: 8192}
    for d, limit in AUTO_PALLAS_MAX_LEN.items():
        assert resolve_impl(AttentionImpl.auto, seq_len=limit, head_dim=d) == AttentionImpl.pallas
        assert resolve_impl(AttentionImpl.auto, seq_len=limit + 1, head_dim=d) == AttentionImpl.cudnn
    assert resolve_impl(AttentionImpl.auto, seq_len=6144, head_dim=64) == AttentionImpl.pallas
    strictest = min(AUTO_PALLAS_MAX_LEN.values())  # head dim unknown: the strictest limit
    assert resolve_impl(AttentionImpl.auto, seq_len=strictest + 1) == AttentionImpl.cudnn
    for d in (32, 96, 256):  # head dims without the Mosaic backward: cuDNN at any length
        assert resolve_impl(AttentionImpl.auto, seq_len=1024, head_dim=d) == AttentionImpl.cudnn
    assert resolve_impl(AttentionImpl.auto, seq_len=1024, segmented=True, head_dim=64) == AttentionImpl.cudnn
    assert resolve_impl(AttentionImpl.auto) == AttentionImpl.pallas
    place(monkeypatch, "gpu", False)  # other GPUs: cuDNN
    assert resolve_impl(AttentionImpl.auto, seq_len=1024) == AttentionImpl.cudnn
    for impl in (AttentionImpl.xla, AttentionImpl.cudnn, AttentionImpl.pallas):  # explicit choices stand
        assert resolve_impl(impl, seq_len=10**6) == impl


def test_auto_core_dispatches_each_call_by_its_length(monkeypatch, recorded):
    place(monkeypatch, "gpu", True)
    core = attention_core(AttentionImpl.auto)
    limit = AUTO_PALLAS_MAX_LEN[128]
    short, long = qkv(256), qkv(limit * 2)
    got = core(*short, causal=True)
    core(*long, causal=True)
    seg = jnp.zeros((1, 256), jnp.int32)
    core(*short, causal=True, segment_ids=seg)
    core(*qkv(AUTO_PALLAS_MAX_LEN[64], d=64), causal=True)  # the head dim is read off q
    core(*qkv(256, d=32), causal=True)  # no Mosaic backward at D=32: cuDNN however short
    assert recorded == [(AttentionImpl.pallas, 256), (AttentionImpl.cudnn, limit * 2), (AttentionImpl.cudnn, 256),
                        (AttentionImpl.pallas, AUTO_PALLAS_MAX_LEN[64]), (AttentionImpl.cudnn, 256)]
    np.testing.assert_allclose(got, attention.xla_attention(*short, causal=True), rtol=1e-6)
    place(monkeypatch, "cpu", False)
    core(*short, causal=True)
    assert recorded[-1] == (AttentionImpl.xla, 256)
    assert attention_core(AttentionImpl.cudnn) is attention.ATTENTION_CORES[AttentionImpl.cudnn]


def _mesh_222(devices):
    from scaling.config import MeshConfig
    from scaling.sharding import make_mesh

    return make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices=devices)


def _sharded_inputs(b=8, t=64, n=4, kh=2, h=16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
    seg = jnp.asarray(np.repeat(np.arange(2), t // 2)[None].repeat(b, 0), jnp.int32)
    return q, k, v, seg


def test_pallas_core_runs_per_device_under_a_mesh(monkeypatch, devices):
    """Under use_sharding the kernel sees each device's rows and heads (batch over data x fsdp,
    heads over tensor), never the gathered arrays, and the result is the unsharded one."""
    import scaling.kernels
    from scaling.sharding import use_sharding

    seen = []

    def recording_kernel(q, k, v, *, causal, segment_ids, backend):
        seen.append((q.shape, k.shape, None if segment_ids is None else segment_ids.shape))
        return attention.xla_attention(q, k, v, causal=causal, segment_ids=segment_ids)

    monkeypatch.setattr(scaling.kernels, "flash_attention", recording_kernel)
    q, k, v, seg = _sharded_inputs()
    mesh = _mesh_222(devices)
    with use_sharding(mesh, "default"):
        for segment_ids in (None, seg):
            out = jax.jit(lambda q, k, v, s: attention.pallas_attention(q, k, v, causal=True, segment_ids=s))(
                q, k, v, segment_ids)
            np.testing.assert_allclose(np.asarray(out), np.asarray(attention.xla_attention(q, k, v, segment_ids=segment_ids)),
                                       rtol=1e-5, atol=1e-5)
    assert seen == [((2, 64, 2, 16), (2, 64, 1, 16), None), ((2, 64, 2, 16), (2, 64, 1, 16), (2, 64))]


def test_pallas_core_under_a_mesh_runs_the_kernel(devices):
    """The real kernel (interpret mode) inside the shard_map: output and gradients equal the
    unsharded reference's."""
    from scaling.sharding import use_sharding

    q, k, v, _ = _sharded_inputs(b=4, t=32)
    mesh = _mesh_222(devices)

    def loss(core, q, k, v):
        return jnp.sum(core(q, k, v, causal=True, segment_ids=None) ** 2)

    with use_sharding(mesh, "default"):
        got = jax.jit(jax.value_and_grad(functools.partial(loss, attention.pallas_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(functools.partial(loss, attention.xla_attention), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)
