"""Mutants of scaling/profile_summary.py that the suite let through, killed on small traces built
here by hand: every expected number below is worked out in the comments from the events, not
read from the summarizer."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from scaling import profile_summary as ps

# ----------------------------------------------------------------------------- a GPU training step

STEP = [  # kernel name, start within the step (us), duration (us), hlo_op, launch annotation's `name`
    ("nvjet_hsh_128x128_gemm", 0, 1000, "dot.1", "jit(train)/jvp()/dot_general"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1000, 500, "all-reduce.2", "jit(train)/transpose(jvp())/psum"),
    # gap of exactly 10 us: the 10-100us bucket
    ("loop_multiply_fusion_3", 1510, 200, "loop_multiply_fusion.3", "jit(train)/jvp()/mul"),
    # gap of exactly 2 us: the 2-10us bucket
    ("loop_multiply_fusion_7", 1712, 100, "loop_multiply_fusion.7", "jit(train)/transpose(jvp())/mul"),
    # gap of exactly 100 us: the >=100us bucket
    ("kernel_0", 1912, 400, "custom-call.4", ""),  # a cuDNN attention only its HLO target names
    ("loop_add_fusion", 2312, 100, "loop_add_fusion.5", "jit(train)/adamw/add"),  # outside autodiff
]
STEP_STARTS = (1000, 4000)  # 2 steps; the first ends at 3412, so 588 us idle between them

HLO = """HloModule jit_train

