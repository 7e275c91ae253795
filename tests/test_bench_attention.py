"""The timing helpers of experiments/bench_attention.py (no GPU needed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_attention as bench  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def test_time_interleaved_rotates_the_order_and_times_every_call():
    log = []
    calls = {name: (lambda name=name: log.append(name)) for name in "abc"}
    times = bench.time_interleaved(calls, warmup=1, reps=4)
    assert log[:3] == ["a", "b", "c"]  # warm-up, one call each
    rounds = [log[3 + 3 * r: 6 + 3 * r] for r in range(4)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for v in times.values() for t in v)


def test_ratio_stats_is_the_median_of_per_round_ratios():
    rng = np.random.default_rng()
    base, other = rng.uniform(1, 2, 11), rng.uniform(1, 2, 11)
    med, q1, q3 = bench.ratio_stats(list(base), list(other))
    ratios = sorted(base / other)
    assert med == pytest.approx(ratios[5])  # 11 rounds: the sixth smallest
    assert q1 <= med <= q3 and q1 == pytest.approx(np.percentile(base / other, 25))
    # a drift that slows both alike leaves every per-round ratio, hence the median, unchanged
    drift = np.linspace(1.0, 1.3, 11)
    assert bench.ratio_stats(list(base * drift), list(base * drift * 0.9))[0] == pytest.approx(1 / 0.9)


def test_check_repeat_counts_calls_that_change_their_bits(monkeypatch):
    """experiments/check_repeat.py: a deterministic core gives 0 differing calls and a small error
    against the f32 reference; a core whose output moves from call to call is caught on every
    repeat (the check can fail)."""
    import itertools

    import check_repeat
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    shape = (1, 64, 4, 2, 16, 1)
    rec = check_repeat.run(shape, "xla", repeats=3)
    assert rec["differing_calls"] == 0 and rec["max_abs_diff"] == 0 and max(rec["err"].values()) < 1e-2

    counter = itertools.count()

    def drifting(name, causal):
        def fn(q, k, v):
            bump = io_callback(lambda: np.float32(next(counter)), jax.ShapeDtypeStruct((), jnp.float32))
            out = jax.nn.dot_product_attention(q, k, v, is_causal=bool(causal), implementation="xla")
            return out + (bump * 1e-2).astype(out.dtype)
        return fn

    monkeypatch.setattr(check_repeat, "impl_fn", drifting)
    rec = check_repeat.run(shape, "drifting", repeats=3)
    assert rec["differing_calls"] == 3 and rec["max_abs_diff"] > 0


def test_impl_fn_names_the_allowed_implementations_and_the_missing_peer(monkeypatch):
    """tokamax is a peer carried to the GPU machine, not a dependency: without it the
    error says what is missing; an unknown name lists the allowed ones."""
    import builtins

    real_import = builtins.__import__

    def no_tokamax(name, *a, **kw):
        if name == "tokamax":
            raise ImportError("No module named 'tokamax'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tokamax)
    with pytest.raises(ValueError, match="needs the tokamax package"):
        bench.impl_fn("tokamax_mosaic", True)
    with pytest.raises(ValueError, match="allowed: cudnn, ours"):
        bench.impl_fn("flash3", True)
    assert all(i in bench.IMPLS for i in ("cudnn", "auto", "tokamax_mosaic", "tokamax_triton"))
