"""scaling.profile_summary on a real CPU trace of the tiny model's train step, and on a
hand-built trace in the GPU layout (device process, Stream lines, derived lines, host events)."""

import collections
import gzip
import json

import jax
import numpy as np
import pytest

from scaling import profile_summary as ps
from scaling.config import load_config
from scaling.sharding import use_sharding
from scaling.train import global_batch, init_state, make_setup, make_train_step

STEPS = 3


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory, devices):
    """3 traced steps of the tiny model (scanned layers, so `while` ops nest their bodies)."""
    out = tmp_path_factory.mktemp("trace")
    cfg = load_config(
        "configs/models/tiny.yaml",
        ["--data.source=synthetic", "--train.batch_size=4", "--train.seq_len=32", "--model.num_layers=2",
         "--checkpoint.enabled=false", "--train.steps=10"],
    )
    setup = make_setup(cfg, devices=devices[:1])
    state = init_state(setup)
    rows = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (4, 33), dtype=np.int32)
    batch = global_batch(setup, rows)
    with use_sharding(setup.mesh, setup.rules):
        step = make_train_step(setup).lower(state, batch).compile()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        jax.profiler.start_trace(str(out), create_perfetto_trace=True)
        for i in range(STEPS):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                state, m = step(state, batch)
        jax.block_until_ready((state, m))
        jax.profiler.stop_trace()
    (out / "step.hlo.txt").write_text(step.as_text())
    return out


def _module_ops(trace):
    """Independently: the main module's HLO-op events, by thread."""
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    per_module = collections.Counter()
    for e in evs:
        per_module[e["args"]["hlo_module"]] += e["dur"]
    module = per_module.most_common(1)[0][0]
    return module, [e for e in evs if e["args"]["hlo_module"] == module]


def _union(intervals):
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def test_cpu_trace_sums(cpu_trace):
    trace, path = ps.load_trace(cpu_trace)
    assert path.name == "perfetto_trace.json.gz"
    hlo = ps.parse_hlo((cpu_trace / "step.hlo.txt").read_text())
    s = ps.summarize(trace, hlo=hlo)
    module, ops = _module_ops(trace)
    assert s["mode"] == "host" and s["module"] == module == "jit_step_fn"
    assert s["steps"] == STEPS and "run_id" in s["steps_source"]
    assert {e["args"]["run_id"] for e in ops}.__len__() == STEPS

    # Only this module ran while tracing, so every op event is in the window.
    assert s["events"] == len(ops)
    assert sum(c["count"] for c in s["categories"].values()) == len(ops)
    # Exclusive time summed over categories, computed here without the summarizer: the ops that
    # compute (all but while/conditional/call) by the per-thread union of their intervals, plus
    # each control op's time during which no op of its execution runs on any thread (its body's
    # ops run on other threads too: they must not be counted twice).
    control = lambda e: e["name"].split(".")[0] in ("while", "conditional", "call")  # noqa: E731
    by_thread = collections.defaultdict(list)
    for e in ops:
        if not control(e):
            by_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    expected = sum(_union(iv) for iv in by_thread.values())
    controls = [e for e in ops if control(e)]
    assert controls  # the scanned layers' loops
    for c in controls:
        c0, c1 = c["ts"], c["ts"] + c["dur"]
        inner = [(max(o["ts"], c0), min(o["ts"] + o["dur"], c1)) for o in ops
                 if o is not c and o["args"]["run_id"] == c["args"]["run_id"] and o["ts"] < c1 and o["ts"] + o["dur"] > c0
                 and (not control(o) or (o["ts"] >= c0 and o["ts"] + o["dur"] <= c1))]
        expected += c["dur"] - _union(inner)
    total = sum(c["us"] for c in s["categories"].values())
    assert total == pytest.approx(expected, rel=1e-9)
    # Nothing counted twice on a thread: at most the per-thread union of all op intervals.
    all_by_thread = collections.defaultdict(list)
    for e in ops:
        all_by_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    assert total <= sum(_union(iv) for iv in all_by_thread.values()) * (1 + 1e-9)
    assert sum(s["phases"].values()) == pytest.approx(total, rel=1e-9)
    assert sum(k["us"] for k in s["fusion_kinds"]) == pytest.approx(s["categories"][ps.ELEMENTWISE]["us"], rel=1e-9)
    # Window, busy (union over all threads) and idle.
    t0 = min(e["ts"] for e in ops)
    t1 = max(e["ts"] + e["dur"] for e in ops)
    assert s["window_us"] == pytest.approx(t1 - t0)
    assert s["busy_us"] == pytest.approx(_union([(e["ts"], e["ts"] + e["dur"]) for e in ops]))
    assert s["idle_us"] == pytest.approx(s["window_us"] - s["busy_us"])
    assert sum(b["us"] for b in s["gap_buckets"].values()) == pytest.approx(s["idle_us"], rel=1e-6, abs=1e-3)
    # What a train step is made of: dots, AdamW outside autodiff, copies, while loops.
    for cat in (ps.MATMUL, ps.OPTIMIZER, ps.COPY, ps.ELEMENTWISE):
        assert s["categories"][cat]["us"] > 0, cat
    assert s["phases"][ps.FORWARD] > 0 and s["phases"][ps.BACKWARD] > 0
    top = s["top_kernels"]
    assert len(top) == 20 and [r["us"] for r in top] == sorted((r["us"] for r in top), reverse=True)
    names = collections.Counter(e["name"] for e in ops)
    assert all(r["count"] == names[r["name"]] for r in top)


