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


def test_time_interleaved_queues_calls_and_divides_by_the_queue(monkeypatch):
    """queue=q: each sample issues q calls and waits once; the sample is the time per call."""
    log, waits, clock = [], [], [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def call(name):
        log.append(name)
        clock[0] += 2.0  # every call costs 2 s of the fake clock
        return name

    monkeypatch.setattr(bench.jax, "block_until_ready", lambda x: waits.append(x) or x)
    times = bench.time_interleaved({n: (lambda n=n: call(n)) for n in "ab"}, warmup=1, reps=2, queue=3)
    assert log == ["a", "b"] + ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
    assert waits[2:] == [["a"] * 3, ["b"] * 3, ["b"] * 3, ["a"] * 3]  # one wait per sample, on all q outputs
    assert times == {"a": [2.0, 2.0], "b": [2.0, 2.0]}
    with pytest.raises(ValueError, match="queue must be >= 1, got 0"):
        bench.time_interleaved({"a": lambda: None}, queue=0)


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


# ------------------------------------------------------------------ the command line, on the CPU

TINY = ["--shape", "1,128,2,2,16", "--impls", "xla", "--causal", "yes", "--reps", "1"]  # (quick where not refused)


@pytest.mark.parametrize("argv, message", [
    (["--shape", "1,128,2", "--impls", "xla"], "--shape '1,128,2': B,T,H,KV,D, five integers >= 1"),
    (["--shape", "0,128,2,2,16", "--impls", "xla"], "--shape '0,128,2,2,16': B,T,H,KV,D, five integers >= 1"),
    (["--shape", "1,128,4,3,16", "--impls", "xla"], "the heads H=4 must be a multiple of the KV heads KV=3"),
    (["--seq-lens", "32768", "--head-dims", "16", "--impls", "xla"], "--seq-lens: [32768] do not divide 16384"),
    (["--head-dims", "16,x", "--impls", "xla"], "--head-dims: 'x' is not an integer"),
    (TINY + ["--seq-lens", "1024"], "--head-dims and --seq-lens set the sweep, which --shape and --quick replace"),
    (TINY + ["--reps", "0"], "--reps must be >= 1, got 0"),
    (TINY + ["--queue", "0"], "--queue must be >= 1, got 0"),
    (TINY + ["--out-name", "runs/a"], "--out-name 'runs/a': a file name stem"),
    (TINY + ["--check", "9"], "--check '9': 'all' or comma-separated case numbers in 0..7"),
    (TINY + ["--block-sizes", '{"bogus": 1}'], "--block-sizes '{\"bogus\": 1}': a JSON object of BlockSizes fields"),
    (TINY + ["--block-sizes-from", "/nonexistent/tune.json"], "--block-sizes-from '/nonexistent/tune.json'"),
])
def test_cli_refuses_bad_flags_by_name_before_anything_compiles(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_without_a_gpu_says_so_and_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench, "bench_shape", lambda *a, **k: pytest.fail("benchmarked without a GPU"))
    assert bench.main(TINY) == 2
    assert "bench_attention.py times attention kernels on a GPU; JAX's backend here is 'cpu'" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("OUT", str(tmp_path / "file"))
    with pytest.raises(SystemExit) as e:
        bench.main(TINY)
    assert e.value.code == 2 and "is not a folder" in capsys.readouterr().err


def test_cli_lists_and_sweep():
    a = bench.parse_args(["--impls", "cudnn, ours,ours", "--head-dims", "64", "--seq-lens", "16384, 1024"])
    assert a.impl_list == ["cudnn", "ours"]  # (a repeat would share the other's times: one row)
    assert a.shapes == [(1, 16384, 32, 32, 64), (16, 1024, 32, 32, 64)] and a.causals == [True, False]
    q = bench.parse_args(["--quick"])
    assert q.shapes == [(16, 1024, 32, 32, 128), (4, 4096, 32, 32, 128)] and q.causals == [True]
    assert bench.parse_args(["--shape", "2,8192,32,8,128", "--shape", "1,100,6,2,64"]).shapes == [
        (2, 8192, 32, 8, 128), (1, 100, 6, 2, 64)]


def test_written_json_is_strict_and_notes_stay_in_their_cell(tmp_path, monkeypatch):
    """A NaN error (a broken kernel: what --check is for) is null, not the bare NaN JSON lacks."""
    import json

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = [dict(impl="ours", B=1, T=128, H=2, KV=2, D=16, causal=True, err_out=float("nan"), tflops_fwd=float("inf"),
                 error="ValueError: a | b\nmore")]
    bench.write_out("t", {"rows": rows}, bench.format_table(rows))
    data = json.loads((tmp_path / "t.json").read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert data["rows"][0]["err_out"] is None and data["rows"][0]["tflops_fwd"] is None
    header, _, row = (tmp_path / "t.md").read_text().splitlines()
    assert header.count("|") == row.replace("\\|", "").count("|") == 15
    assert row.endswith("| ValueError: a \\| b more |")


def test_failed_checks_make_the_run_fail():
    """--check recorded an exception or NaN gradients and the script still exited 0."""
    ok = dict(B=1, T=8, S=8, H=2, KV=1, D=64, causal=True, segments=False, dtype="bfloat16", err_out=1e-3, nan=False)
    assert bench.failed_checks([ok]) == []
    bad = bench.failed_checks([ok, {**ok, "nan": True}, {**ok, "error": "ValueError: boom"}])
    assert len(bad) == 2 and bad[0].startswith("check 1 (") and "NaN" in bad[0]
    assert bad[1].startswith("check 2 (") and bad[1].endswith("ValueError: boom")
