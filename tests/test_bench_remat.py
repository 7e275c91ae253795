"""experiments/bench_remat.py: the largest-batch search's bracketing, what survives a child
killed at its deadline, and the offload calibration's CPU behaviour (fast: no train step)."""

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
import bench_remat as br  # noqa: E402
import remat_search as rs  # noqa: E402


def linear(b0, per):
    return lambda b: b0 + per * b


def search(f, start, max_batch=256, b0=4):
    points = {b0: f(b0)}
    order = []
    while (b := rs.next_probe(points, max_batch, start=start)) is not None:
        assert b not in points and 1 <= b <= max_batch
        order.append(b)
        points[b] = f(b)
    return rs.bracket(points), order


@pytest.mark.parametrize("start", [1, 22, 58, 60, 177, 256])
def test_next_probe_brackets_a_linear_boundary(start):
    f = linear(0.1, 0.0175)  # fits up to 51 (51.43)
    (lo, hi), order = search(f, start)
    assert (lo, hi) == (51, 52)
    assert order[0] == start or start <= 4
    assert len(order) <= 5


def test_next_probe_cap_and_nothing_fits():
    (lo, hi), _ = search(linear(0.0, 0.001), start=177)  # everything fits: stops at the cap
    assert (lo, hi) == (256, None)
    points = {4: 1.5}  # the measured batch is over the limit already
    while (b := rs.next_probe(points, 256)) is not None:
        points[b] = 1.5 * b / 4
    assert rs.bracket(points)[0] == 2 and points[3] > 1


def test_usage_takes_the_binding_limit():
    assert rs.usage(50, 0, 100, 10) == 0.5  # no host bytes reported: device only
    assert rs.usage(50, 20, 100, 10) == 2.0  # pinned host over its limit
    assert rs.usage(50, 20, 100, None) == 0.5


def events(*probes, step=None, done=True, limit=100.0):
    ev = [{"kind": "search_start", "predicted": 58, "limit": limit, "host_limit": None, "batch": 4, "xla": 20.0,
           "host": 0, "autotune": True}]
    ev += [{"kind": "probe", "batch": b, "xla": x, "host": 0, "tuned": t, "seconds": 1.0} for b, x, t in probes]
    if step:
        ev.append({"kind": "step", **step})
    if done:
        ev.append({"kind": "search", "stopped": None})
    return ev


def test_partial_search_from_a_killed_child():
    s = rs.summarize_search(events((120, 99.0, False), (128, 101.0, False), done=False), 256)
    assert (s["found"], s["hi"], s["bracketed"]) == (120, 128, False)
    assert s["stopped"] == "killed at its deadline"
    assert rs.largest_cell(s) == "≥ 120, < 128 (not bracketed; autotune-off probes only; no real step)"
    s = rs.summarize_search(events(done=False), 256)  # killed before its first probe
    assert s["found"] == 4 and s["probes"] == [] and s["step"]["measured"]


def test_autotuned_probes_override_and_verify_the_bracket():
    ev = events((60, 99.0, False), (61, 100.5, False), (60, 100.2, True), (59, 99.6, True),
                step={"batch": 59, "ok": True, "tuned": True, "peak": 99.6})
    s = rs.summarize_search(ev, 256)
    assert (s["found"], s["hi"], s["bracketed"], s["lo_autotuned"], s["hi_autotuned"]) == (59, 60, True, True, True)
    assert rs.largest_cell(s) == "59"
    s = rs.summarize_search(events((60, 99.0, False), (61, 100.5, False)), 256)
    assert rs.largest_cell(s) == "60 (autotune-off probes only; no real step)"
    # 60 autotuned is 0.2% above its autotune-off probe: 61, 5% over with autotuning off, stays over.
    s = rs.summarize_search(events((60, 98.0, False), (61, 105.0, False), (60, 98.2, True),
                                   step={"batch": 60, "ok": True, "tuned": True, "peak": 98.2}), 256)
    assert s["hi_inferred"] and rs.largest_cell(s) == "60"
    # 61 only 0.3% over: not inferred, and the cell says which side is unchecked.
    s = rs.summarize_search(events((60, 98.0, False), (61, 100.3, False), (60, 98.2, True)), 256)
    assert not s["hi_inferred"] and rs.largest_cell(s) == "60 (61: autotune-off probe only; no real step)"


def test_spawn_keeps_the_lines_of_a_child_killed_at_its_deadline():
    code = ("import json, time\n"
            "for b in (10, 20):\n"
            "    print(json.dumps({'kind': 'probe', 'batch': b}), flush=True)\n"
            "time.sleep(60)\n")
    t0 = time.time()
    got, why = br.spawn([sys.executable, "-c", code], 3, {}, on_event=lambda x: None)
    assert time.time() - t0 < 30
    assert [x["batch"] for x in got] == [10, 20] and "killed" in why
    assert all(json.dumps(x) for x in got)


