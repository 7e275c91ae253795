"""Where the device time goes, read from a JAX profiler trace with the standard library alone.

    python -m scaling.profile_summary TRACE [--hlo step.hlo.txt] [--steps N] [--top 20] [--md F] [--json F]

TRACE is a `perfetto_trace.json.gz` (what `jax.profiler.start_trace(dir, create_perfetto_trace=True)`
writes), a `*.trace.json.gz` from the same folder, or a directory searched for the newest of them.
No TensorBoard or xprof is needed: both files are Chrome trace-event JSON, `{"traceEvents": [...]}`.

How the trace is laid out (jax 0.11, XLA's profiler, read from its exporter):
- Metadata events (`"ph": "M"`) name each process (`process_name`) and thread (`thread_name`).
  A device is a process named `/device:GPU:0` (TPU alike); the host is `/host:CPU` (and
  `/host:CUPTI` for CUDA driver calls).
- GPU kernels and memcpys are complete events (`"ph": "X"`, `ts`/`dur` in microseconds) on the
  device's `Stream #N(...)` threads, named by the (demangled) kernel name: XLA's own fusions
  carry the fusion's name (`loop_multiply_fusion_2`, `input_reduce_fusion`), libraries their
  kernel names (cuBLAS `nvjet_*` / `sm90_xmma_gemm_*` / `cutlass*`, cuDNN `cudnn_generated_*sdpa*`),
  Pallas/Triton kernels the `pallas_call` name. XLA's launch annotation adds `args`: `hlo_op`
  (the HLO instruction), `hlo_module`, `program_id` and `name` (the JAX op_name minus the
  module's common prefix, e.g. `transpose(jvp())/.../dot_general`). While profiling, XLA runs
  CUDA-graph command buffers op by op, so every kernel carries its own annotation.
- The same device process holds derived lines (`XLA Ops`, `XLA Modules`, `Steps`, ...) that
  repeat the kernels' time per HLO op / module / step: they are not counted (that would
  double-count), only used to count module executions.
- On CPU there is no device process: XLA's thunk executor records each HLO op it runs as a
  host event with `args.hlo_op`, `hlo_module` and `run_id` (one per execution), on several
  worker threads at once, and a `while` op's event encloses its body's ops. Exclusive (self)
  time is used, so nested events are not counted twice.

Categories, in this order of precedence: collectives (NCCL kernels, all-reduce/all-gather/
reduce-scatter/all-to-all/collective-permute ops), copy/dynamic-update-slice (memcpy, memset, copy,
transpose and dynamic-update-slice kernels), attention (cuDNN / flash / Pallas attention
kernels), matmul (cuBLAS / cutlass / Triton gemm fusions, dots), optimizer update (what lies
outside autodiff: op names without `jvp(` / `transpose(`, i.e. AdamW, clipping, the gradient
norm, the non-finite guard), elementwise/reduction fusions (by fusion name), other (control
flow, other modules). Idle is the part of the profiled window (first to last kernel of the
main module) in which no kernel runs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import os
import re
import sys
from pathlib import Path

MATMUL = "matmul"
ATTENTION = "attention"
ELEMENTWISE = "elementwise/reduction fusions"
COPY = "copy/dynamic-update-slice"
COLLECTIVE = "collectives"
OPTIMIZER = "optimizer update (outside autodiff)"
OTHER = "other"
CATEGORIES = (MATMUL, ATTENTION, ELEMENTWISE, COPY, COLLECTIVE, OPTIMIZER, OTHER)

FORWARD, BACKWARD, OUTSIDE, UNKNOWN = "forward", "backward", "outside autodiff", "unknown"

_DEVICE_PROCESS = re.compile(r"^/device:(GPU|TPU)", re.I)
_ATTENTION_RE = re.compile(r"cudnn|fmha|sdpa|flash|attention|\bmha", re.I)
_MATMUL_RE = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|gemv|wgmma|\bdot\b|^dot[._]|_dot[._]|_dot$", re.I)
_COPY_RE = re.compile(r"memcpy|memset|dynamic[-_]update[-_]slice|^(wrapped_)?copy|^(wrapped_)?transpose|copy[-_]start|copy[-_]done", re.I)
_COLLECTIVE_RE = re.compile(r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|allgather|reduce-scatter|reduce_scatter|"
                            r"reducescatter|all-to-all|all_to_all|alltoall|collective-permute|collective_permute|sendrecv", re.I)
_CONTROL_RE = re.compile(r"^(while|conditional|call)([._]\d+)?$")
_SUFFIX_RE = re.compile(r"([._]\d+)+$")


# ----------------------------------------------------------------------------- HLO text


@dataclasses.dataclass
class HloInstr:
    opcode: str
    op_name: str = ""
    target: str = ""  # custom_call_target
    fused_ops: frozenset = frozenset()  # opcodes inside the called (fused) computations
    backend_kind: str = ""  # e.g. __triton_gemm, __cudnn$fusion
    type: str = ""  # result type, e.g. bf16[16384,2048]{1,0}
    operands: tuple = ()  # operand instruction names

    def signature(self, instrs: dict) -> str:
        """result <- operand types, without layouts: shows an f32 matmul that should be bf16."""
        strip = lambda t: re.sub(r"\{[^}]*\}", "", t)  # noqa: E731
        ins = [strip(instrs[o].type) for o in self.operands if o in instrs]
        return f"{strip(self.type)} <- {', '.join(ins)}" if ins else strip(self.type)


_INSTR_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")


def _split_type(rest: str) -> tuple[str, str]:
    """(the leading result type, possibly a parenthesised tuple; the remainder)."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :]
        return rest, ""
    parts = rest.split(" ", 1)
    return (parts[0], parts[1]) if len(parts) == 2 else (rest, "")