def test_cli_writes_markdown_and_json(cpu_trace, tmp_path, capsys):
    md, js = tmp_path / "s.md", tmp_path / "s.json"
    assert ps.main([str(cpu_trace), "--hlo", str(cpu_trace / "step.hlo.txt"), "--md", str(md), "--json", str(js)]) == 0
    text = md.read_text()
    assert "| matmul |" in text and "top 20 kernels" in text and "idle (gaps between kernels)" in text
    assert json.loads(js.read_text())["steps"] == STEPS
    assert "ms/step" in capsys.readouterr().out


def test_parse_hlo():
    text = """HloModule jit_step_fn, entry_computation_layout={()->()}

%fused_computation.3 (param_0: bf16[8,16], param_1: bf16[16,4]) -> bf16[8,4] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  %param_1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (Arg_0.1: bf16[8,16], Arg_1.2: bf16[16,4]) -> (bf16[8,4], f32[]) {
  %Arg_0.1 = bf16[8,16]{1,0} parameter(0)
  %Arg_1.2 = bf16[16,4]{1,0} parameter(1)
  %gemm_fusion_dot.1 = bf16[8,4]{1,0} fusion(%Arg_0.1, %Arg_1.2), kind=kCustom, calls=%fused_computation.3, metadata={op_name="jit(step_fn)/transpose(jvp())/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %custom-call.4 = (bf16[8,4]{1,0}, u8[0]{0}) custom-call(%Arg_0.1), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step_fn)/jvp()/dot_product_attention"}
  ROOT %tuple = (bf16[8,4]{1,0}, f32[]) tuple(%gemm_fusion_dot.1, %custom-call.4)
}
"""
    h = ps.parse_hlo(text)
    assert h["gemm_fusion_dot.1"].opcode == "fusion" and "dot" in h["gemm_fusion_dot.1"].fused_ops
    assert h["gemm_fusion_dot.1"].op_name.endswith("transpose(jvp())/dot_general")
    assert h["gemm_fusion_dot.1"].backend_kind == "__triton_gemm"
    assert h["gemm_fusion_dot.1"].signature(h) == "bf16[8,4] <- bf16[8,16], bf16[16,4]"
    assert h["custom-call.4"].signature(h) == "(bf16[8,4], u8[0]) <- bf16[8,16]"
    assert h["custom-call.4"].opcode == "custom-call" and h["custom-call.4"].target == "__cudnn$fmhaSoftmax"
    assert h["tuple"].opcode == "tuple" and h["dot.1"].opcode == "dot"