def test_host_calibration_on_cpu_reports_no_transfer():
    out = {}
    with pytest.raises(RuntimeError, match="no host memory space"):
        br.host_rate(True, out, chunk=1 << 16, sizes=(2, 4))


class _Compiled:
    def __init__(self, mem, b, tuned):
        self.dev = int(mem(b, tuned))

    def memory_analysis(self):
        from types import SimpleNamespace

        return SimpleNamespace(temp_size_in_bytes=self.dev, argument_size_in_bytes=0, output_size_in_bytes=0,
                               alias_size_in_bytes=0, host_temp_size_in_bytes=0, host_argument_size_in_bytes=0,
                               host_output_size_in_bytes=0, host_alias_size_in_bytes=0)

    def __call__(self, state, batch):
        return state, {"loss": 1.0}


class _Step:
    """A train step whose compile-only memory is mem(batch, autotuned), on a pretend GPU."""

    def __init__(self, mem):
        self.mem, self.compiles = mem, []

    def lower(self, abstract, spec):
        step, b = self, spec.shape[0]

        class Lowered:
            def compile(self, compiler_options=None):
                tuned = compiler_options is None
                step.compiles.append((b, tuned))
                return _Compiled(step.mem, b, tuned)

        return Lowered()


def _search_on_a_pretend_gpu(monkeypatch, capsys, mem, **kw):
    from types import SimpleNamespace

    import scaling.train

    monkeypatch.setattr(scaling.train, "abstract_state", lambda setup: None)
    step = _Step(mem)
    args = SimpleNamespace(**{"planned": 58, "max_batch": 256, "deadline": time.time() + 60, "fast_s": 0.0,
                              "tune_k": 0.0, "policy": "dots", **kw})
    dev = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", memory_stats=lambda: {"peak_bytes_in_use": 7})
    cfg = br.make_config("tiny", args.policy, 4, 16)
    br.search(args, cfg, SimpleNamespace(batch_sharding=None), step, {}, lambda b: None, dev, 1000.0,
              mem(4, True), 0, 1.0, 0.01)
    ev = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    return step.compiles, ev


def test_gpu_search_brackets_autotune_off_then_checks_autotuned(monkeypatch, capsys):
    # 17.5 bytes per batch element; autotuned 0.3% more: the limit (1000) falls between 56 and 57.
    compiles, ev = _search_on_a_pretend_gpu(monkeypatch, capsys, lambda b, t: (10 + 17.5 * b) * (1.003 if t else 1))
    assert [b for b, t in compiles if not t][0] == 58  # the planner's prediction first
    assert all(not t for b, t in compiles[:-1]) and compiles[-1] == (56, True)  # one autotuned compile, at lo
    s = rs.summarize_search(ev, 256)
    assert (s["found"], s["hi"], s["lo_autotuned"], s["hi_inferred"]) == (56, 57, True, True)
    assert s["step"] == {**s["step"], "batch": 56, "ok": True, "tuned": True}
    assert rs.largest_cell(s) == "56" and s["stopped"] is None


def test_gpu_search_moves_the_bracket_when_autotuning_changes_it(monkeypatch, capsys):
    # Autotuned +1.5%: 56 fits with autotuning off (991.4) but not autotuned (1006.3).
    compiles, ev = _search_on_a_pretend_gpu(monkeypatch, capsys, lambda b, t: (10 + 17.5 * b) * (1.015 if t else 1))
    s = rs.summarize_search(ev, 256)
    assert (s["found"], s["hi"], s["lo_autotuned"], s["hi_autotuned"]) == (55, 56, True, True)
    assert s["step"]["batch"] == 55 and s["step"]["tuned"]


def test_gpu_search_out_of_time_keeps_the_autotune_off_bracket(monkeypatch, capsys):
    # An autotuned compile estimated at 1000 s per batch element: no time for it; the bracket
    # and the real step come from the autotune-off probes, and the table says so.
    compiles, ev = _search_on_a_pretend_gpu(monkeypatch, capsys, lambda b, t: 10 + 17.5 * b, tune_k=1000.0)
    assert not any(t for _, t in compiles)
    s = rs.summarize_search(ev, 256)
    assert (s["found"], s["hi"], s["step"]["batch"], s["step"]["tuned"]) == (56, 57, 56, False)
    assert s["stopped"].startswith("budget: autotuned check stopped")
    assert rs.largest_cell(s) == "56 (autotune-off probes only)"