def _operand_names(after_opcode: str) -> tuple:
    """Names inside the operand list's parentheses (which may hold nested ones)."""
    depth = 0
    for i, ch in enumerate(after_opcode):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return tuple(re.findall(r"%([\w.\-]+)", after_opcode[: i + 1]))
    return ()


def parse_hlo(text: str) -> dict[str, HloInstr]:
    """Instruction name -> opcode, op_name metadata, custom-call target, fused opcodes."""
    instrs: dict[str, HloInstr] = {}
    comp_ops: dict[str, set] = collections.defaultdict(set)
    calls: dict[str, list[str]] = {}
    comp = None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            m = _COMP_RE.match(line)
            comp = m.group(1) if m else None
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        name, rest = m.groups()
        rtype, tail = _split_type(rest)
        op = re.match(r"\s*([\w\-$]+)\(", tail)
        if not op:
            continue
        ins = HloInstr(opcode=op.group(1), type=rtype, operands=_operand_names(tail[op.end() - 1 :]))
        if (md := re.search(r'op_name="([^"]*)"', rest)) is not None:
            ins.op_name = md.group(1)
        if (t := re.search(r'custom_call_target="([^"]*)"', rest)) is not None:
            ins.target = t.group(1)
        if (k := re.search(r'"kind":"([^"]*)"', rest)) is not None:
            ins.backend_kind = k.group(1)
        called = re.findall(r"calls=\{?([^},]+(?:,\s*%?[^},]+)*)\}?", rest)
        if called:
            calls[name] = [c.strip().lstrip("%") for c in called[0].split(",")]
        instrs[name] = ins
        if comp is not None:
            comp_ops[comp].add(ins.opcode)
    for name, comps in calls.items():
        ops: set = set()
        for c in comps:
            ops |= comp_ops.get(c, set())
        instrs[name].fused_ops = frozenset(ops)
    return instrs


# ----------------------------------------------------------------------------- events


@dataclasses.dataclass
class Event:
    name: str
    ts: float  # microseconds
    dur: float
    line: tuple  # (pid, tid)
    args: dict
    self_us: float = 0.0

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def hlo_op(self) -> str:
        return str(self.args.get("hlo_op", ""))

    @property
    def module(self) -> str:
        return str(self.args.get("hlo_module", ""))


