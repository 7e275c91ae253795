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
    # Exclusive time summed over categories == per-thread union of the op intervals (nested
    # `while` bodies counted once), computed here without the summarizer.
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    per_thread = sum(_union(iv) for iv in by_thread.values())
    total = sum(c["us"] for c in s["categories"].values())
    assert total == pytest.approx(per_thread, rel=1e-9)
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