def test_offload_search_holds_the_predicted_host_bytes_against_host_ram(monkeypatch, capsys):
    """XLA reporting no pinned-host bytes, offload's search is bounded by the accounting's
    offloaded residuals against the host limit, and says the host bytes are predicted."""
    from scaling import accounting as acc

    cfg = br.make_config("tiny", "offload", 4, 16)
    per_batch = acc.training_memory(cfg, acc.MeshShape(), hw=br._hw("NVIDIA H200"), accelerator=True,
                                    batch_size=1).activations.host
    monkeypatch.setattr(br, "host_limit", lambda: 10.5 * per_batch)  # room for 10 batches' residuals
    compiles, ev = _search_on_a_pretend_gpu(monkeypatch, capsys, lambda b, t: 10 + b, policy="offload", planned=7)
    s = rs.summarize_search(ev, 256)
    assert (s["found"], s["hi"]) == (10, 11)
    assert {p[5] for p in s["probes"]} == {"predicted"}


def test_largest_cell_of_non_monotone_probes_names_the_batch_over_the_limit():
    # 12 fits but 10, below it, does not (XLA picked other buffers there): the answer is 12,
    # flagged; it is not "≥ 12, < 10" (which no batch satisfies).
    s = rs.summarize_search(events((10, 101.0, True), (12, 99.0, True),
                                   step={"batch": 12, "ok": True, "tuned": True, "peak": 99.0}), 256)
    assert (s["found"], s["hi"], s["monotone"]) == (12, 10, False)
    assert rs.largest_cell(s) == "≥ 12 (probes not monotone: 10 is over the limit)"


def test_largest_cell_when_nothing_fits():
    # The measured batch 4 is over the limit already and so are 2 and 1: nothing fits, no step
    # to run, no lower side to compile autotuned.
    ev = events((2, 110.0, False), (1, 105.0, False), (1, 104.0, True), limit=100.0)
    ev[0]["xla"] = 130.0
    s = rs.summarize_search(ev, 256)
    assert (s["found"], s["hi"], s["bracketed"]) == (0, 1, True)
    assert rs.largest_cell(s) == "0"
    s = rs.summarize_search(ev[:-2] + ev[-1:], 256)  # 1 with autotuning off only
    assert rs.largest_cell(s) == "0 (1: autotune-off probe only)"


def test_compute_dtype_reaches_the_config_and_the_f32_prediction(monkeypatch, capsys):
    """--compute-dtype float32: the children's config computes in f32, and the calibrated
    prediction prices its matmuls at the measured f32 rate (halving that rate doubles them)."""
    import types

    monkeypatch.setattr(br, "_compute_dtype", "float32")
    assert br.make_config("tiny", "none", 2, 128).model.compute_dtype.value == "float32"
    args = types.SimpleNamespace(model="tiny", seq=128, steps=2, max_batch=8)
    cal = {"device": "NVIDIA H100 80GB HBM3", "backend": "gpu", "matmul": 5e14, "attention": 2e14, "copy": 3e12,
           "host": 5e10, "f32_matmul": 2e14}
    fast = br.predictions(args, "none", 2, cal, None)
    slow = br.predictions(args, "none", 2, {**cal, "f32_matmul": 1e14}, None)
    assert slow["matmul_s"] == pytest.approx(2 * fast["matmul_s"], rel=1e-9)
    with pytest.raises(SystemExit) as e:
        br.main(["--compute-dtype", "fp8"])
    assert e.value.code == 2 and "--compute-dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_the_prediction_prices_matmuls_at_the_square_rate_and_the_layer_rate_beside_it():
    """The headline prediction uses the square product's rate (the hardware table's method; the
    step's own matmuls ran near it), the layer shapes' rate goes in the side column, and without a
    square measurement the layer rate is used."""
    import types

    args = types.SimpleNamespace(model="tiny", seq=128, steps=2, max_batch=8)
    cal = {"device": "NVIDIA H100 80GB HBM3", "backend": "gpu", "matmul": 5e14, "matmul_square": 8e14,
           "attention": 2e14, "copy": 3e12, "host": 5e10, "f32_matmul": 2e14}
    a = br.predictions(args, "none", 2, cal, None)
    b = br.predictions(args, "none", 2, {**cal, "matmul_square": 4e14}, None)
    layer_only = br.predictions(args, "none", 2, {k: v for k, v in cal.items() if k != "matmul_square"}, None)
    assert b["seconds"] > a["seconds"] and b["seconds_layer_rate"] == a["seconds_layer_rate"]
    assert layer_only["seconds"] == pytest.approx(a["seconds_layer_rate"], rel=1e-12)
    assert "seconds_layer_rate" in layer_only and a["seconds"] < a["seconds_layer_rate"]