def load_trace(path: str | os.PathLike) -> tuple[dict, Path]:
    """The trace JSON from a file or the newest perfetto/trace file under a directory."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.rglob("perfetto_trace.json.gz"), key=os.path.getmtime) or sorted(
            p.rglob("*.trace.json.gz"), key=os.path.getmtime
        )
        if not found:
            raise FileNotFoundError(f"no perfetto_trace.json.gz or *.trace.json.gz under {p}")
        p = found[-1]
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        return json.load(f), p


def self_times(events: list[Event]) -> None:
    """Exclusive time of each event on its own line (children nested in time are subtracted)."""
    by_line = collections.defaultdict(list)
    for e in events:
        by_line[e.line].append(e)
    for evs in by_line.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[Event] = []
        for e in evs:
            e.self_us = e.dur
            while stack and stack[-1].end <= e.ts:
                stack.pop()
            if stack:  # nested in stack[-1]: its time is not the parent's own
                parent = stack[-1]
                parent.self_us -= min(e.end, parent.end) - e.ts
            stack.append(e)
        for e in evs:
            e.self_us = max(e.self_us, 0.0)


def union_length(intervals) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


# ----------------------------------------------------------------------------- classification


def phase_of(op_name: str) -> str:
    if not op_name:
        return UNKNOWN
    if "transpose(" in op_name:
        return BACKWARD
    if "jvp(" in op_name:
        return FORWARD
    return OUTSIDE


def classify(e: Event, hlo: dict[str, HloInstr] | None) -> tuple[str, str]:
    """(category, phase) of one kernel / op event."""
    name, op = e.name, e.hlo_op
    info = hlo.get(op) if hlo else None
    # The HLO's op_name metadata if given, else the launch annotation's `name` (GPU).
    op_name = info.op_name if info and info.op_name else str(e.args.get("name", ""))
    phase = phase_of(op_name)
    base = _SUFFIX_RE.sub("", op) if op else name
    target = info.target if info else ""
    fused = info.fused_ops if info else frozenset()
    opcode = info.opcode if info else ""

    if _COLLECTIVE_RE.search(name) or _COLLECTIVE_RE.search(base):
        return COLLECTIVE, phase
    if _COPY_RE.search(name) or _COPY_RE.search(base) or opcode in ("copy", "transpose", "dynamic-update-slice", "copy-start", "copy-done"):
        return COPY, phase
    if _ATTENTION_RE.search(name) or _ATTENTION_RE.search(target):
        return ATTENTION, phase
    if (
        _MATMUL_RE.search(name)
        or _MATMUL_RE.search(base)
        or opcode in ("dot", "convolution")
        or "dot" in fused
        or "convolution" in fused
        or re.search(r"cublas|gemm|matmul", target, re.I)
        or "gemm" in (info.backend_kind if info else "")
    ):
        return MATMUL, phase
    if _CONTROL_RE.match(op or name):
        return OTHER, phase
    if phase == OUTSIDE:
        return OPTIMIZER, phase
    if "fusion" in name or "fusion" in base or opcode in ("fusion", "reduce", "reduce-window", "scatter", "gather", "select-and-scatter") or info is not None or base.startswith("wrapped_"):
        return ELEMENTWISE, phase
    return OTHER, phase


def fusion_kind(e: Event) -> str:
    """A fusion's name without its instance number: loop_multiply_fusion.3 -> loop_multiply_fusion."""
    return _SUFFIX_RE.sub("", e.hlo_op or e.name)


# ----------------------------------------------------------------------------- summary


