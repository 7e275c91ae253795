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
  worker threads at once, and a `while` op's event encloses its body's ops, which run on its
  thread and on others. Exclusive (self) time is used, so nested events are not counted twice:
  a control-flow op (while/conditional/call) keeps only the time in which no op of its execution
  runs on any thread.

Categories, in this order of precedence: collectives (NCCL kernels, all-reduce/all-gather/
reduce-scatter/all-to-all/collective-permute ops), copy/dynamic-update-slice (memcpy, memset, copy,
transpose and dynamic-update-slice kernels), attention (cuDNN / flash / Pallas attention
kernels, and with --hlo a hand-written kernel's custom call whose op name says attention),
matmul (cuBLAS / cutlass / Triton gemm fusions, dots, convolutions), optimizer
update (what lies outside autodiff: op names without `jvp(` / `transpose(`, i.e. AdamW,
clipping, the gradient norm, the non-finite guard), elementwise/reduction fusions (by fusion
name), other (control flow, other modules, other hand-written kernels' custom calls). Idle is
the part of the profiled window (first to last kernel of the main module) in which no kernel
runs. With several devices (or CPU threads) kernel and category times are summed over them, so
they can exceed the window.

Bad input (a missing or unreadable trace, a trace without kernels, --steps < 1, --top < 0, a
missing --hlo file, an unknown --module, an --md or --json naming an input file or each other)
ends with a message naming it and exit status 2;
the Python API raises ProfileError (a ValueError), or FileNotFoundError for a missing path.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import heapq
import json
import os
import re
import sys
import zlib
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
# (convolution: XLA's opcode for convolutions and, on TPU, for many dots; names like
# `convolution.3` had been "other" without --hlo, though the opcode counts as matmul)
_MATMUL_RE = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|gemv|wgmma|convolution|\bdot\b|^dot[._]|_dot[._]|_dot$", re.I)
_COPY_RE = re.compile(r"memcpy|memset|dynamic[-_]update[-_]slice|^(wrapped_)?copy|^(wrapped_)?transpose|copy[-_]start|copy[-_]done", re.I)
_COLLECTIVE_RE = re.compile(r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|allgather|reduce-scatter|reduce_scatter|"
                            r"reducescatter|all-to-all|all_to_all|alltoall|collective-permute|collective_permute|sendrecv", re.I)
_CONTROL_RE = re.compile(r"^(while|conditional|call)([._]\d+)?$")
_SUFFIX_RE = re.compile(r"([._]\d+)+$")


class ProfileError(ValueError):
    """Input that cannot be summarized (an unreadable or empty trace, HLO text, an argument out of
    range); the message says what is wrong and what is allowed, `field` names the argument if one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


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


def _read_text(p: Path) -> str:
    """A file's text, gunzipped if it is gzip (by its magic bytes, whatever its name)."""
    with open(p, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open if gz else open)(p, "rt", encoding="utf-8") as f:
            return f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as e:
        what = "truncated or corrupt gzip" if gz else "not UTF-8 text"
        raise ProfileError(f"{p}: {what} ({type(e).__name__}: {e})") from e


def load_trace(path: str | os.PathLike) -> tuple[dict, Path]:
    """The trace JSON from a file or the newest perfetto/trace file under a directory."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if p.is_dir():
        found = sorted(p.rglob("perfetto_trace.json.gz"), key=os.path.getmtime) or sorted(
            p.rglob("*.trace.json.gz"), key=os.path.getmtime
        )
        if not found:
            hint = (" (only *.xplane.pb: summarize the *.trace.json.gz or perfetto_trace.json.gz written with it)"
                    if next(p.rglob("*.xplane.pb"), None) else "")
            raise FileNotFoundError(f"no perfetto_trace.json.gz or *.trace.json.gz under {p}{hint}")
        p = found[-1]
    text = _read_text(p)
    try:
        trace = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}: not JSON, or cut short ({e})") from e
    return trace, p


def load_hlo(path: str | os.PathLike) -> dict[str, HloInstr]:
    """parse_hlo of a (possibly gzipped) HLO text file; an error if it holds no instruction."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"HLO text {p}: no such file")
    hlo = parse_hlo(_read_text(p))
    if not hlo:
        raise ProfileError(f"HLO text {p}: no HLO instructions in it (expected the compiled step's "
                           "`.as_text()`, lines like `%dot.1 = bf16[8,4]{1,0} dot(...)`)")
    return hlo


def self_times(events: list[Event]) -> None:
    """Exclusive time of each event on its own line: each instant of a line goes to the innermost
    event running then (the latest to start; of equal starts the shortest), so the self times of a
    line add up to the union of its events however they nest or overlap."""
    by_line = collections.defaultdict(list)
    for e in events:
        e.self_us = 0.0
        by_line[e.line].append(e)
    for evs in by_line.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        points = sorted({e.ts for e in evs} | {e.end for e in evs})
        heap: list = []  # (-start, dur, index): the top is the innermost event
        i = 0
        for a, b in zip(points, points[1:]):
            while i < len(evs) and evs[i].ts <= a:
                heapq.heappush(heap, (-evs[i].ts, evs[i].dur, i))
                i += 1
            while heap and evs[heap[0][2]].end <= a:
                heapq.heappop(heap)
            if heap:
                evs[heap[0][2]].self_us += b - a


def _is_control(e: Event) -> bool:
    return bool(_CONTROL_RE.match(e.hlo_op or e.name))


def control_own_times(events: list[Event]) -> None:
    """Host (CPU) traces: a control-flow op (while/conditional/call) encloses its body's ops, which
    XLA's thunk executor runs on other threads as well as on the op's own. Its own time is what is
    left of it once every op of the same execution (module and run_id) that runs meanwhile on any
    thread is taken out, other than control ops it lies inside (its ancestors)."""
    by_run = collections.defaultdict(list)
    for e in events:
        by_run[(e.module, e.args.get("run_id"))].append(e)
    for evs in by_run.values():
        order = {id(e): k for k, e in enumerate(sorted(evs, key=lambda e: (e.ts, -e.dur)))}
        for c in (e for e in evs if _is_control(e)):
            cover = []
            for o in evs:
                if o is c or o.end <= c.ts or o.ts >= c.end:
                    continue
                inside = o.ts >= c.ts and o.end <= c.end and order[id(o)] > order[id(c)]
                if _is_control(o) and not inside:
                    continue  # a control op around c (or across it): not part of c
                cover.append((max(o.ts, c.ts), min(o.end, c.end)))
            c.self_us = max(c.dur - union_length(cover), 0.0)


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
    if opcode == "custom-call":
        # A hand-written kernel (Pallas, Mosaic GPU): not an XLA fusion. Mosaic GPU names all of
        # its kernels `anonymous_mosaic_gpu_kernel`, so the op's name stack says which it is
        # (scaling's flash attention runs under a `flash_attention_*` named scope).
        return (ATTENTION if _ATTENTION_RE.search(op_name) else OTHER), phase
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
    """Device time by category, phase, kernel and HLO op (see the module docstring). `trace` is the
    Chrome trace JSON (an object with `traceEvents`, or the bare array of events); `steps` > 0
    overrides the count of steps read from the trace; `top` (>= 0) rows of the kernel and op tables."""
    if steps is not None and not (isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps > 0):
        raise ProfileError(f"steps must be a number > 0 (or None: counted from the trace), got {steps!r}", field="steps")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ProfileError(f"top must be an integer >= 0, got {top!r}", field="top")
    events_raw = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events_raw, list):
        raise ProfileError("not a Chrome trace: expected an object with a `traceEvents` list, or a list of events; got "
                           + (f"an object with keys {sorted(trace)[:8]}" if isinstance(trace, dict) else type(trace).__name__))
    norm = []
    for i, ev in enumerate(events_raw):
        if not isinstance(ev, dict):
            raise ProfileError(f"traceEvents[{i}]: not an event object: {ev!r:.80}")
        if not isinstance(ev.get("args"), dict):
            ev = {**ev, "args": {}}
        norm.append(ev)
    events_raw = norm
    procs, threads = {}, {}
    for ev in events_raw:
        if ev.get("ph") != "M":
            continue
        if ev.get("name") == "process_name":
            procs[ev.get("pid")] = str(ev["args"].get("name", ""))
        elif ev.get("name") == "thread_name":
            threads[(ev.get("pid"), ev.get("tid"))] = str(ev["args"].get("name", ""))
    device_pids = {pid for pid, n in procs.items() if _DEVICE_PROCESS.match(n or "")}
    complete = [ev for ev in events_raw if ev.get("ph") == "X" and "dur" in ev]
    stream_lines = {k for k, n in threads.items() if k[0] in device_pids and "Stream" in n}
    if not stream_lines:  # lines whose events are CUPTI kernel records
        stream_lines = {
            (ev.get("pid"), ev.get("tid")) for ev in complete
            if ev.get("pid") in device_pids and ("kernel_details" in ev["args"] or "correlation_id" in ev["args"])
        }
    if not stream_lines:  # TPU-style: the XLA Ops line is the op timeline
        stream_lines = {k for k, n in threads.items() if k[0] in device_pids and n == "XLA Ops"}
    mode = "device" if stream_lines else "host"
    if mode == "device":
        chosen = [ev for ev in complete if (ev.get("pid"), ev.get("tid")) in stream_lines]
    else:
        chosen = [ev for ev in complete if "hlo_op" in ev["args"] and ev.get("pid") not in device_pids]
    events = []
    for ev in chosen:
        try:
            ts, dur = float(ev["ts"]), float(ev["dur"])
        except (KeyError, TypeError, ValueError):
            ts = dur = float("nan")
        if not (ts == ts and dur == dur and abs(ts) != float("inf") and 0 <= dur < float("inf")):
            raise ProfileError(f"event {ev.get('name', '')!r} on line {(ev.get('pid'), ev.get('tid'))}: "
                               f"ts and dur must be finite numbers, dur >= 0; got ts={ev.get('ts')!r}, dur={ev.get('dur')!r}")
        events.append(Event(str(ev.get("name", "")), ts, dur, (ev.get("pid"), ev.get("tid")), ev["args"]))
    if not events:
        raise ProfileError(
            "no kernel or HLO-op events in the trace (no /device:GPU|TPU process with kernel lines, and no host "
            "events with args.hlo_op); processes: " + (", ".join(sorted(set(map(str, procs.values())))) or "none")
        )

    per_module = collections.Counter()
    for e in events:
        if e.module:
            per_module[e.module] += e.dur
    if module is None:
        module = per_module.most_common(1)[0][0] if per_module else ""
    main = [e for e in events if e.module == module] if module else events
    if not main:
        raise ProfileError(f"no events of module {module!r}; modules seen: {sorted(per_module)}", field="module")
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
    if mode == "host":
        control_own_times(inwin)

    # Steps: executions of the main module.
    steps_source = "given"
    if steps is None:
        runs = collections.Counter(e.args.get("run_id") for e in main if e.args.get("run_id") is not None)
        # One event per execution, named `module(program_id)`, on each device's XLA Modules line:
        # the steps are the executions on one device, not the sum over devices.
        module_lines = {k for k, n in threads.items() if n == "XLA Modules"}
        per_device = collections.Counter(
            (ev.get("pid"), ev.get("tid")) for ev in complete
            if (ev.get("pid"), ev.get("tid")) in module_lines and module
            and re.sub(r"\(\d+\)$", "", str(ev.get("name", ""))) == module
        )
        step_marks = {ev.get("args", {}).get("step_num") for ev in complete if "step_num" in ev.get("args", {})}
        if runs:  # an execution cut by the trace's start or end counts as the fraction of its ops seen
            full = max(runs.values())
            steps = round(sum(runs.values()) / full, 2)
            steps_source = f"{len(runs)} run_ids of the module's ops, {full} ops each when whole"
        elif per_device:
            steps = max(per_device.values())
            steps_source = "XLA Modules line" + (f" (of each of {len(per_device)} devices)" if len(per_device) > 1 else "")
        elif step_marks:
            steps, steps_source = len(step_marks), "StepTraceAnnotation step_num"
        else:
            steps, steps_source = 1, "unknown (totals are for the whole window)"

    window = t1 - t0
    busy = union_length((e.ts, e.end) for e in inwin)
    idle = max(window - busy, 0.0)

    cats = {c: {"us": 0.0, "count": 0} for c in CATEGORIES}
    phases = collections.defaultdict(float)
    kinds = collections.defaultdict(lambda: {"us": 0.0, "count": 0})
    # Rows by kernel and by HLO instruction (which dot is which). Instruction names are those of
    # one module, and another module's kernels are not classified: its rows are kept apart.
    kernels: dict[tuple, dict] = {}
    ops: dict[tuple, dict] = {}
    other_modules = 0.0
    for e in inwin:
        foreign = bool(module and e.module and e.module != module)
        if foreign:
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
        mod = e.module if foreign else module
        row = kernels.setdefault((foreign and mod, e.name), {"name": e.name, "module": mod, "category": cat, "count": 0,
                                                            "us": 0.0, "hlo_op": e.hlo_op})
        row["count"] += 1
        row["us"] += e.self_us
        key = e.hlo_op or e.name
        info = hlo.get(e.hlo_op) if hlo and not foreign else None
        row = ops.setdefault((foreign and mod, key), {
            "hlo_op": key, "module": mod, "kernel": e.name, "category": cat, "count": 0, "us": 0.0,
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
    devices = {e.line[0] for e in main} if mode == "device" else {e.args.get("device_ordinal") for e in main}
    main_ops = {e.hlo_op for e in main if e.hlo_op}
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
        "hlo_ops_matched": [sum(op in hlo for op in main_ops), len(main_ops)] if hlo else None,
        "devices": len(devices),  # > 1: times are summed over the devices
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
        + (f", {s['devices']} devices (kernel and category times are summed over them)" if s.get("devices", 1) > 1 else "")
        + ("" if s["hlo"] else "; no HLO text given (op names from the trace only)")
        + (f"; WARNING: the HLO text names only {m[0]} of the module's {m[1]} ops (HLO of another program?)"
           if (m := s.get("hlo_ops_matched")) and m[0] < m[1] else ""),
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
    # Rows of another module than the one followed name it: its op names are its own.
    where = lambda r: f" ({r['module']})" if r.get("module") and r["module"] != s["module"] else ""  # noqa: E731
    if s["top_kernels"]:
        lines += ["", f"top {len(s['top_kernels'])} kernels by total time:", "",
                  "| kernel | category | count | count/step | total ms | ms/step | mean us | % of window |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in s["top_kernels"]:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(
            f"| `{name}`{where(r)} | {r['category']} | {r['count']} | {r['count'] / n:.1f} | {r['us'] / 1e3:.2f} | {ms(r['us'])} "
            f"| {r['us'] / max(r['count'], 1):.1f} | {pct(r['us'])} |"
        )
    if s["top_ops"]:
        lines += ["", f"top {len(s['top_ops'])} HLO ops by total time (op_name: JAX's name stack, `transpose(...)` = backward):", "",
                  "| HLO op | kernel | category | count/step | ms/step | types (result <- operands) | op_name |",
                  "|---|---|---|---|---|---|---|"]
    for r in s["top_ops"]:
        kernel = r["kernel"] if len(r["kernel"]) <= 60 else r["kernel"][:57] + "..."
        op_name = r["op_name"] if len(r["op_name"]) <= 90 else "..." + r["op_name"][-87:]
        types = r["types"] if len(r["types"]) <= 80 else r["types"][:77] + "..."
        lines.append(f"| `{r['hlo_op']}`{where(r)} | `{kernel}` | {r['category']} | {r['count'] / n:.1f} | {ms(r['us'])} | {types} | `{op_name}` |")
    gb = s["gap_buckets"]
    lines += ["", "idle gaps: " + ", ".join(f"{k}: {v['count'] / n:.0f}/step, {ms(v['us'])} ms/step" for k, v in gb.items())]
    for g in s["largest_gaps"]:
        lines.append(f"- {g['us']:.0f} us at +{g['at_us'] / 1e3:.2f} ms, after `{g['after'][:60]}`, before `{g['before'][:60]}`")
    return "\n".join(lines) + "\n"


def summarize_path(trace_path, hlo_path=None, steps=None, module=None, top=20) -> tuple[dict, Path]:
    trace, path = load_trace(trace_path)
    hlo = load_hlo(hlo_path) if hlo_path else None
    s = summarize(trace, hlo=hlo, steps=steps, module=module, top=top)
    s["trace"] = str(path)
    return s, path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scaling.profile_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="perfetto_trace.json.gz, *.trace.json.gz, or a directory holding one")
    p.add_argument("--hlo", default=None, help="compiled HLO text of the step (op names, fused opcodes)")
    p.add_argument("--steps", type=int, default=None, help="steps in the trace, >= 1 (default: counted from it)")
    p.add_argument("--module", default=None, help="HLO module to follow (default: the one with most time)")
    p.add_argument("--top", type=int, default=20, help="rows of the kernel and HLO-op tables, >= 0 (0: no tables)")
    p.add_argument("--md", default=None, help="write the markdown summary here")
    p.add_argument("--json", default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)
    # Bad input: a message naming the flag and exit status 2 (p.error), never a traceback.
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be an integer >= 1 (the steps the trace holds), got {args.steps}")
    if args.top < 0:
        p.error(f"--top must be an integer >= 0 (rows of the kernel/op tables), got {args.top}")
    for flag, dest in (("--md", args.md), ("--json", args.json)):
        if dest and Path(dest).is_dir():
            p.error(f"{flag} {dest}: is a directory; give a file name")
    if args.md and args.json and Path(args.md).resolve() == Path(args.json).resolve():
        p.error(f"--md and --json: both name {args.md}; the second would overwrite the first")
    try:
        hlo = load_hlo(args.hlo) if args.hlo else None
    except (OSError, ProfileError) as e:
        p.error(f"--hlo: {e}")
    try:
        trace, path = load_trace(args.trace)
    except (OSError, ProfileError) as e:
        p.error(f"TRACE: {e}")
    for flag, dest in (("--md", args.md), ("--json", args.json)):
        for what, src in (("the trace", path), ("the --hlo file", args.hlo)):
            if dest and src and Path(dest).resolve() == Path(src).resolve():  # the summary would overwrite it
                p.error(f"{flag} {dest}: is {what} being read; give another file name")
    try:
        s = summarize(trace, hlo=hlo, steps=args.steps, module=args.module, top=args.top)
    except ProfileError as e:
        p.error(f"{f'--{e.field}' if e.field else f'TRACE {path}'}: {e}")
    s["trace"] = str(path)
    md = to_markdown(s, title=f"profile: {path}")
    print(md)
    for flag, dest, text in (("--md", args.md, md), ("--json", args.json, json.dumps(s, indent=1))):
        if dest:
            try:
                Path(dest).parent.mkdir(parents=True, exist_ok=True)
                Path(dest).write_text(text)
            except OSError as e:
                p.error(f"{flag} {dest}: cannot write it ({e.strerror or e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