def _gpu_trace():
    """The layout XLA's GPU profiler exports: kernels on Stream lines of /device:GPU:0."""
    dev, host = 1, 701
    meta = [
        {"ph": "M", "pid": dev, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": dev, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Kernel,MemcpyD2D)"}},
        {"ph": "M", "pid": dev, "tid": 100, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": dev, "tid": 101, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": host, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": host, "tid": 5, "name": "thread_name", "args": {"name": "python"}},
    ]
    kernels = [  # name, dur, hlo_op, name arg
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", 100, "cublas-gemm.1", "jvp()/btd,df->btf/dot_general"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", 40, "custom-call.2", "jvp()/dot_product_attention"),
        ("loop_multiply_fusion_2", 10, "loop_multiply_fusion.2", "jvp()/mul"),
        ("input_reduce_fusion", 6, "input_reduce_fusion", "transpose(jvp())/reduce_sum"),
        ("gemm_fusion_dot_3", 80, "gemm_fusion_dot.3", "transpose(jvp())/dot_general"),
        ("flash_attention_dkv", 50, "custom-call.9", "transpose(jvp())/pallas_call"),
        ("loop_dynamic_update_slice_fusion", 5, "loop_dynamic_update_slice_fusion", "jvp()/dynamic_update_slice"),
        ("MemcpyD2D", 3, "copy.7", ""),
        ("loop_add_select_fusion", 20, "loop_add_select_fusion.1", "mul"),
        ("loop_sqrt_fusion", 4, "loop_sqrt_fusion", ""),
    ]
    events, ts = [], 1000.0
    for step in range(2):
        start = ts
        for name, dur, op, opname in kernels:
            events.append({"ph": "X", "pid": dev, "tid": 7, "ts": ts, "dur": dur, "name": name,
                           "args": {"hlo_op": op, "hlo_module": "jit_step_fn", "name": opname, "correlation_id": 1}})
            events.append({"ph": "X", "pid": dev, "tid": 101, "ts": ts, "dur": dur, "name": op, "args": {}})
            ts += dur + 2  # a 2 us gap after every kernel
        events.append({"ph": "X", "pid": dev, "tid": 100, "ts": start, "dur": ts - start, "name": "jit_step_fn(3)"})
        events.append({"ph": "X", "pid": host, "tid": 5, "ts": start - 50, "dur": 30, "name": "PjitFunction(step_fn)",
                       "args": {"hlo_module": "jit_step_fn", "hlo_op": "not-a-device-op"}})
        ts += 30  # a gap between steps
    # a kernel of another module before the window: ignored
    events.append({"ph": "X", "pid": dev, "tid": 7, "ts": 10, "dur": 5, "name": "loop_convert_fusion",
                   "args": {"hlo_op": "convert", "hlo_module": "jit_init"}})
    return {"displayTimeUnit": "ns", "traceEvents": meta + events}, kernels