ENTRY %main (p: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %custom-call.4 = f32[8,8]{1,0} custom-call(%p), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(train)/jvp()/dot_product_attention"}
}
"""


def _gpu_trace():
    dev = 3
    events = [{"ph": "M", "pid": dev, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": dev, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Kernel)"}},
              {"ph": "M", "pid": dev, "tid": 100, "name": "thread_name", "args": {"name": "XLA Modules"}}]
    for s in STEP_STARTS:
        for name, t, dur, op, opname in STEP:
            events.append({"ph": "X", "pid": dev, "tid": 7, "ts": s + t, "dur": dur, "name": name,
                           "args": {"hlo_op": op, "hlo_module": "jit_train", "name": opname, "correlation_id": 1}})
        events.append({"ph": "X", "pid": dev, "tid": 100, "ts": s, "dur": 2412, "name": "jit_train(5)", "args": {}})
    return {"traceEvents": events}


@pytest.fixture(scope="module")
def gpu():
    return ps.summarize(_gpu_trace(), hlo=ps.parse_hlo(HLO))


def test_window_busy_idle_and_gaps(gpu):
    s = gpu
    assert s["mode"] == "device" and s["module"] == "jit_train" and s["steps"] == 2
    # window 1000..4000 + 2412, 5412 long; busy 2 x (1000 + 500 + 200 + 100 + 400 + 100) = 4600
    assert (s["window_us"], s["busy_us"], s["idle_us"]) == (5412, 4600, 812)
    assert s["kernel_us"] == 4600 and s["overlap_us"] == 0
    # gaps per step: 10, 2, 100; and 588 between the steps
    assert s["gap_buckets"] == {"<2us": {"count": 0, "us": 0.0}, "2-10us": {"count": 2, "us": 4.0},
                                "10-100us": {"count": 2, "us": 20.0}, ">=100us": {"count": 3, "us": 788.0}}
    # (at_us: from the window's start)
    assert s["largest_gaps"][0] == {"us": 588, "after": "loop_add_fusion", "before": "nvjet_hsh_128x128_gemm", "at_us": 2412}
    assert [g["us"] for g in s["largest_gaps"]] == [588, 100, 100, 10, 10]


def test_categories_phases_and_fusion_kinds(gpu):
    cats = {k: (v["us"], v["count"]) for k, v in gpu["categories"].items()}
    assert cats == {ps.MATMUL: (2000, 2), ps.COLLECTIVE: (1000, 2), ps.ELEMENTWISE: (600, 4), ps.ATTENTION: (800, 2),
                    ps.OPTIMIZER: (200, 2), ps.COPY: (0, 0), ps.OTHER: (0, 0)}
    # forward: the dot, the forward mul, the attention (its op_name from the HLO); backward: the
    # all-reduce and the backward mul; outside autodiff: the AdamW add
    assert gpu["phases"] == {ps.FORWARD: 2 * (1000 + 200 + 400), ps.BACKWARD: 2 * (500 + 100), ps.OUTSIDE: 200}
    # both multiply fusions are one kind: the instance numbers .3 and .7 dropped
    assert gpu["fusion_kinds"] == [{"kind": "loop_multiply_fusion", "us": 600, "count": 4}]
    assert gpu["hlo_ops_matched"] == [1, 6] and gpu["devices"] == 1


def test_markdown_per_step_numbers(gpu):
    md = ps.to_markdown(gpu)
    # per step: window 5412 / 2 = 2706 us, busy 2300, idle 406 (812 / 5412 = 15.0%)
    assert "per step: window 2.71 ms = busy 2.30 ms + idle 0.41 ms (15.0% idle); kernel time 2.30 ms" in md
    assert "| matmul | 1.00 | 37.0% | 1 |" in md  # 2000 / 5412 = 36.96%
    assert "| collectives | 0.50 | 18.5% | 1 |" in md  # 1000 / 5412 = 18.48%
    assert "| elementwise/reduction fusions | 0.30 | 11.1% | 2 |" in md  # 600 / 5412 = 11.09%
    assert "| idle (gaps between kernels) | 0.41 | 15.0% | |" in md
    assert "| forward | 1.60 | 59.1% |" in md  # 3200 / 5412 = 59.13%
    assert "| loop_multiply_fusion | 0.30 | 2 |" in md
    # kernel rows: count, count/step, total ms, ms/step, mean us, % of window
    assert "| `nvjet_hsh_128x128_gemm` | matmul | 2 | 1.0 | 2.00 | 1.00 | 1000.0 | 37.0% |" in md
    assert "| `kernel_0` | attention | 2 | 1.0 | 0.80 | 0.40 | 400.0 | 14.8% |" in md  # 800 / 5412
    assert "WARNING: the HLO text names only 1 of the module's 6 ops" in md
    assert "idle gaps: <2us: 0/step, 0.00 ms/step, 2-10us: 1/step, 0.00 ms/step, 10-100us: 1/step, 0.01 ms/step, " \
           ">=100us: 2/step, 0.39 ms/step" in md  # 788 / 2 = 394 us
    assert "- 588 us at +2.41 ms, after `loop_add_fusion`, before `nvjet_hsh_128x128_gemm`" in md
    # the phases from the most time down; --steps 1: per step = the totals, the mean per kernel still /2
    assert md.index("| forward |") < md.index("| backward |") < md.index("| outside autodiff |")
    one = ps.to_markdown(ps.summarize(_gpu_trace(), hlo=ps.parse_hlo(HLO), steps=1))
    assert "| `nvjet_hsh_128x128_gemm` | matmul | 2 | 2.0 | 2.00 | 2.00 | 1000.0 | 37.0% |" in one


def test_phase_rows_ordered_by_time_not_by_first_seen():
    ops = [(1, "fusion.1", 0.0, 5.0, "1", "jit_m", {"name": "jit(f)/adamw/add"}),
           (1, "fusion.2", 5.0, 20.0, "1", "jit_m", {"name": "jit(f)/jvp()/mul"})]
    md = ps.to_markdown(ps.summarize(_host_trace(ops)))
    assert md.index("| forward | 0.02 | 80.0% |") < md.index("| outside autodiff | 0.01 | 20.0% |")


def test_top_tables_rank_by_time_and_cut_at_top():
    s = ps.summarize(_gpu_trace(), hlo=ps.parse_hlo(HLO), top=3)
    assert [(r["name"], r["count"], r["us"]) for r in s["top_kernels"]] == [
        ("nvjet_hsh_128x128_gemm", 2, 2000), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2, 1000), ("kernel_0", 2, 800)]
    ops = {r["hlo_op"]: r for r in s["top_ops"]}
    assert list(ops) == ["dot.1", "all-reduce.2", "custom-call.4"]
    assert ops["custom-call.4"]["op_name"] == "jit(train)/jvp()/dot_product_attention"  # from the HLO
    assert ops["custom-call.4"]["types"] == "f32[8,8] <- f32[8,8]"


def test_gap_after_the_interval_that_ends_last():
    """A(0..10) holds B(2..5); the gap before C(15) follows A, not B (the last to start)."""
    ops = [(1, "fusion.1", 0.0, 10.0), (2, "fusion.2", 2.0, 3.0), (1, "fusion.3", 15.0, 1.0)]
    s = ps.summarize(_host_trace(ops))
    assert s["largest_gaps"] == [{"us": 5.0, "after": "fusion.1", "before": "fusion.3", "at_us": 10.0}]
    assert (s["window_us"], s["busy_us"], s["idle_us"]) == (16.0, 11.0, 5.0)


# ----------------------------------------------------------------------------- host (CPU) traces


def _host_trace(ops, module="jit_m"):
    """(thread, name, ts, dur[, run_id[, module[, extra args]]]) HLO-op events on /host:CPU."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    for tid, name, ts, dur, *rest in ops:
        args = {"hlo_op": name, "hlo_module": rest[1] if len(rest) > 1 else module, "run_id": rest[0] if rest else "1"}
        args.update(rest[2] if len(rest) > 2 else {})
        events.append({"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args})
    return {"traceEvents": events}


def test_steps_count_a_cut_execution_as_the_fraction_seen():
    """Executions of 4 ops; the trace starts inside the first, so 2 of its ops are seen: 2.5 steps."""
    ops = [(1, f"fusion.{k}", 10.0 * k, 5.0, "1") for k in (2, 3)]
    ops += [(1, f"fusion.{k}", 100.0 + 10.0 * k, 5.0, "2") for k in range(4)]
    ops += [(1, f"fusion.{k}", 200.0 + 10.0 * k, 5.0, "3") for k in range(4)]
    s = ps.summarize(_host_trace(ops))
    assert s["steps"] == 2.5 and s["steps_source"] == "3 run_ids of the module's ops, 4 ops each when whole"


def test_followed_module_has_the_most_time_and_others_are_clipped_to_its_window():
    """jit_other has more events (24) but less time (20 + 10 + 10 + 10 + 5 = 55 us) than jit_m
    (2 x 30 us): jit_m is followed. Its window is 100..160; of jit_other's events, 95..105 counts
    5 us, 152..162 counts 8 us, the one ending at 100 and the one starting at 160 none."""
    ops = [(2, f"fusion.{k}", float(k), 1.0, "9", "jit_other") for k in range(20)]
    ops += [(2, "copy.1", 90.0, 10.0, "9", "jit_other"), (2, "copy.2", 95.0, 10.0, "9", "jit_other"),
            (2, "copy.3", 160.0, 5.0, "9", "jit_other"), (2, "copy.4", 152.0, 10.0, "9", "jit_other")]
    ops += [(1, "fusion.1", 100.0, 30.0, "1"), (1, "fusion.1", 130.0, 30.0, "2")]
    s = ps.summarize(_host_trace(ops))
    assert s["module"] == "jit_m" and s["modules_us"] == {"jit_m": 60.0, "jit_other": 55.0}
    assert s["window_us"] == 60.0 and s["events"] == 4
    assert s["other_modules_us"] == 13.0 and s["categories"][ps.OTHER] == {"us": 13.0, "count": 2}
    assert s["busy_us"] == 60.0 and s["kernel_us"] == 73.0  # jit_other's run beside jit_m's, on another thread


def test_control_ops_with_one_span_are_one_inside_the_other():
    """A while and a call spanning the same 0..100 (on two threads) with one body op 10..20: one of
    them is the other's parent, so together they keep 100 - 10 = 90 us; neither may take the other
    as its body op (that had left 0 us to both)."""
    s = ps.summarize(_host_trace([(1, "while.1", 0.0, 100.0), (2, "call.2", 0.0, 100.0), (3, "fusion.3", 10.0, 10.0)]))
    assert s["categories"][ps.OTHER]["us"] == 90.0 and s["categories"][ps.ELEMENTWISE]["us"] == 10.0
    assert s["kernel_us"] == s["busy_us"] == 100.0


def test_equal_starts_the_shorter_event_is_inside():
    line = (1, 1)
    parent, child = ps.Event("p", 0.0, 30.0, line, {}), ps.Event("c", 0.0, 10.0, line, {})
    ps.self_times([parent, child])
    assert (child.self_us, parent.self_us) == (10.0, 20.0)


def test_classification_beyond_kernel_names():
    """What the HLO text says decides where the kernel's name does not: a generic kernel name with
    a cuDNN attention or cuBLAS target, a gemm backend, a control op outside autodiff (other, not
    the optimizer), a plain HLO op (an elementwise op), a collective named by its HLO op."""
    hlo = {
        "custom-call.4": ps.HloInstr("custom-call", "jit(f)/jvp()/attention_op", target="__cudnn$fmhaSoftmax"),
        "custom-call.9": ps.HloInstr("custom-call", "jit(f)/jvp()/dot_general", target="__cublas$lt$matmul"),
        "fusion.2": ps.HloInstr("fusion", "jit(f)/jvp()/f", backend_kind="__triton_gemm"),
        "while.3": ps.HloInstr("while", "jit(f)/while"),
        "add.5": ps.HloInstr("add", "jit(f)/jvp()/add"),
        "all-gather-start.6": ps.HloInstr("all-gather-start", "jit(f)/jvp()/all_gather"),
        "convert.7": ps.HloInstr("convert", "jit(f)/transpose(jvp())/convert"),
    }

    def cls(name, op):
        return ps.classify(ps.Event(name, 0.0, 1.0, (1, 1), {"hlo_op": op}), hlo)

    assert cls("kernel_0", "custom-call.4") == (ps.ATTENTION, ps.FORWARD)
    assert cls("kernel_1", "custom-call.9") == (ps.MATMUL, ps.FORWARD)
    assert cls("kernel_2", "fusion.2") == (ps.MATMUL, ps.FORWARD)
    assert cls("while.3", "while.3") == (ps.OTHER, ps.OUTSIDE)
    assert cls("add.5", "add.5") == (ps.ELEMENTWISE, ps.FORWARD)
    assert cls("kernel_3", "all-gather-start.6") == (ps.COLLECTIVE, ps.FORWARD)
    assert cls("convert.7", "convert.7") == (ps.ELEMENTWISE, ps.BACKWARD)
    assert cls("kernel_5", "loop_exp_fusion.5") == (ps.ELEMENTWISE, ps.UNKNOWN)  # a fusion by its HLO op's name
    # without the HLO text: a name-less op is "other", its phase unknown
    assert ps.classify(ps.Event("kernel_9", 0.0, 1.0, (1, 1), {}), None) == (ps.OTHER, ps.UNKNOWN)


def test_hand_written_kernels_are_not_fusions():
    """A Mosaic GPU custom call (every kernel `anonymous_mosaic_gpu_kernel`) had counted as an
    elementwise fusion once the HLO text was given (it is an HLO instruction): the 1b's flash
    attention, 25-31 ms a step on the H200, among the memory-bound kernels. Its op name decides:
    attention under a flash_attention scope, else other, in or outside autodiff."""
    mosaic = "mosaic_gpu_v2"
    hlo = {
        "mpmd_map.1": ps.HloInstr("custom-call", "jit(f)/jvp(jit(_forward))/flash_attention_fwd/jit(_call)/anonymous/mpmd_map",
                                  target=mosaic),
        "mpmd_map.2": ps.HloInstr("custom-call", "jit(f)/transpose(jvp())/jit(_backward)/flash_attention_bwd/anonymous/mpmd_map",
                                  target=mosaic),
        "mpmd_map.3": ps.HloInstr("custom-call", "jit(f)/jvp()/anonymous/mpmd_map", target=mosaic),
        "mpmd_map.4": ps.HloInstr("custom-call", "jit(step)/anonymous/mpmd_map", target=mosaic),
    }

    def cls(op):
        return ps.classify(ps.Event("anonymous_mosaic_gpu_kernel", 0.0, 1.0, (1, 1), {"hlo_op": op}), hlo)

    assert cls("mpmd_map.1") == (ps.ATTENTION, ps.FORWARD)
    assert cls("mpmd_map.2") == (ps.ATTENTION, ps.BACKWARD)
    assert cls("mpmd_map.3") == (ps.OTHER, ps.FORWARD)
    assert cls("mpmd_map.4") == (ps.OTHER, ps.OUTSIDE)  # not the optimizer: a kernel of our own


# ----------------------------------------------------------------------------- other trace layouts


def test_steps_from_step_trace_annotations():
    """No run_id and no XLA Modules line: the distinct step_num values (3), however many events
    carry each (here 2: one per host thread)."""
    t = _gpu_trace()
    t["traceEvents"] = [e for e in t["traceEvents"] if e.get("tid") != 100]
    for n in range(3):
        for tid in (1, 2):
            t["traceEvents"].append({"ph": "X", "pid": 50, "tid": tid, "ts": 1000.0 * n, "dur": 5.0, "name": "train",
                                     "args": {"step_num": n}})
    s = ps.summarize(t)
    assert s["steps"] == 3 and s["steps_source"] == "StepTraceAnnotation step_num"
    t["traceEvents"] = [e for e in t["traceEvents"] if "step_num" not in e.get("args", {})]
    s = ps.summarize(t)
    assert s["steps"] == 1 and s["steps_source"].startswith("unknown")


def test_tpu_layout_reads_the_xla_ops_line():
    """A TPU device has no Stream lines: its XLA Ops line is the op timeline."""
    events = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:TPU:0"}},
              {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name", "args": {"name": "XLA Ops"}},
              {"ph": "M", "pid": 2, "tid": 4, "name": "thread_name", "args": {"name": "XLA Modules"}}]
    for k, (name, ts, dur) in enumerate((("fusion.1", 0.0, 30.0), ("convolution.2", 40.0, 50.0))):
        events.append({"ph": "X", "pid": 2, "tid": 3, "ts": ts, "dur": dur, "name": name,
                       "args": {"hlo_op": name, "hlo_module": "jit_f"}})
    events.append({"ph": "X", "pid": 2, "tid": 4, "ts": 0.0, "dur": 90.0, "name": "jit_f(1)", "args": {}})
    s = ps.summarize({"traceEvents": events})
    assert s["mode"] == "device" and s["lines"] == ["XLA Ops"] and s["steps"] == 1
    assert s["categories"][ps.MATMUL]["us"] == 50.0 and s["idle_us"] == 10.0


def test_kernel_lines_found_by_cupti_records():
    """Stream lines not named "Stream": the kernels are the device events with a correlation_id."""
    t = _gpu_trace()
    for e in t["traceEvents"]:
        if e.get("name") == "thread_name" and e["args"]["name"].startswith("Stream"):
            e["args"]["name"] = "Compute"
    s = ps.summarize(t)
    assert s["mode"] == "device" and s["lines"] == ["Compute"] and s["busy_us"] == 4600


def test_non_finite_or_negative_times_are_named():
    for ts, dur in ((0.0, -1.0), (float("nan"), 1.0), (0.0, float("inf"))):
        with pytest.raises(ps.ProfileError, match=r"event 'fusion.1' on line \(1, 1\): ts and dur must be finite"):
            ps.summarize(_host_trace([(1, "fusion.1", ts, dur)]))


def test_directory_picks_the_newest_perfetto_trace(tmp_path):
    """Under a directory: the newest perfetto_trace.json.gz, preferred to a newer *.trace.json.gz."""
    def write(rel, module, mtime):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(p, "wt") as f:
            json.dump(_host_trace([(1, "fusion.1", 0.0, 1.0)], module=module), f)
        os.utime(p, (mtime, mtime))
        return p

    newest = write("a/perfetto_trace.json.gz", "jit_new", 2_000_000)
    write("b/perfetto_trace.json.gz", "jit_old", 1_000_000)  # (last by name, not by time)
    write("c/host.trace.json.gz", "jit_other_file", 3_000_000)
    trace, path = ps.load_trace(tmp_path)
    assert path == newest and ps.summarize(trace)["module"] == "jit_new"