def summarize(
    trace: dict,
    *,
    hlo: dict[str, HloInstr] | None = None,
    steps: int | None = None,
    module: str | None = None,
    top: int = 20,
) -> dict:
    events_raw = trace.get("traceEvents", [])
    procs, threads = {}, {}
    for ev in events_raw:
        if ev.get("ph") != "M":
            continue
        if ev.get("name") == "process_name":
            procs[ev.get("pid")] = ev.get("args", {}).get("name", "")
        elif ev.get("name") == "thread_name":
            threads[(ev.get("pid"), ev.get("tid"))] = ev.get("args", {}).get("name", "")
    device_pids = {pid for pid, n in procs.items() if _DEVICE_PROCESS.match(n or "")}
    complete = [ev for ev in events_raw if ev.get("ph") == "X" and "dur" in ev]
    stream_lines = {k for k, n in threads.items() if k[0] in device_pids and "Stream" in n}
    if not stream_lines:  # lines whose events are CUPTI kernel records
        stream_lines = {
            (ev.get("pid"), ev.get("tid")) for ev in complete
            if ev.get("pid") in device_pids and ("kernel_details" in ev.get("args", {}) or "correlation_id" in ev.get("args", {}))
        }
    if not stream_lines:  # TPU-style: the XLA Ops line is the op timeline
        stream_lines = {k for k, n in threads.items() if k[0] in device_pids and n == "XLA Ops"}
    mode = "device" if stream_lines else "host"
    if mode == "device":
        chosen = [ev for ev in complete if (ev.get("pid"), ev.get("tid")) in stream_lines]
    else:
        chosen = [
            ev for ev in complete if "hlo_op" in ev.get("args", {}) and ev.get("pid") not in device_pids
        ]
    events = [
        Event(ev.get("name", ""), float(ev["ts"]), float(ev["dur"]), (ev.get("pid"), ev.get("tid")), ev.get("args", {}) or {})
        for ev in chosen
    ]
    if not events:
        raise ValueError(
            "no kernel or HLO-op events found; processes: "
            + ", ".join(sorted(set(map(str, procs.values()))))
        )

    per_module = collections.Counter()
    for e in events:
        if e.module:
            per_module[e.module] += e.dur
    if module is None:
        module = per_module.most_common(1)[0][0] if per_module else ""
    main = [e for e in events if e.module == module] if module else events
    if not main:
        raise ValueError(f"no events of module {module!r}; modules seen: {sorted(per_module)}")
    t0 = min(e.ts for e in main)
    t1 = max(e.end for e in main)
    # Everything that ran on the op timeline inside the window counts: it occupied the device.
    inwin = [e for e in events if e.end > t0 and e.ts < t1]
    for e in inwin:  # clip to the window
        if e.ts < t0:
            e.dur -= t0 - e.ts
            e.ts = t0
        if e.end > t1:
            e.dur = t1 - e.ts
    self_times(inwin)

    # Steps: executions of the main module.
    steps_source = "given"
    if steps is None:
        runs = collections.Counter(e.args.get("run_id") for e in main if e.args.get("run_id") is not None)
        module_lines = {k for k, n in threads.items() if n == "XLA Modules"}
        module_line = [
            ev for ev in complete
            if (ev.get("pid"), ev.get("tid")) in module_lines and module and str(ev.get("name", "")).startswith(module)
        ]
        step_marks = {ev.get("args", {}).get("step_num") for ev in complete if "step_num" in ev.get("args", {})}
        if runs:  # an execution cut by the trace's start or end counts as the fraction of its ops seen
            full = max(runs.values())
            steps = round(sum(runs.values()) / full, 2)
            steps_source = f"{len(runs)} run_ids of the module's ops, {full} ops each when whole"
        elif module_line:
            steps, steps_source = len(module_line), "XLA Modules line"
        elif step_marks:
            steps, steps_source = len(step_marks), "StepTraceAnnotation step_num"
        else:
            steps, steps_source = 1, "unknown (totals are for the whole window)"
    steps = steps if steps > 0 else 1

    window = t1 - t0
    busy = union_length((e.ts, e.end) for e in inwin)
    idle = max(window - busy, 0.0)

    cats = {c: {"us": 0.0, "count": 0} for c in CATEGORIES}
    phases = collections.defaultdict(float)
    kinds = collections.defaultdict(lambda: {"us": 0.0, "count": 0})
    kernels: dict[str, dict] = {}
    ops: dict[str, dict] = {}  # by HLO instruction: which dot is which
    other_modules = 0.0
    for e in inwin:
        if module and e.module and e.module != module:
            cat, ph = OTHER, UNKNOWN
            other_modules += e.self_us
        else:
            cat, ph = classify(e, hlo)
        cats[cat]["us"] += e.self_us
        cats[cat]["count"] += 1
        phases[ph] += e.self_us
        if cat == ELEMENTWISE:
            k = kinds[fusion_kind(e)]
            k["us"] += e.self_us
            k["count"] += 1
        row = kernels.setdefault(e.name, {"name": e.name, "category": cat, "count": 0, "us": 0.0, "hlo_op": e.hlo_op})
        row["count"] += 1
        row["us"] += e.self_us
        key = e.hlo_op or e.name
        info = hlo.get(e.hlo_op) if hlo else None
        row = ops.setdefault(key, {"hlo_op": key, "kernel": e.name, "category": cat, "count": 0, "us": 0.0,
                                   "op_name": (info.op_name if info and info.op_name else str(e.args.get("name", ""))),
                                   "types": info.signature(hlo) if info else ""})
        row["count"] += 1
        row["us"] += e.self_us

    # Idle gaps between consecutive busy intervals.
    merged = []
    for s, en, nm in sorted((e.ts, e.end, e.name) for e in inwin):
        if merged and s <= merged[-1][1]:
            if en > merged[-1][1]:
                merged[-1] = [merged[-1][0], en, merged[-1][2], nm]
        else:
            merged.append([s, en, nm, nm])  # start, end, first name, last name
    gaps = [(merged[i + 1][0] - merged[i][1], merged[i][3], merged[i + 1][2], merged[i][1] - t0) for i in range(len(merged) - 1)]
    buckets = {"<2us": [0, 0.0], "2-10us": [0, 0.0], "10-100us": [0, 0.0], ">=100us": [0, 0.0]}
    for g, *_ in gaps:
        b = "<2us" if g < 2 else "2-10us" if g < 10 else "10-100us" if g < 100 else ">=100us"
        buckets[b][0] += 1
        buckets[b][1] += g
    largest = sorted(gaps, reverse=True)[:5]

    total_self = sum(c["us"] for c in cats.values())
    return {
        "mode": mode,
        "processes": sorted(set(map(str, procs.values()))),
        "lines": sorted({threads.get(e.line, str(e.line)) for e in inwin}),
        "module": module,
        "modules_us": dict(per_module),
        "steps": steps,
        "steps_source": steps_source,
        "window_us": window,
        "busy_us": busy,
        "idle_us": idle,
        "kernel_us": total_self,  # > busy when ops overlap (several streams / CPU threads)
        "overlap_us": total_self - busy,
        "other_modules_us": other_modules,
        "events": len(inwin),
        "categories": cats,
        "phases": dict(phases),
        "fusion_kinds": sorted(({"kind": k, **v} for k, v in kinds.items()), key=lambda r: -r["us"]),
        "top_kernels": sorted(kernels.values(), key=lambda r: -r["us"])[:top],
        "top_ops": sorted(ops.values(), key=lambda r: -r["us"])[:top],
        "gap_buckets": {k: {"count": v[0], "us": v[1]} for k, v in buckets.items()},
        "largest_gaps": [{"us": g, "after": a, "before": b, "at_us": at} for g, a, b, at in largest],
        "hlo": bool(hlo),
    }