def test_gpu_layout(tmp_path):
    trace, kernels = _gpu_trace()
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    s, _ = ps.summarize_path(tmp_path)
    assert s["mode"] == "device" and s["module"] == "jit_step_fn"
    assert s["steps"] == 2 and s["steps_source"] == "XLA Modules line"
    assert s["lines"] == ["Stream #7(Kernel,MemcpyD2D)"]  # derived XLA Ops line not counted
    cat = {k: v["us"] / 2 for k, v in s["categories"].items()}
    assert cat[ps.MATMUL] == 180
    assert cat[ps.ATTENTION] == 90
    assert cat[ps.COPY] == 8
    assert cat[ps.OPTIMIZER] == 20
    assert cat[ps.ELEMENTWISE] == 16 + 4  # loop_sqrt_fusion has no op name: phase unknown
    assert cat[ps.OTHER] == 0
    busy = sum(k[1] for k in kernels)
    assert s["busy_us"] == 2 * busy
    # gaps: 9 x 2 us inside each step, 2 + 30 us between them
    assert s["idle_us"] == pytest.approx(2 * 9 * 2 + 32)
    assert s["window_us"] == pytest.approx(s["busy_us"] + s["idle_us"])
    assert s["gap_buckets"]["<2us"]["count"] == 0 and s["gap_buckets"]["2-10us"]["count"] == 18
    assert s["gap_buckets"]["10-100us"]["count"] == 1
    assert s["largest_gaps"][0]["us"] == 32 and s["largest_gaps"][0]["before"].startswith("nvjet")
    assert s["phases"][ps.OUTSIDE] == 40 and s["phases"][ps.BACKWARD] == 2 * 136
    assert s["top_kernels"][0]["name"].startswith("nvjet") and s["top_kernels"][0]["count"] == 2
    md = ps.to_markdown(s)
    assert "| attention | 0.09 |" in md


def test_train_profile_writes_summary(tmp_path, capsys):
    """`train --profile` (the default steps 5-8): a trace, and its summary next to it."""
    from scaling.__main__ import main

    run_dir = tmp_path / "prof"
    rc = main(
        ["train", "--config", "configs/models/tiny.yaml", "--run_dir", str(run_dir), "--profile",
         "--data.source=synthetic", "--train.steps=9", "--train.batch_size=8", "--train.seq_len=16",
         "--model.num_layers=1", "--train.eval_every=0", "--checkpoint.enabled=false", "--logging.progress=false"]
    )
    assert rc == 0
    assert list((run_dir / "profile").rglob("*.xplane.pb")), list((run_dir / "profile").rglob("*"))
    assert list((run_dir / "profile").rglob("perfetto_trace.json.gz"))
    summary = (run_dir / "profile" / "summary.md").read_text()
    assert "| matmul |" in summary
    out = capsys.readouterr().out
    assert "profile: per step" in out and "summary.md" in out and "profile: trace of steps" in out


# ----------------------------------------------------------------------------- hand-built traces


def _host_trace(ops, module="jit_m"):
    """A CPU-layout trace: (thread, name, ts, dur[, run_id[, module]]) HLO-op events on /host:CPU."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    events = []
    for tid, name, ts, dur, *rest in ops:
        run = rest[0] if rest else "1"
        mod = rest[1] if len(rest) > 1 else module
        events.append({"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name,
                       "args": {"hlo_op": name, "hlo_module": mod, "run_id": run}})
    return {"traceEvents": meta + events}


def test_self_times_overlapping_children_counted_once():
    """Two children of one parent that overlap a little (clock rounding): every instant of the line
    goes to one event, so the self times add up to the line's span, not more."""
    line = (1, 1)
    p, b, c = (ps.Event("p", 0.0, 100.0, line, {}), ps.Event("b", 10.0, 40.5, line, {}), ps.Event("c", 50.0, 40.0, line, {}))
    ps.self_times([p, b, c])
    # b alone runs 10..50, c (the later start, so the inner one) 50..90, p 0..10 and 90..100.
    assert (b.self_us, c.self_us, p.self_us) == (40.0, 40.0, 20.0)
    assert b.self_us + c.self_us + p.self_us == 100.0


