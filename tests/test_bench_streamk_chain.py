"""experiments/bench_streamk_chain.py: the stream-K GEMV chain lowers for sm_90 as one Mosaic GPU
kernel in every sync mode, Pallas' GPU interpreter runs it with one CTA (row-major and
unit-major weights) against the chain in XLA, and its schedule arithmetic (which CTA owns a
unit, how many CTAs add to an output chunk) agrees with a brute-force count."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_streamk_chain as sk  # noqa: E402

MOSAIC_CALL = "mosaic_gpu_v2"
NAMES = ("qkv", "out", "gate_up", "down", "head")


def _weights(layers=2, d=128, f=256, nq=192, v=320, seed=2):
    shapes = [(layers, nq, d), (layers, d, d), (layers, 2 * f, d), (layers, d, f), (v, d)]
    keys = jax.random.split(jax.random.key(seed), len(shapes) + 1)
    ws = [(jax.random.normal(k, s) / s[-1] ** 0.5).astype(jnp.bfloat16) for k, s in zip(keys[1:], shapes)]
    return jax.random.normal(keys[0], (d,)), ws


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_lowers_for_hopper_in_every_sync_mode():
    layers, d, f, nq, v = 2, 256, 512, 512, 768
    sds = jax.ShapeDtypeStruct
    args = [sds((d,), jnp.float32), *(sds(s, jnp.bfloat16) for s in
                                       [(layers, nq, d), (layers, d, d), (layers, 2 * f, d), (layers, d, f), (v, d)])]
    units = dict(zip(NAMES, (a.shape for a in args[1:])))
    unit_args = [args[0], *(sds(sk.unit_major(jnp.zeros(a.shape, jnp.bfloat16), 256).shape, jnp.bfloat16)
                            for a in args[1:])]
    for kw in (dict(barrier=True), dict(barrier=True, lazy_x=True), dict(barrier=True, lazy_x=True, x_loads="ld"),
               dict(barrier=True, lazy_x=True, prefetch=4), dict(barrier=True, shapes="units", prefetch=9),
               dict(barrier="chunks"), dict(barrier=False), dict(stream_only=True)):
        a = args
        if kw.get("shapes") == "units":  # unit-major weights, prefetching across phase ends
            kw, a = dict(kw, shapes=units), unit_args
        fn = jax.jit(lambda x, *w, kw=kw: sk.stream_k_chain(x, *w, ctas=4, **kw))
        assert export.export(fn, platforms=["cuda"])(*a).mlir_module().count(MOSAIC_CALL) == 1, kw
    fn = jax.jit(lambda x, w: sk.stream_k_phase(x, w, ctas=4, lazy_x=True))  # one phase, its own kernel
    assert export.export(fn, platforms=["cuda"])(args[0], sds((d, d), jnp.bfloat16)).mlir_module().count(MOSAIC_CALL) == 1


@pytest.mark.parametrize("layout,lazy_x,x_loads", [("rows", False, "tma"), ("units", False, "tma"),
                                                   ("rows", True, "tma"), ("units", True, "ld")])
def test_one_cta_chain_matches_xla_in_interpret_mode(layout, lazy_x, x_loads):
    """With one CTA every phase's units run in order (no barrier needed): the flat output (every
    phase of every layer, then the logits) against the same chain in XLA, f32 throughout."""
    x, ws = _weights()
    want = sk.reference_chain(x, *ws)
    kw = dict(ctas=1, block_k=128, stages=2, barrier=False, lazy_x=lazy_x, x_loads=x_loads, interpret=True)
    if layout == "units":
        kw["shapes"] = dict(zip(NAMES, (w.shape for w in ws)))
        ws = [sk.unit_major(w, 128) for w in ws]
    got = sk.stream_k_chain(x, *ws, **kw)
    assert got.shape[0] % sk.ZERO == 0 and got.shape[0] >= want.shape[0]
    assert _rel(got[: want.shape[0]], want) < 1e-5
    assert not np.any(np.asarray(got[want.shape[0]:]))  # the padding stays zero


def test_one_launch_per_phase_matches_xla_in_interpret_mode():
    """stream_k_phase (one phase per kernel), chained over the layers by chain_by_phase, against
    the chain in XLA: the logits, and one phase alone from row-major weights."""
    x, ws = _weights()
    shapes = dict(zip(NAMES, (w.shape for w in ws)))
    flat = [sk.unit_major(w[l], 128) for l in range(ws[0].shape[0]) for w in ws[:4]] + [sk.unit_major(ws[4], 128)]
    got = sk.chain_by_phase(x, *flat, shapes=shapes, ctas=1, block_k=128, stages=2, interpret=True)
    v = ws[4].shape[0]
    assert got.shape[0] % 256 == 0
    assert _rel(got[:v], sk.reference_chain(x, *ws)[-v:]) < 1e-5
    one = sk.stream_k_phase(x, ws[0][0], ctas=1, block_k=128, stages=2, interpret=True)
    assert _rel(one[: ws[0].shape[1]], sk.reference_chain(x, *ws)[: ws[0].shape[1]]) < 1e-5
    with pytest.raises(ValueError, match="needs n"):
        sk.stream_k_phase(x, flat[0], ctas=1, block_k=128)


def test_unit_major_puts_each_unit_in_one_contiguous_tile():
    w = jnp.arange(2 * 128 * 512, dtype=jnp.float32).reshape(2, 128, 512)
    u = sk.unit_major(w, 256)
    assert u.shape == (2, 4, 64, 256)
    for g in range(4):  # unit g = row tile g // 2, K step g % 2
        t, j = divmod(g, 2)
        np.testing.assert_array_equal(u[1, g], w[1, t * 64:(t + 1) * 64, j * 256:(j + 1) * 256])


def test_plan_phases_offsets_chain_each_output_into_the_next_input():
    shapes = dict(qkv=(3, 384, 128), out=(3, 128, 128), gate_up=(3, 512, 128), down=(3, 128, 256), head=(640, 128))
    phases, head, stride, total = sk.plan_phases(shapes)
    by = {p.name: p for p in phases}
    assert stride == 384 + 128 + 512 + 128
    assert by["out"].x_off == by["qkv"].y_off and by["gate_up"].x_off == by["out"].y_off
    assert by["down"].x_off == by["gate_up"].y_off
    assert by["qkv"].x_off == by["down"].y_off - stride  # the previous layer's down
    assert head.y_off == 3 * stride and head.x_off == 2 * stride + by["down"].y_off
    assert total % sk.ZERO == 0 and total >= head.y_off + 640


@pytest.mark.parametrize("units,steps,ctas", [(384, 8, 132), (1024, 32, 132), (2048, 8, 132), (256, 8, 100),
                                              (96, 4, 7)])
def test_owner_and_chunk_count_agree_with_a_brute_force_schedule(units, steps, ctas):
    block_k = 256
    owners = np.empty(units, int)
    pairs: dict[int, set] = {}
    for c in range(ctas):
        a, b = c * units // ctas, (c + 1) * units // ctas
        owners[a:b] = c
        for u in range(a, b):
            pairs.setdefault(u // steps * 64 // block_k, set()).add((c, u // steps))
    assert [sk.owner(u, units, ctas) for u in range(units)] == owners.tolist()
    for j, got in pairs.items():
        assert sk.chunk_count(j, units, steps, ctas, block_k) == len(got), j


def test_refusals():
    x, ws = _weights()
    with pytest.raises(ValueError, match="interpret mode has no global semaphores"):
        sk.stream_k_chain(x, *ws, ctas=1, block_k=128, interpret=True)
    with pytest.raises(ValueError, match="prefetch must be"):
        sk.stream_k_chain(x, *ws, ctas=1, block_k=128, prefetch=-1)
    with pytest.raises(ValueError, match="x_loads must be"):
        sk.stream_k_chain(x, *ws, ctas=1, block_k=128, x_loads="dma")
    with pytest.raises(ValueError, match="barrier must be"):
        sk.stream_k_chain(x, *ws, ctas=1, block_k=128, barrier="all")
    with pytest.raises(ValueError, match="float32"):
        sk.stream_k_chain(x.astype(jnp.bfloat16), *ws, ctas=1, block_k=128)
    with pytest.raises(ValueError, match="at most 32"):
        sk.stream_k_chain(x, *ws, ctas=1, block_k=128, stages=33)
    with pytest.raises(ValueError, match="unit-major W"):  # row-major weights given as unit-major
        sk.stream_k_chain(x, *ws, ctas=1, block_k=128, shapes=dict(zip(NAMES, (w.shape for w in ws))))


def test_barrier_breakdown_reads_a_profile():
    """A made-up two-CTA, three-phase trace in the profiler's format: each phase starts at b, CTA
    1 signals 1 µs after CTA 0, both leave their wait for the next phase at b + 12."""
    events = []

    def region(tid, name, a, b):
        events.extend([dict(name=name, ph="B", ts=a, tid=tid), dict(name=name, ph="E", ts=b, tid=tid)])

    for c in range(2):
        region(c, "zero", 0, 1)
        region(c, "zero_wait", 1, 2)
        region(c, "signal", 2, 2.1)
        for ph in range(3):
            b = 2.1 + 12 * ph
            region(c, "x", b, b + 0.5)
            region(c, "units", b + 0.5, b + 8)
            region(c, "drain", b + 8, b + 8.5 + c)
            region(c, "signal", b + 8.5 + c, b + 8.6 + c)
            if ph < 2:
                region(c, "wait", b + 8.6 + c, b + 12)
    got = sk.barrier_breakdown({"traceEvents": events})
    assert got["phases"] == 2
    assert got["drain_us"] == pytest.approx(1.0)  # median of 0.5 and 1.5
    assert got["skew_us"] == pytest.approx(0.5)  # the last signal 1 µs after the first, the median halfway
    assert got["release_us"] == pytest.approx(12 - 9.5)  # wait end - the last signal's start
    assert got["x_us"] == pytest.approx(0.5)
    assert got["gap_us"] == pytest.approx(12.5 - 9.5)  # first product - the last signal's start
    assert got["units_us"] == pytest.approx(7.5)