def to_markdown(s: dict, title: str = "profile") -> str:
    n = s["steps"]
    ms = lambda us: f"{us / n / 1e3:.2f}"  # noqa: E731  per step, ms
    pct = lambda us: f"{us / s['window_us']:.1%}" if s["window_us"] else "-"  # noqa: E731
    lines = [
        f"## {title}",
        "",
        f"processes: {', '.join(s['processes'])}",
        "",
        f"{s['mode']} timeline: {', '.join(s['lines'][:6])}{' ...' if len(s['lines']) > 6 else ''}; "
        f"module `{s['module']}`, {n} step(s) ({s['steps_source']}), {s['events']} events"
        + ("" if s["hlo"] else "; no HLO text given (op names from the trace only)"),
        "",
        f"per step: window {ms(s['window_us'])} ms = busy {ms(s['busy_us'])} ms + idle {ms(s['idle_us'])} ms"
        f" ({pct(s['idle_us'])} idle); kernel time {ms(s['kernel_us'])} ms"
        + (f" (overlap between streams/threads {ms(s['overlap_us'])} ms)" if s["overlap_us"] > 0.01 * s["window_us"] else ""),
        "",
        "| category | ms/step | % of window | events/step |",
        "|---|---|---|---|",
    ]
    for c in CATEGORIES:
        v = s["categories"][c]
        lines.append(f"| {c} | {ms(v['us'])} | {pct(v['us'])} | {v['count'] / n:.0f} |")
    lines.append(f"| idle (gaps between kernels) | {ms(s['idle_us'])} | {pct(s['idle_us'])} | |")
    lines.append(f"| **window** | **{ms(s['window_us'])}** | 100% | |")
    lines += ["", "| phase (from op names) | ms/step | % of window |", "|---|---|---|"]
    for ph, us in sorted(s["phases"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {ph} | {ms(us)} | {pct(us)} |")
    if s["fusion_kinds"]:
        lines += ["", "| elementwise/reduction fusion kind | ms/step | events/step |", "|---|---|---|"]
        for r in s["fusion_kinds"][:12]:
            lines.append(f"| {r['kind']} | {ms(r['us'])} | {r['count'] / n:.0f} |")
    lines += ["", f"top {len(s['top_kernels'])} kernels by total time:", "",
              "| kernel | category | count | count/step | total ms | ms/step | mean us | % of window |",
              "|---|---|---|---|---|---|---|---|"]
    for r in s["top_kernels"]:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(
            f"| `{name}` | {r['category']} | {r['count']} | {r['count'] / n:.1f} | {r['us'] / 1e3:.2f} | {ms(r['us'])} "
            f"| {r['us'] / max(r['count'], 1):.1f} | {pct(r['us'])} |"
        )
    lines += ["", f"top {len(s['top_ops'])} HLO ops by total time (op_name: JAX's name stack, `transpose(...)` = backward):", "",
              "| HLO op | kernel | category | count/step | ms/step | types (result <- operands) | op_name |",
              "|---|---|---|---|---|---|---|"]
    for r in s["top_ops"]:
        kernel = r["kernel"] if len(r["kernel"]) <= 60 else r["kernel"][:57] + "..."
        op_name = r["op_name"] if len(r["op_name"]) <= 90 else "..." + r["op_name"][-87:]
        types = r["types"] if len(r["types"]) <= 80 else r["types"][:77] + "..."
        lines.append(f"| `{r['hlo_op']}` | `{kernel}` | {r['category']} | {r['count'] / n:.1f} | {ms(r['us'])} | {types} | `{op_name}` |")
    gb = s["gap_buckets"]
    lines += ["", "idle gaps: " + ", ".join(f"{k}: {v['count'] / n:.0f}/step, {ms(v['us'])} ms/step" for k, v in gb.items())]
    for g in s["largest_gaps"]:
        lines.append(f"- {g['us']:.0f} us at +{g['at_us'] / 1e3:.2f} ms, after `{g['after'][:60]}`, before `{g['before'][:60]}`")
    return "\n".join(lines) + "\n"


def summarize_path(trace_path, hlo_path=None, steps=None, module=None, top=20) -> tuple[dict, Path]:
    trace, path = load_trace(trace_path)
    hlo = None
    if hlo_path:
        opener = gzip.open if str(hlo_path).endswith(".gz") else open
        with opener(hlo_path, "rt") as f:
            hlo = parse_hlo(f.read())
    s = summarize(trace, hlo=hlo, steps=steps, module=module, top=top)
    s["trace"] = str(path)
    return s, path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scaling.profile_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="perfetto_trace.json.gz, *.trace.json.gz, or a directory holding one")
    p.add_argument("--hlo", default=None, help="compiled HLO text of the step (op names, fused opcodes)")
    p.add_argument("--steps", type=int, default=None, help="steps in the trace (default: counted from it)")
    p.add_argument("--module", default=None, help="HLO module to follow (default: the one with most time)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--md", default=None, help="write the markdown summary here")
    p.add_argument("--json", default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    s, path = summarize_path(args.trace, args.hlo, args.steps, args.module, args.top)
    md = to_markdown(s, title=f"profile: {path}")
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
