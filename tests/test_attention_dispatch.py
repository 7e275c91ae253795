"""`attention.impl=auto`: which core each call runs, per backend, device and shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import attention
from scaling.attention import AUTO_PALLAS_MAX_LEN, attention_core, resolve_impl
from scaling.config import AttentionImpl


@pytest.fixture
def recorded(monkeypatch):
    """Replace the cores by recorders of (impl, q length) that return the xla reference."""
    calls = []

    def recorder(impl):
        def core(q, k, v, *, causal=True, segment_ids=None):
            calls.append((impl, q.shape[1]))
            return attention.xla_attention(q, k, v, causal=causal, segment_ids=segment_ids)
        return core

    monkeypatch.setattr(attention, "ATTENTION_CORES", {i: recorder(i) for i in attention.ATTENTION_CORES})
    return calls


def place(monkeypatch, backend: str, hopper: bool):
    monkeypatch.setattr(attention.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(attention, "_is_hopper", lambda: hopper)


def qkv(t, s=None):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, t, 4, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, s or t, 2, 16)), jnp.float32)
    return q, kv, kv


def test_auto_resolves_per_backend_device_and_shape(monkeypatch):
    place(monkeypatch, "cpu", False)
    assert resolve_impl(AttentionImpl.auto, seq_len=128) == AttentionImpl.xla
    place(monkeypatch, "gpu", True)  # Hopper: ours up to the measured length, cuDNN beyond and with segment ids
    assert resolve_impl(AttentionImpl.auto, seq_len=AUTO_PALLAS_MAX_LEN) == AttentionImpl.pallas
    assert resolve_impl(AttentionImpl.auto, seq_len=AUTO_PALLAS_MAX_LEN + 1) == AttentionImpl.cudnn
    assert resolve_impl(AttentionImpl.auto, seq_len=1024, segmented=True) == AttentionImpl.cudnn
    assert resolve_impl(AttentionImpl.auto) == AttentionImpl.pallas
    place(monkeypatch, "gpu", False)  # other GPUs: cuDNN
    assert resolve_impl(AttentionImpl.auto, seq_len=1024) == AttentionImpl.cudnn
    for impl in (AttentionImpl.xla, AttentionImpl.cudnn, AttentionImpl.pallas):  # explicit choices stand
        assert resolve_impl(impl, seq_len=10**6) == impl


def test_auto_core_dispatches_each_call_by_its_length(monkeypatch, recorded):
    place(monkeypatch, "gpu", True)
    core = attention_core(AttentionImpl.auto)
    short, long = qkv(256), qkv(AUTO_PALLAS_MAX_LEN * 2)
    got = core(*short, causal=True)
    core(*long, causal=True)
    seg = jnp.zeros((1, 256), jnp.int32)
    core(*short, causal=True, segment_ids=seg)
    assert recorded == [(AttentionImpl.pallas, 256), (AttentionImpl.cudnn, AUTO_PALLAS_MAX_LEN * 2),
                        (AttentionImpl.cudnn, 256)]
    np.testing.assert_allclose(got, attention.xla_attention(*short, causal=True), rtol=1e-6)
    place(monkeypatch, "cpu", False)
    core(*short, causal=True)
    assert recorded[-1] == (AttentionImpl.xla, 256)
    assert attention_core(AttentionImpl.cudnn) is attention.ATTENTION_CORES[AttentionImpl.cudnn]
