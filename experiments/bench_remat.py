"""Remat policies on one device: peak memory and step time, measured vs predicted, and the
largest batch each policy fits. One invocation produces the whole table of docs/benchmarks.md.

    python experiments/bench_remat.py --out DIR --budget-s 555      # 1b, bf16, batch 4 x 2048 (GPU, ~9.5 min)
    python experiments/bench_remat.py --model tiny --seq 128 --batch 2 --steps 2 \\
        --capacity-gib 0.05 --budget-s 400 --out /tmp/bench_remat    # CPU smoke run

What runs, in child processes (the parent never touches the accelerator: it runs JAX on the
CPU for the predictions, so every child gets the whole device):
  1. calibrate: the achievable rates the calibrated prediction divides by, measured in this
     run, each on its own kernels (none fitted to a training step): the layer's bf16 matmuls
     forward + backward at the benchmark's token count (x @ W, dx, dW for the q/k/v/o and
     SwiGLU shapes; the prediction at that rate in its own column), a square 8192^3 matmul
     (the rate the prediction uses, as the hardware table does), the one-pass loss's f32
     head-backward matmuls (TF32), a device copy (x * 2, read + write, 1 GiB; 4 GiB beside it,
     the size docs/decoding.md used), the model's own
     attention core forward + backward at the benchmark's shapes (TFLOP/s counted as 3 x the
     causal forward, the accounting's convention), and device -> pinned host -> device inside
     one compiled program, as remat offload does it (`host` in calibrate() says how).
  2. one child per policy (none, full, dots, names, offload, selective): compile the train
     step at --batch, XLA's memory_analysis, --steps timed steps, peak_bytes_in_use; then the
     largest batch that fits: start from the planner's prediction (scaling.accounting with
     the device's real byte limit), probe with compile-only memory_analysis (which equals the
     measured peak on the GPU: docs/benchmarks.md), bracket the boundary (on a GPU with
     autotuning off, then checked with the normal, autotuned compile: `search` says why),
     and run one real step at the batch found. A policy the backend cannot run (offload
     without a pinned_host memory space) is reported as an error row, not a crash.
The children report each measurement, probe and step as a JSON line the moment it is done,
so a child stopped at its deadline keeps what it learned (a partial bracket: "≥ 124, < 128").
Budget (--budget-s, the whole run, wall clock): calibration, then every policy still to run
is given its measurement (the time the earlier ones took) and an equal share of the rest for
its search; policies run cheapest search first (the planner's largest batch ascending), so a
search that ends early leaves its time to the costlier ones. What it cuts is in the table.

Predictions (scaling.accounting): peak bytes (training_memory: the largest of the step's
phases), the calibrated step time (training_time: matmuls / measured matmul rate + attention /
measured attention rate + memory-bound traffic / measured copy bandwidth; offload's host
transfers / measured host rate, added to the rest as StepTime does, the overlapped max
beside it) and the book's roofline (training_roofline: datasheet peaks, perfect overlap).
MFU = model FLOPs / (datasheet peak x measured step time), as in docs/benchmarks.md.

Writes bench_remat.md and bench_remat.json into --out (default $OUT if set); with
--peak-buffers also peak_buffers_<policy>.txt: the buffers live at the step's memory peak,
from XLA's buffer-assignment dump (what checks the accounting's phase model on the device).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from remat_report import report
from remat_search import bracket, inferred_over, largest_cell, next_probe, summarize_search, usage

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("none", "full", "dots", "names", "offload", "selective")
# names: keep the q/k/v and out projections only (the attention side of `selective`).
# offload: the projections `selective` keeps on the device go to pinned host memory instead.
NAMES = {"names": ("query_proj", "key_proj", "value_proj", "out_proj"),
         "offload": ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up")}
GiB = 2**30
T0 = time.time()  # the budget counts from the parent's start
FINAL_S = 10.0  # kept back from the budget for the predictions and the table, after the last child
MEASURE_S = 30.0  # a child's start-up + compile + timed steps, until one has been observed
_ENV = dict(os.environ)  # the children's environment (the parent switches itself to the CPU)


def presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / "models").glob("*.yaml"))


def model_source(model: str) -> Path:
    """A preset name (configs/models/<model>.yaml) or a config file's path."""
    path = ROOT / "configs" / "models" / f"{model}.yaml"
    return path if path.exists() else Path(model)


COMPUTE_DTYPES = ("bfloat16", "float32")
_compute_dtype = "bfloat16"  # --compute-dtype (main sets it, and passes it on to the children)


def make_config(model: str, policy: str, batch: int, seq: int, steps: int = 10):
    from scaling.config import load_config

    src = model_source(model)
    seq = min(seq, load_config(src).model.max_seq_len)
    overrides = [
        f"--model.compute_dtype={_compute_dtype}", f"--train.batch_size={batch}", f"--train.seq_len={seq}",
        f"--train.steps={steps + 1}", f"--remat.policy={policy}", "--mesh.data=1", "--mesh.fsdp=1", "--mesh.tensor=1",
        "--data.source=synthetic", "--checkpoint.enabled=false",
    ]
    if policy in NAMES:
        overrides.append(f"--remat.names=[{', '.join(NAMES[policy])}]")
    return load_config(src, overrides)


def emit(kind: str, **kw) -> None:
    print(json.dumps({"kind": kind, **kw}), flush=True)