def test_while_body_on_other_threads_not_counted_twice():
    """CPU: the thunk executor runs a while's body ops on other threads as well as its own. The
    while's own time is the part of it during which none of its execution's ops runs anywhere."""
    ops = [
        (1, "while.1", 0.0, 100.0),
        (1, "loop_add_fusion.1", 10.0, 20.0),  # body op on the while's thread: 10..30
        (2, "loop_mul_fusion.2", 20.0, 40.0),  # body op on another thread: 20..60
        (2, "while.2", 62.0, 6.0),  # a nested loop on another thread, with no ops of its own traced
        (1, "loop_sub_fusion.3", 70.0, 10.0),  # 70..80
    ]
    s = ps.summarize(_host_trace(ops))
    assert s["mode"] == "host" and s["steps"] == 1
    # while.1: 100 - |10..60 u 62..68 u 70..80| = 100 - 66 = 34; while.2: 6 (while.1 around it is
    # its ancestor, not its part). Fusions: 20 + 40 + 10.
    assert s["categories"][ps.OTHER]["us"] == pytest.approx(34 + 6)
    assert s["categories"][ps.ELEMENTWISE]["us"] == pytest.approx(70)
    assert s["kernel_us"] == pytest.approx(110)
    assert s["busy_us"] == pytest.approx(100) and s["overlap_us"] == pytest.approx(10)  # 20..30 on both threads
    rows = {r["hlo_op"]: r["us"] for r in s["top_ops"]}
    assert rows["while.1"] == pytest.approx(34) and rows["while.2"] == pytest.approx(6)


def _gpu_devices_trace(n_devices, modules):
    """GPU layout, one kernel per module execution on each device: modules = [(module, ts, dur)].
    Each execution also has its event on the device's derived XLA Modules line."""
    meta, events = [], []
    for d in range(n_devices):
        pid = 10 + d
        meta += [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"/device:GPU:{d}"}},
                 {"ph": "M", "pid": pid, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Kernel)"}},
                 {"ph": "M", "pid": pid, "tid": 100, "name": "thread_name", "args": {"name": "XLA Modules"}}]
        for k, (mod, ts, dur) in enumerate(modules):
            events.append({"ph": "X", "pid": pid, "tid": 7, "ts": ts, "dur": dur, "name": "gemm_fusion_dot",
                           "args": {"hlo_op": "gemm_fusion_dot.1", "hlo_module": mod, "correlation_id": k}})
            events.append({"ph": "X", "pid": pid, "tid": 100, "ts": ts, "dur": dur, "name": f"{mod}({k + 3})"})
    return {"traceEvents": meta + events}


def test_steps_counted_per_device():
    """Two GPUs each run the step 3 times: 3 steps (each device has its own XLA Modules line)."""
    s = ps.summarize(_gpu_devices_trace(2, [("jit_step", 0, 100), ("jit_step", 200, 100), ("jit_step", 400, 100)]))
    assert s["mode"] == "device" and s["module"] == "jit_step"
    assert s["steps"] == 3 and s["steps_source"].startswith("XLA Modules line")
    assert s["devices"] == 2 and s["window_us"] == 500 and s["busy_us"] == 300
    assert s["categories"][ps.MATMUL]["us"] == 600  # summed over the two devices


def test_steps_not_counted_from_a_module_sharing_the_name_prefix():
    """`jit_step(3)` is the followed module; `jit_step_eval(4)` is another one."""
    s = ps.summarize(_gpu_devices_trace(1, [("jit_step", 0, 100), ("jit_step", 200, 100), ("jit_step_eval", 400, 10)]))
    assert s["module"] == "jit_step" and s["steps"] == 2