def _timed(fn, reps: int) -> float:
    """Seconds per call of `reps` calls queued back to back (one sync at the end)."""
    import jax

    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    out = [fn() for _ in range(reps)]
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


# ------------------------------------------------------------------------- calibrate


def calibrate(args) -> None:
    """Each rate on its own kernels; a failed measurement is reported and the parent falls back
    to the hardware table's default for it."""
    import jax
    import jax.numpy as jnp

    from scaling import accounting as acc
    from scaling.attention import attention_core, resolve_impl
    from scaling.config import AttentionImpl

    dev = jax.devices()[0]
    cpu = jax.default_backend() == "cpu"
    out = {"device": dev.device_kind, "backend": jax.default_backend(), "jax": jax.__version__}
    cfg = make_config(args.model, "none", args.batch, args.seq)
    m, t = cfg.model, cfg.train.seq_len
    bt = cfg.train.batch_size * t
    d, f, v = m.hidden_size, m.mlp_dim, m.vocab_size
    nh, kh, hd = m.num_heads, m.num_kv_heads, m.resolved_head_dim

    def measure(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - e.g. no pinned_host memory space
            out[name + "_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]

    def square():
        n = out["matmul_n"] = 1024 if cpu else 8192
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
        mm = jax.jit(lambda a, b: a @ b)
        return 2 * n**3 / _timed(lambda: mm(a, b), 3 if cpu else 20)

    def layer_matmuls():
        """The layer's own matmuls forward + backward (x @ W, dx, dW) at the benchmark's token
        count: the q/k/v/o and SwiGLU shapes, i.e. the step's matmuls."""
        from bench_matmul_shapes import fwd_bwd_rate, layer_shapes

        return fwd_bwd_rate(layer_shapes(m), bt, 2 if cpu else 10)

    def head_backward_f32():
        """The one-pass loss's head backward: f32 logit gradients times the (promoted) head."""
        g = jax.random.normal(jax.random.key(4), (bt, v), jnp.float32)
        w = jax.random.normal(jax.random.key(5), (d, v), jnp.float32)
        x = jax.random.normal(jax.random.key(6), (bt, d), jnp.float32)
        run = jax.jit(lambda g, w, x: (g @ w.T, x.T @ g))
        return 4 * bt * d * v / _timed(lambda: run(g, w, x), 2 if cpu else 10)

    def copy(nbytes):
        def run():
            x = jnp.ones((nbytes // 2,), jnp.bfloat16)
            double = jax.jit(lambda y: y * 2)  # one read, one write (y * 1 would be simplified away)
            return 2 * nbytes / _timed(lambda: double(x), 5 if cpu else 20)
        return run

    def attention():
        """The model's attention core forward + backward at the benchmark's shapes, FLOPs
        counted as 3 x the causal forward (the accounting's convention)."""
        impl = resolve_impl(cfg.attention.impl, seq_len=t, head_dim=cfg.model.resolved_head_dim)
        out["attention_impl"] = impl.value
        core = attention_core(cfg.attention.impl)
        ks = jax.random.split(jax.random.key(2), 4)
        bsz = cfg.train.batch_size
        cdt = jnp.dtype(_compute_dtype)  # the core as the model runs it
        q = jax.random.normal(ks[0], (bsz, t, nh, hd), cdt)
        k = jax.random.normal(ks[1], (bsz, t, kh, hd), cdt)
        vv = jax.random.normal(ks[2], (bsz, t, kh, hd), cdt)
        do = jax.random.normal(ks[3], (bsz, t, nh, hd), cdt)

        @jax.jit
        def run(q, k, vv, do):
            o, vjp = jax.vjp(lambda q, k, vv: core(q, k, vv, causal=True), q, k, vv)
            return o, vjp(do)

        flops = 3 * acc.attention_flops_per_token(m, t, causal=impl != AttentionImpl.xla) / m.num_layers * bsz * t
        return flops / _timed(lambda: run(q, k, vv, do), 3 if cpu else 10)

    measure("matmul_square", square)
    measure("matmul", layer_matmuls)
    measure("f32_matmul", head_backward_f32)
    out["copy_bytes"] = (64 << 20) if cpu else (1 << 30)
    measure("copy", copy(out["copy_bytes"]))
    if not cpu:
        measure("copy_4gib", copy(4 << 30))
    measure("attention", attention)
    measure("host", lambda: host_rate(cpu, out))
    stats = dev.memory_stats() or {}
    out["bytes_limit"] = stats.get("bytes_limit") or (args.capacity_gib * GiB if args.capacity_gib else None)
    out["host_limit"] = None if cpu else host_limit()
    emit("calibrate", **out)


def host_rate(cpu: bool, out: dict, *, chunk: int | None = None, sizes: tuple[int, int] | None = None) -> float:
    """Device -> pinned host -> device inside ONE compiled program, the way remat offload moves
    its residuals: a scan stacks chunks into host memory (`jax.device_put(x,
    jax.memory.Space.Host)` inside jit, which is what `save_and_offload_only_these_names`
    emits), a second scan brings each chunk back (`Space.Device`) and sums it, so the copies
    are used. Timed at two sizes; the difference divides out the per-call costs (dispatch,
    the program's host buffer), which a training step does not pay per byte. Returned one
    way: bytes moved (out + back) / seconds, the mean of the two directions, the unit of
    `Rates.host` (StepTime charges 2 x the offloaded bytes at it). The sum reads each chunk
    once from HBM: ~2% of the time at 3 TB/s against a ~55 GB/s link, not subtracted.

    Earlier versions timed `jit(lambda a: a, out_shardings=<pinned_host>)` (and, before that,
    an eager device_put): 1.1-1.5 GB/s on an H200, where the offload step implied ~60 GB/s;
    each call returned a freshly allocated pinned host buffer. On the CPU the device_put
    lowers to nothing (pinned_host is the device's own RAM), so XLA's program has no host
    memory space: no rate (an error, reported) and the prediction charges no host time."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    chunk = chunk or ((8 << 20) if cpu else (64 << 20))  # bytes per copy (the 1b step offloads 8-128 MiB tensors)
    sizes = sizes or ((2, 8) if cpu else (4, 16))  # chunks: 16 and 64 MiB on the CPU, 256 MiB and 1 GiB on a GPU

    def roundtrip(x):
        _, h = lax.scan(lambda c, xi: (c, jax.device_put(xi, jax.memory.Space.Host)), 0, x)

        def back(acc, hi):
            return acc + jnp.sum(jax.device_put(hi, jax.memory.Space.Device), dtype=jnp.float32), None

        return lax.scan(back, jnp.float32(0), h)[0]

    times = {}
    for n in sizes:
        x = jnp.ones((n, chunk // 2), jnp.bfloat16)
        prog = jax.jit(roundtrip).lower(x).compile()
        if "S(5)" not in prog.as_text():  # S(5): XLA's host memory space
            raise RuntimeError("the compiled round trip has no host memory space"
                               + (" (cpu: pinned_host is the device's own RAM; offload copies nothing)" if cpu else ""))
        times[n * chunk] = _timed(lambda: prog(x), 3 if cpu else 5)
    (b1, t1), (b2, t2) = sorted(times.items())
    out["host_roundtrip_s"] = {str(b): t for b, t in times.items()}
    out["host_larger_only"] = 2 * b2 / t2  # the larger round trip alone (per-call cost not divided out)
    if t2 <= t1:
        raise RuntimeError(f"round trip of {b2} bytes not slower than of {b1} ({t2:.4f} s vs {t1:.4f} s)")
    return 2 * (b2 - b1) / (t2 - t1)


# ------------------------------------------------------------------------ one policy


def _xla_bytes(compiled) -> tuple[int, int]:
    """Device bytes (temp + args + outputs - aliased) and pinned-host bytes of a compiled step."""
    ma = compiled.memory_analysis()
    dev = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    host = (ma.host_temp_size_in_bytes + ma.host_argument_size_in_bytes + ma.host_output_size_in_bytes
            - ma.host_alias_size_in_bytes)
    return dev, host


# XLA's GPU client allocates pinned host buffers from one BFC pool capped at this many GiB
# (xla/pjrt/gpu: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, default 64). An offload step past it fails
# with "Out of host memory ... xla_gpu_host_bfc" even where the machine has RAM to spare.
HOST_POOL_ENV, HOST_POOL_DEFAULT_GIB = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", 64


def host_limit() -> float | None:
    """Pinned host memory a step may take (remat offload's residuals live there; on an
    accelerator only): XLA's pinned-host pool, and at most 90% of the RAM available now."""
    pool = float(os.environ.get(HOST_POOL_ENV) or HOST_POOL_DEFAULT_GIB) * (1 << 30)
    try:
        kb = int(re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text()).group(1))
    except (OSError, AttributeError):
        return pool
    return min(pool, 0.9 * kb * 1024)


def peak_buffers(dump_dir: str, top: int = 60) -> str | None:
    """The buffers live at the memory peak of the first jit_step_fn module XLA dumped: its
    live-range file names the peak and the values live there; the optimized HLO gives their
    shapes and source (op_name)."""
    ranges = sorted(glob.glob(f"{dump_dir}/*jit_step_fn*live-range.txt"))
    if not ranges:
        reports = sorted(glob.glob(f"{dump_dir}/*jit_step_fn*memory-usage-report.txt"))
        return Path(reports[0]).read_text() if reports else None
    text = Path(ranges[0]).read_text()
    peak = re.search(r"Live ranges at (\d+) \(peak\):\n(.*?)(?:\n  Stack trace|\Z)", text, re.S)
    if not peak:
        return text[-20000:]
    hlo_files = [f for f in glob.glob(ranges[0].replace("-live-range.txt", "*.txt")) if "buffer" not in f
                 and "live-range" not in f and "memory-usage" not in f]
    meta = {}
    for f in hlo_files:
        for line in Path(f).read_text().splitlines():
            mm = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", line)
            if mm:
                op = re.search(r'op_name="([^"]*)"', line)
                meta.setdefault(mm.group(1), (mm.group(2), op.group(1) if op else ""))
    seq = re.search(r"InstructionSequence:\n(.*?)\n  BufferLiveRange", text, re.S)
    steps = seq.group(1).splitlines() if seq else []
    at = int(peak.group(1))
    rows = []
    for line in peak.group(2).splitlines():
        mm = re.match(r"\s*([\w.\-]+)(\{[^}]*\}): (\d+) bytes", line)
        if mm:
            shape, op = meta.get(mm.group(1), ("?", ""))
            rows.append((int(mm.group(3)), mm.group(1) + mm.group(2), shape[:48], op[-110:]))
    rows.sort(reverse=True)
    out = [f"peak at instruction {at} of {len(steps)}: {steps[at].strip() if at < len(steps) else '?'}",
           f"live at the peak: {sum(r[0] for r in rows) / GiB:.3f} GiB in {len(rows)} buffers; largest {top}:"]
    out += [f"{b / 2**20:10.1f} MiB  {name:36s} {shape:48s} {op}" for b, name, shape, op in rows[:top]]
    return "\n".join(out)


# --------------------------------------------------------------- largest-batch search
def run_policy(args) -> None:
    """In the child: measure at --batch, then search the largest batch until --deadline."""
    import jax
    import numpy as np

    from scaling.train import init_state, make_setup, make_train_step

    dump = os.environ.get("BENCH_REMAT_DUMP")
    t_start = time.time()
    cfg = make_config(args.model, args.policy, args.batch, args.seq, args.steps)
    dev = jax.devices()[0]
    try:
        setup = make_setup(cfg, devices=[dev])
        state = init_state(setup)
        step = make_train_step(setup)
        rng = np.random.default_rng(0)

        def batch_of(b):
            return jax.device_put(rng.integers(0, cfg.model.vocab_size, (b, cfg.train.seq_len + 1), dtype=np.int32),
                                  setup.batch_sharding)

        batch = batch_of(cfg.train.batch_size)
        t0 = time.time()
        compiled = step.lower(state, batch).compile()
        compile_s = time.time() - t0
        xla, xla_host = _xla_bytes(compiled)
        state, metrics = compiled(state, batch)  # warm-up
        jax.block_until_ready(metrics)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        seconds = (time.perf_counter() - t0) / args.steps
    except Exception as e:  # noqa: BLE001 - e.g. offload without pinned_host, or out of memory
        emit("error", policy=args.policy, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        return
    stats = dev.memory_stats() or {}
    limit = stats.get("bytes_limit") or (args.capacity_gib * GiB if args.capacity_gib else None)
    emit("measure", policy=args.policy, batch=cfg.train.batch_size, seq=cfg.train.seq_len,
         peak=stats.get("peak_bytes_in_use"), xla=xla, xla_host=xla_host, seconds=seconds, compile_s=compile_s,
         loss=float(metrics["loss"]), bytes_limit=limit, elapsed=time.time() - t_start)
    if dump:
        text = peak_buffers(dump)
        if text:
            emit("peak_buffers", policy=args.policy, text=text)
    if args.no_search:
        return
    if limit is None:
        emit("search", policy=args.policy, skipped="no byte limit (memory_stats has none; pass --capacity-gib)")
        return
    del compiled
    search(args, cfg, setup, step, state, batch_of, dev, limit, xla, xla_host, compile_s, seconds)


def search(args, cfg, setup, step, state, batch_of, dev, limit, xla, xla_host, compile_s, seconds) -> None:
    """Largest batch: compile-only probes (XLA's memory_analysis), each reported as it completes.

    On a GPU the bracketing probes compile with autotuning off (`xla_gpu_autotune_level=0`, a
    per-compile option): autotuning runs every candidate GEMM / fusion config on real buffers
    of the probed size, so its cost grows with the batch (a 1b probe: ~8 s at batch 22, ~20 s
    at 60, ~38 s at 124 with it, in the session-3 run) while the rest of the compile does not.
    It is not free to ignore: autotuning picks the GEMM algorithm and with it the cuBLAS
    workspace XLA reserves, and may pick Triton split-K configs with their own f32 partial
    buffers, so temp bytes can differ. Hence: bracket at autotune level 0, then compile the
    lower side of the bracket the normal (autotuned) way, which is what a training run
    compiles, and the upper side too unless the autotune difference just measured cannot
    bring it under the limit (inferred_over); the bracket moves if they disagree, and both
    numbers are reported at the same batch. Last, one real step at the batch found (the
    autotuned executable where there is one). The CPU does no autotuning: its probes are the
    normal compile. Each probe, step and the end are printed as JSON lines as they happen."""
    import jax
    import jax.numpy as jnp

    from scaling import accounting as acc
    from scaling.train import abstract_state

    gpu = dev.platform == "gpu"
    cpu = dev.platform == "cpu"
    cap = None if cpu else host_limit()
    hw = None if cpu else _hw(dev.device_kind)
    b0 = cfg.train.batch_size

    def host_used(b: int, h: int) -> tuple[float, str]:
        """Pinned host bytes the fit is judged on: XLA's where it reports them, else (offload
        on an accelerator) the accounting's offloaded residuals, so that the search does not
        end at a batch whose residuals cannot fit in host RAM."""
        if h or cpu or not cap:
            return h, "xla"
        pred = acc.training_memory(cfg, acc.MeshShape(), hw=hw, accelerator=True, batch_size=b).activations.host
        return (pred, "predicted") if pred else (0, "xla")

    abstract = abstract_state(setup)
    fast: dict[int, float] = {}  # batch -> usage, autotune off (GPU)
    tuned: dict[int, float] = {b0: usage(xla, host_used(b0, xla_host)[0], limit, cap)}  # the normal compile
    exes: dict[tuple[int, bool], object] = {}
    no_autotune = [True] if gpu else []  # emptied if the autotune-off compile option is refused
    times: dict[bool, list[tuple[int, float]]] = {False: [], True: []}

    def planned() -> int:
        return args.planned or planner_largest(cfg, hw, not cpu, limit, cap, args.max_batch)

    b_pred = max(1, min(args.max_batch, planned()))
    h0, src0 = host_used(b0, xla_host)
    emit("search_start", policy=args.policy, predicted=b_pred, limit=limit, host_limit=cap, batch=b0, xla=xla,
         host=xla_host, host_used=h0, host_source=src0, autotune=gpu, deadline=args.deadline)

    def view() -> dict[int, float]:
        return {**fast, **tuned}

    def probe(b: int, tune: bool) -> None:
        t0 = time.time()
        spec = jax.ShapeDtypeStruct((b, cfg.train.seq_len + 1), jnp.int32, sharding=setup.batch_sharding)
        tune = tune or not no_autotune
        try:
            c = step.lower(abstract, spec).compile(compiler_options=None if tune else {"xla_gpu_autotune_level": 0})
        except Exception as e:  # noqa: BLE001 - an XLA without the option: every probe the normal compile
            if tune:
                raise
            no_autotune.clear()
            emit("note", policy=args.policy, note=f"autotune-off compile failed ({type(e).__name__}: "
                 f"{str(e).splitlines()[0] if str(e) else ''}"[:200] + "); probes compile normally")
            return probe(b, True)
        d, h = _xla_bytes(c)
        dt = time.time() - t0
        hu, src = host_used(b, h)
        (tuned if tune else fast)[b] = usage(d, hu, limit, cap)
        times[tune].append((b, dt))
        lo, _ = bracket(view())
        exes[(b, tune)] = c
        for key in [k for k in exes if k[0] != lo]:  # keep only the executables at the current answer
            del exes[key]
        emit("probe", policy=args.policy, batch=b, tuned=tune, xla=d, host=h, host_used=hu, host_source=src,
             seconds=dt)

    def est_fast() -> float:
        ts = sorted(t for _, t in times[False] or times[True])
        return ts[len(ts) // 2] if ts else (args.fast_s or compile_s)

    def est_tuned(b: int) -> float:
        base = est_fast() if times[False] else min(compile_s, args.fast_s or compile_s)
        ks = [max(0.0, t - base) / bb for bb, t in times[True] if bb > b0] if gpu else []
        k = max(ks) if ks else (args.tune_k or max(0.0, compile_s - base) / b0)
        return base + k * b if gpu else est_fast()

    def est_step(b: int) -> float:
        return 1.5 * seconds * b / b0 + 3.0

    def can(est: float) -> bool:
        return time.time() + est <= args.deadline

    stopped = None
    # 1. Bracket (GPU: autotune off).
    while (b := next_probe(view(), args.max_batch, start=b_pred)) is not None:
        if not can(est_fast() + est_step(b)):
            stopped = f"budget: bracketing stopped after {len(times[False]) + len(times[True])} probes"
            break
        probe(b, tune=not gpu)
    # 2. GPU: both sides of the bracket with the normal (autotuned) compile, moving it if they disagree.
    # The upper side needs no compile where the autotune difference measured at the lower one
    # cannot bring it under the limit (inferred_over).
    while gpu and stopped is None:
        lo, hi = bracket(view())
        if lo and lo not in tuned:
            b = lo
        elif hi and hi <= args.max_batch and hi not in tuned and not inferred_over(hi, fast, tuned):
            b = hi
        else:
            b = next_probe(view(), args.max_batch)
        if b is None:
            break
        if not can(est_tuned(b) + est_step(lo)):
            stopped = f"budget: autotuned check stopped after {len(times[True])} compiles (next: {b}, ~{est_tuned(b):.0f} s)"
            break
        probe(b, tune=True)
    # 3. One real step at the batch found (not needed at the measured batch).
    lo, _ = bracket(view())
    if lo and lo != b0:
        def exe_key():
            return next((k for k in ((lo, True), (lo, False)) if k in exes), None)

        if exe_key() is None and can(est_fast() + est_step(lo)):
            probe(lo, tune=not gpu)
        key = exe_key()
        if key is not None and can(est_step(lo)):
            c = exes.pop(key)
            exes.clear()
            try:
                state, metrics = c(state, batch_of(lo))
                jax.block_until_ready(metrics)
                stats = dev.memory_stats() or {}
                emit("step", policy=args.policy, batch=lo, tuned=key[1], ok=True, peak=stats.get("peak_bytes_in_use"),
                     loss=float(metrics["loss"]))
            except Exception as e:  # noqa: BLE001 - out of memory at a batch XLA said fits
                err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                emit("step", policy=args.policy, batch=lo, tuned=key[1], ok=False, error=err)
                # XLA's pinned-host pool (a BFC allocator that grows in regions and keeps them) can
                # refuse one buffer that fits its cap on paper: step down until a real step runs.
                b = lo
                while "host memory" in err:
                    b = int(b * 0.92)
                    if b <= b0 or not can(est_tuned(b) + est_step(b)):
                        break
                    from scaling.train import init_state

                    # A fresh state: the failed call consumed the donated one, and its outputs
                    # carry the error into any step that takes them.
                    state = init_state(setup)
                    try:
                        spec = jax.ShapeDtypeStruct((b, cfg.train.seq_len + 1), jnp.int32, sharding=setup.batch_sharding)
                        state, metrics = step.lower(abstract, spec).compile()(state, batch_of(b))
                        jax.block_until_ready(metrics)
                        stats = dev.memory_stats() or {}
                        emit("step", policy=args.policy, batch=b, tuned=True, ok=True,
                             peak=stats.get("peak_bytes_in_use"), loss=float(metrics["loss"]), after_host_oom=lo)
                        break
                    except Exception as e2:  # noqa: BLE001
                        err = f"{type(e2).__name__}: {str(e2).splitlines()[0] if str(e2) else ''}"[:200]
                        emit("step", policy=args.policy, batch=b, tuned=True, ok=False, error=err)
        elif stopped is None:
            stopped = "budget: no time left for the real step"
    emit("search", policy=args.policy, stopped=stopped)


def planner_largest(cfg, hw, accel: bool, limit: float, cap: float | None, max_batch: int) -> int:
    """The accounting's largest batch under the device limit (and the host one for offload)."""
    from scaling import accounting as acc

    best = 0
    for b in range(1, max_batch + 1):
        mem = acc.training_memory(cfg, acc.MeshShape(), hw=hw, accelerator=accel, batch_size=b)
        if mem.total > limit or (accel and cap and mem.activations.host > cap):
            break
        best = b
    return best


def _hw(kind: str):
    from scaling import hardware

    return hardware.by_device_kind(kind)


# -------------------------------------------------------------------------- parent


def spawn(cmd: list[str], timeout: float, env: dict, on_event=None) -> tuple[list[dict], str]:
    """Run a child and collect its JSON lines as they come (so a child killed at `timeout`
    keeps what it reported); returns them (each with `t`, seconds after the start) and a
    note: why it was killed, or its stderr's last line."""
    t0 = time.time()
    events: list[dict] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)

        def read():
            for line in proc.stdout:
                if line.startswith("{"):
                    try:
                        x = json.loads(line)
                    except json.JSONDecodeError:  # cut off by the kill
                        continue
                    x["t"] = time.time() - t0
                    events.append(x)
                    if on_event:
                        on_event(x)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=max(timeout, 1))
            note = ""
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            note = f"killed at its deadline after {timeout:.0f} s"
        reader.join(10)
        err.seek(0)
        tail = (err.read().strip().splitlines() or [""])[-1][:200]
    return events, note or tail


def predictions(args, policy: str, batch: int, cal: dict | None, limit: float | None,
                cap: float | None = None) -> dict:
    from scaling import accounting as acc
    from scaling.hardware import by_device_kind

    cfg = make_config(args.model, policy, batch, args.seq, args.steps)
    hw = by_device_kind(cal["device"]) if cal else None
    accel = bool(cal) and cal.get("backend") != "cpu"
    mesh = acc.MeshShape()
    mem = acc.training_memory(cfg, mesh, hw=hw, accelerator=accel)
    out = {"memory": mem.total, "phase": mem.peak_phase, "phases": mem.phases}
    if cal:
        # Measured in this run; a rate whose measurement failed falls back to the table's default.
        default = acc.Rates.of(hw) if hw else acc.Rates(0.0, 0.0, 0.0)
        # The bf16 matmuls at the square product's rate, as the hardware table holds it: inside
        # profiled steps the layers' matmuls ran at 736-783 TFLOP/s, near the square's 744-800, while
        # the same shapes timed alone ran at 674 (docs/benchmarks.md, forty-eighth and forty-ninth
        # sessions). The layer-shape rate's prediction goes beside it.
        rates = acc.Rates(cal.get("matmul_square") or cal.get("matmul") or default.matmul,
                          cal.get("attention") or default.attention,
                          cal.get("copy") or default.hbm, cal.get("host") or default.host,
                          cal.get("f32_matmul") or default.f32_matmul, "measured in this run")
    if cal and rates.matmul and rates.hbm and (rates.attention or accel is False):
        st = acc.training_time(cfg, mesh, hw, rates=rates, accelerator=accel)
        out.update(seconds=st.seconds, matmul_s=st.matmul_seconds, attention_s=st.attention_seconds,
                   memory_s=st.memory_seconds, host_s=st.host_seconds, host_bytes=st.host_bytes, traffic=st.traffic)
        if st.host_seconds:
            # StepTime adds the host transfers to the compute (measured: docs/benchmarks.md); beside
            # it, the same transfers fully overlapped with the compute (copy engines), for comparison.
            out["seconds_host_overlapped"] = max(st.compute_seconds, st.comm_seconds, st.host_seconds)
        # The same with the layer's own matmul shapes' rate (timed alone) for the bf16 matmuls, beside it.
        if cal.get("matmul"):
            layer = acc.training_time(cfg, mesh, hw, rates=dataclasses.replace(rates, matmul=cal["matmul"]),
                                      accelerator=accel)
            out["seconds_layer_rate"] = layer.seconds
    if hw:
        roof = acc.training_roofline(cfg, mesh, hw)
        out.update(roofline=roof.step_seconds, model_flops=roof.model_flops, peak_flops=hw.bf16_flops)
    if limit:
        out["largest"] = planner_largest(cfg, hw, accel, limit, cap, args.max_batch)
    return out


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Bad flags end here (argparse's usage line, the flag, what is allowed; exit code 2), not
    as a traceback in the parent after the calibration child has spent its time on them."""
    def positive(name: str, value, what: str = "a positive integer") -> None:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            p.error(f"{name}: must be {what}, got {value}")

    if not model_source(args.model).is_file():
        p.error(f"--model: {args.model!r} is neither a preset under configs/models/ (allowed: {', '.join(presets())}) "
                "nor a config file")
    for name in ("seq", "batch", "steps", "max_batch"):
        positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if not args.no_search and args.max_batch < args.batch:
        p.error(f"--max-batch: {args.max_batch} is below --batch {args.batch} (the search starts from it)")
    positive("--budget-s", args.budget_s, "a positive number of seconds")
    if args.child is None and args.budget_s <= FINAL_S:
        p.error(f"--budget-s: {args.budget_s:g} s leaves nothing to run ({FINAL_S:g} s are kept back for the table)")
    if args.capacity_gib is not None:
        positive("--capacity-gib", args.capacity_gib, "a positive number of GiB")
    try:
        fraction = float(args.mem_fraction)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        p.error(f"--mem-fraction: must be a number in (0, 1], got {args.mem_fraction!r}")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.policies = ",".join(policies)
    bad = [x for x in policies if x not in POLICIES]
    if bad or not policies or len(set(policies)) < len(policies):
        why = (f"unknown {', '.join(map(repr, bad))}" if bad else "empty" if not policies
               else f"repeated {', '.join(sorted({x for x in policies if policies.count(x) > 1}))}")
        p.error(f"--policies: {why}; allowed: a comma-separated list of {', '.join(POLICIES)}")
    if args.child == "policy" and args.policy not in POLICIES:
        p.error(f"--policy: {args.policy!r} is not a policy; allowed: {', '.join(POLICIES)}")
    if args.child is None:
        from scaling.config import ConfigError

        try:  # the model's own config, with every flag this run passes to it
            for policy in policies:
                make_config(args.model, policy, args.batch, args.seq, args.steps)
        except ConfigError as e:
            p.error(f"--model {args.model}: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="preset under configs/models/ (default 1b)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="the batch every policy is measured at")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="bfloat16",
                   help="model.compute_dtype (float32: every matmul at the f32/TF32 rate in the prediction)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per policy (after one warm-up)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--max-batch", type=int, default=256, help="cap of the largest-batch search")
    p.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    p.add_argument("--budget-s", type=float, default=450, help="wall-clock budget of the whole run (s)")
    p.add_argument("--mem-fraction", default="0.92",
                   help="XLA_PYTHON_CLIENT_MEM_FRACTION for the children (JAX's default 0.75 would cap the search)")
    p.add_argument("--capacity-gib", type=float, default=None,
                   help="byte limit for the search where the device reports none (the CPU)")
    p.add_argument("--peak-buffers", action="store_true",
                   help="dump XLA's buffer assignment and write the buffers live at each policy's peak")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for bench_remat.md/.json (default $OUT)")
    p.add_argument("--child", choices=("calibrate", "policy"), help=argparse.SUPPRESS)
    p.add_argument("--policy", default="none", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    p.add_argument("--planned", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fast-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--tune-k", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_args(p, args)
    global _compute_dtype
    _compute_dtype = args.compute_dtype
    if args.child == "calibrate":
        calibrate(args)
        return 0
    if args.child == "policy":
        run_policy(args)
        return 0

    os.environ["JAX_PLATFORMS"] = "cpu"  # the parent predicts on the CPU and leaves the device to the children
    import jax

    jax.config.update("jax_platforms", "cpu")
    start = T0
    end = start + args.budget_s
    env = dict(_ENV)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", args.mem_fraction)
    base = [sys.executable, __file__, "--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch),
            "--compute-dtype", args.compute_dtype,
            "--steps", str(args.steps), "--max-batch", str(args.max_batch)]
    if args.capacity_gib:
        base += ["--capacity-gib", str(args.capacity_gib)]
    if args.no_search:
        base.append("--no-search")
    notes: list[str] = []

    def log(msg: str) -> None:
        print(f"[{time.time() - start:4.0f} s] {msg}", file=sys.stderr, flush=True)

    events, why = spawn(base + ["--child", "calibrate"], min(180, end - FINAL_S - time.time()), env)
    cal = next((x for x in events if x["kind"] == "calibrate"), None)
    if cal:
        log(f"calibrate: {json.dumps(cal)}")
    else:
        notes.append(f"calibration failed ({why}): no calibrated prediction")
        log(notes[-1])

    policies = [x for x in args.policies.split(",") if x]
    limit = (cal or {}).get("bytes_limit")
    cap = (cal or {}).get("host_limit")
    # The searches' cost grows with the batch they end at (autotuned compiles, the real step), so
    # run the cheapest first: a search that finishes early leaves its time to the later ones.
    planned: dict[str, int] = {}
    if cal and limit and not args.no_search:
        hw, accel = _hw(cal["device"]), cal.get("backend") != "cpu"
        for policy in policies:
            try:
                planned[policy] = planner_largest(make_config(args.model, policy, args.batch, args.seq), hw, accel,
                                                  limit, cap, args.max_batch)
            except Exception as e:  # noqa: BLE001 - the run order is only an optimisation
                log(f"{policy}: no planner prediction ({type(e).__name__}: {e})")
    order = sorted(policies, key=lambda p: planned.get(p, 0))
    log(f"run order (planner's largest batch): {', '.join(f'{p} {planned.get(p, "?")}' for p in order)}")

    def size(x: float) -> str:
        return f"{x / GiB:.3f} GiB" if x >= GiB else f"{x / 2**20:.2f} MiB"

    def progress(policy):
        autotune = {}

        def show(x):
            k = x["kind"]
            if k == "measure":
                log(f"{policy}: measured {x['seconds'] * 1e3:.1f} ms/step, XLA {size(x['xla'])} "
                    f"(compile {x['compile_s']:.1f} s)")
            elif k == "search_start":
                autotune["on"] = x.get("autotune")
                log(f"{policy}: search from the planner's {x['predicted']}, limit {size(x['limit'])}"
                    + (f", pinned host {size(x['host_limit'])}" if x.get("host_limit") else ""))
            elif k == "probe":
                how = ("autotuned" if x["tuned"] else "autotune off") if autotune.get("on") else "compiled"
                log(f"{policy}: probe {x['batch']} ({how}): {size(x['xla'])}"
                    + (f" + host {size(x['host'])}" if x.get("host") else "") + f" in {x['seconds']:.1f} s")
            elif k == "step":
                log(f"{policy}: real step at {x['batch']}: "
                    + (f"peak {size(x['peak'])}" if x["ok"] and x.get("peak") else x.get("error", "ran")))
            elif k in ("search", "error", "note"):
                log(f"{policy}: {json.dumps({a: b for a, b in x.items() if a not in ('kind', 'policy')})}")
        return show

    measure_s: list[float] = []  # seconds from a child's start to its measurement, as observed
    fast_s: list[float] = []  # compile-only probes with autotuning off (the CPU: all probes)
    tune_k: list[float] = []  # autotuning's seconds per batch element (autotuned probe - median fast probe)
    rows: dict[str, dict] = {}
    for i, policy in enumerate(order):
        now = time.time()
        left = end - FINAL_S - now
        pending = len(order) - i
        est = max(measure_s) + 3 if measure_s else MEASURE_S
        if left < min(20.0, est):
            notes.append(f"{policy}: not run (budget spent)")
            rows[policy] = {"policy": policy, "error": "not run: budget spent"}
            continue
        # Every policy still to run gets its measurement; the rest is the searches', shared
        # equally and worked out again before each child (an early finish leaves its share).
        allowance = min(left, est + max(0.0, left - pending * est) / pending)
        cmd = base + ["--child", "policy", "--policy", policy, "--deadline", str(now + allowance - 3)]
        if policy in planned:
            cmd += ["--planned", str(max(1, planned[policy]))]
        if fast_s:
            cmd += ["--fast-s", f"{sorted(fast_s)[len(fast_s) // 2]:.2f}"]
        if tune_k:
            cmd += ["--tune-k", f"{sorted(tune_k)[len(tune_k) // 2]:.4f}"]
        child_env = dict(env)
        dump = None
        if args.peak_buffers:
            dump = tempfile.mkdtemp(prefix=f"bench_remat_{policy}_")
            child_env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=NONE"
                                      " --xla_dump_hlo_module_re=.*jit_step_fn.*").strip()
            child_env["BENCH_REMAT_DUMP"] = dump
        log(f"{policy}: start, {allowance:.0f} s ({left:.0f} s left for {pending} policies)")
        t0 = time.time()
        events, why = spawn(cmd, min(allowance + 10, left), child_env, on_event=progress(policy))
        if dump:
            shutil.rmtree(dump, ignore_errors=True)
        row = {"policy": policy, "wall_s": time.time() - t0, "allowance_s": allowance}
        for x in events:
            if x["kind"] in ("measure", "error"):
                row.update({k: v for k, v in x.items() if k not in ("kind", "t")})
                if x["kind"] == "measure":
                    measure_s.append(x["t"])
            elif x["kind"] == "search" and x.get("skipped"):
                row["search"] = {"skipped": x["skipped"]}
            elif x["kind"] == "peak_buffers":
                row["peak_buffers"] = x["text"]
            elif x["kind"] == "note":
                notes.append(f"{policy}: {x['note']}")
        if "seconds" not in row and "error" not in row:
            row["error"] = f"no result ({why})"
        if "seconds" in row and "search" not in row and not args.no_search:
            s = summarize_search(events, args.max_batch, row.get("peak"))
            if s is None:
                s = {"skipped": f"not started ({why or 'budget'})"}
            elif s["stopped"] == "killed at its deadline" and why:
                s["stopped"] = why
            row["search"] = s
            fast = [p[4] for p in s.get("probes", []) if not p[3] or not s.get("autotune")]
            fast_s += fast
            if fast and s.get("autotune"):
                med = sorted(fast)[len(fast) // 2]
                tune_k += [max(0.0, p[4] - med) / p[0] for p in s["probes"] if p[3]]
        s = row.get("search", {})
        if s.get("skipped"):
            notes.append(f"{policy}: largest-batch search skipped: {s['skipped']}")
        elif s.get("stopped"):
            notes.append(f"{policy}: largest-batch search stopped ({s['stopped']}); what it learned: "
                         f"{largest_cell(s)}")
        rows[policy] = row
        log(f"{policy}: done in {row['wall_s']:.0f} s")
    rows = [rows[p] for p in policies]

    # Predictions, on the CPU.
    for row in rows:
        if "seconds" in row or "error" in row:
            row["pred"] = predictions(args, row["policy"], args.batch, cal, row.get("bytes_limit") or limit, cap)
    table = report(args, cal, rows, notes, time.time() - start)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_remat.md").write_text(table + "\n")
        (out / "bench_remat.json").write_text(json.dumps(
            {"calibrate": cal, "rows": [{k: v for k, v in r.items() if k != "peak_buffers"} for r in rows],
             "notes": notes, "argv": sys.argv[1:], "run_order": order, "wall_s": time.time() - start},
            indent=1, default=str))
        for r in rows:
            if r.get("peak_buffers"):
                (out / f"peak_buffers_{r['policy']}.txt").write_text(r["peak_buffers"] + "\n")
        log(f"wrote {out / 'bench_remat.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