def test_rows_of_another_module_kept_apart():
    """HLO op names are a module's own: `fusion.1` of jit_other (run inside the window) is not
    `fusion.1` of jit_m, takes none of its HLO metadata, and its kernel row is its own."""
    ops = [(1, "fusion.1", 0.0, 10.0, "1", "jit_m"), (1, "fusion.1", 20.0, 3.0, "9", "jit_other"),
           (1, "fusion.1", 30.0, 10.0, "2", "jit_m")]
    hlo = ps.parse_hlo("""HloModule jit_m

%fc (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.0 = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %fusion.1 = f32[8,8]{1,0} fusion(%a, %a), kind=kOutput, calls=%fc, metadata={op_name="jit(m)/jvp()/dot_general"}
}
""")
    s = ps.summarize(_host_trace(ops), hlo=hlo, top=5)
    assert s["module"] == "jit_m" and s["steps"] == 2
    assert sorted((r["hlo_op"], r["count"], r["us"]) for r in s["top_ops"]) == [("fusion.1", 1, 3.0), ("fusion.1", 2, 20.0)]
    assert sorted((r["name"], r["count"]) for r in s["top_kernels"]) == [("fusion.1", 1), ("fusion.1", 2)]
    ops_rows = {(r["module"], r["hlo_op"]): r for r in s["top_ops"]}
    assert set(ops_rows) == {("jit_m", "fusion.1"), ("jit_other", "fusion.1")}
    mine, other = ops_rows["jit_m", "fusion.1"], ops_rows["jit_other", "fusion.1"]
    assert (mine["count"], mine["us"], mine["category"]) == (2, 20.0, ps.MATMUL)
    assert mine["op_name"] == "jit(m)/jvp()/dot_general" and mine["types"] == "f32[8,8] <- f32[8,8], f32[8,8]"
    assert (other["count"], other["us"], other["category"], other["op_name"], other["types"]) == (1, 3.0, ps.OTHER, "", "")
    kernels = {(r["module"], r["name"]): (r["count"], r["category"]) for r in s["top_kernels"]}
    assert kernels == {("jit_m", "fusion.1"): (2, ps.MATMUL), ("jit_other", "fusion.1"): (1, ps.OTHER)}
    md = ps.to_markdown(s)
    assert "| `fusion.1` (jit_other) |" in md and "| `fusion.1` | `fusion.1` | matmul |" in md


def test_arguments_out_of_range_rejected():
    trace = _host_trace([(1, "fusion.1", 0.0, 10.0), (1, "fusion.2", 12.0, 5.0)])
    for bad in (0, -1, 0.0):
        with pytest.raises(ValueError, match=r"steps must be a number > 0") as e:
            ps.summarize(trace, steps=bad)
        assert getattr(e.value, "field", None) == "steps"
    with pytest.raises(ValueError, match=r"top must be an integer >= 0"):
        ps.summarize(trace, top=-1)
    assert ps.summarize(trace, steps=2)["steps"] == 2
    s = ps.summarize(trace, top=0)
    assert s["top_kernels"] == [] and s["top_ops"] == []
    md = ps.to_markdown(s)
    assert "kernels by total time" not in md and "HLO ops by total time" not in md


def test_json_array_trace_and_null_args():
    """Chrome's trace format may also be a bare array of events; `args` may be null."""
    trace = _host_trace([(1, "fusion.1", 0.0, 10.0), (1, "copy.2", 12.0, 5.0)])
    events = trace["traceEvents"] + [{"ph": "X", "pid": 1, "tid": 3, "ts": 1.0, "dur": 1.0, "name": "python", "args": None}]
    s = ps.summarize(events)
    assert s["events"] == 2 and s["window_us"] == 17 and s["busy_us"] == 15 and s["idle_us"] == 2
    assert s["categories"][ps.COPY]["us"] == 5 and s["categories"][ps.ELEMENTWISE]["us"] == 10
    with pytest.raises(ValueError, match="not a Chrome trace"):
        ps.summarize({"displayTimeUnit": "ns"})
    with pytest.raises(ValueError, match="no kernel or HLO-op events"):
        ps.summarize({"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5, "name": "python"}]})


def test_load_trace_unreadable_files(tmp_path):
    trace = _host_trace([(1, "fusion.1", 0.0, 10.0)])
    data = gzip.compress(json.dumps(trace).encode())
    (tmp_path / "cut.trace.json.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt gzip"):
        ps.load_trace(tmp_path / "cut.trace.json.gz")
    (tmp_path / "half.json").write_text(json.dumps(trace)[:40])
    with pytest.raises(ValueError, match="not JSON, or cut short"):
        ps.load_trace(tmp_path / "half.json")
    (tmp_path / "gzipped.json").write_bytes(data)  # gzip under another name: read by its magic bytes
    assert ps.load_trace(tmp_path / "gzipped.json")[0] == trace
    with pytest.raises(FileNotFoundError, match="no such file"):
        ps.load_trace(tmp_path / "missing")
