"""Remat policies on one device: peak memory and step time, measured vs predicted, and the
largest batch each policy fits. One invocation produces the whole table of docs/benchmarks.md.

    python experiments/bench_remat.py --out DIR                     # 1b, bf16, batch 4 x 2048 (GPU, ~7 min)
    python experiments/bench_remat.py --model tiny --seq 128 --batch 2 --steps 2 \\
        --capacity-gib 0.05 --budget-s 400 --out /tmp/bench_remat    # CPU smoke run

What runs, in child processes (the parent never touches the accelerator: it runs JAX on the
CPU for the predictions, so every child gets the whole device):
  1. calibrate: the achievable rates the calibrated prediction divides by, measured in this
     run, each on its own kernels (none fitted to a training step): the layer's bf16 matmuls
     forward + backward at the benchmark's token count (x @ W, dx, dW for the q/k/v/o and
     SwiGLU shapes; a square 8192^3 matmul beside it, and the prediction at that rate in its
     own column), the one-pass loss's f32 head-backward matmuls (TF32), a device copy (x * 2,
     read + write, 1 GiB; 4 GiB beside it, the size docs/decoding.md used), the model's own
     attention core forward + backward at the benchmark's shapes (TFLOP/s counted as 3 x the
     causal forward, the accounting's convention), and a device -> pinned-host copy (offload).
  2. one child per policy (none, full, dots, names, offload, selective): compile the train
     step at --batch, XLA's memory_analysis, --steps timed steps, peak_bytes_in_use; then the
     largest batch that fits: start from the planner's prediction (scaling.accounting with
     the device's real byte limit), probe with compile-only memory_analysis (which equals the
     measured peak on the GPU: docs/benchmarks.md), bracket the boundary, and confirm with one
     real step at the batch found. A policy the backend cannot run (offload without a
     pinned_host memory space) is reported as an error row, not a crash.
A time budget (--budget-s) is shared out over the policies; what it cuts (largest-batch
searches first) is printed and written into the table.

Predictions (scaling.accounting): peak bytes (training_memory: the largest of the step's
phases), the calibrated step time (training_time: matmuls / measured matmul rate + attention /
measured attention rate + memory-bound traffic / measured copy bandwidth) and the book's
roofline (training_roofline: datasheet peaks, perfect overlap). MFU = model FLOPs / (datasheet
peak x measured step time), as in docs/benchmarks.md.

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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("none", "full", "dots", "names", "offload", "selective")
# names: keep the q/k/v and out projections only (the attention side of `selective`).
# offload: the projections `selective` keeps on the device go to pinned host memory instead.
NAMES = {"names": ("query_proj", "key_proj", "value_proj", "out_proj"),
         "offload": ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up")}
GiB = 2**30
_ENV = dict(os.environ)  # the children's environment (the parent switches itself to the CPU)


def make_config(model: str, policy: str, batch: int, seq: int, steps: int = 10):
    from scaling.config import load_config

    path = ROOT / "configs" / "models" / f"{model}.yaml"
    src = path if path.exists() else model
    seq = min(seq, load_config(src).model.max_seq_len)
    overrides = [
        "--model.compute_dtype=bfloat16", f"--train.batch_size={batch}", f"--train.seq_len={seq}",
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
        shapes = [(d, nh * hd), (d, kh * hd), (d, kh * hd), (nh * hd, d), (d, f), (d, f), (f, d)]
        key = iter(jax.random.split(jax.random.key(3), 3 * len(shapes)))
        xs = [jax.random.normal(next(key), (bt, i), jnp.bfloat16) for i, _ in shapes]
        ws = [jax.random.normal(next(key), s, jnp.bfloat16) * 0.02 for s in shapes]
        cts = [jax.random.normal(next(key), (bt, o), jnp.bfloat16) for _, o in shapes]

        def one(x, w, ct):
            y, vjp = jax.vjp(lambda x, w: x @ w, x, w)
            return y, vjp(ct)  # y returned, or XLA drops the forward matmul

        run = jax.jit(lambda xs, ws, cts: [one(x, w, ct) for x, w, ct in zip(xs, ws, cts)])
        return sum(6 * bt * i * o for i, o in shapes) / _timed(lambda: run(xs, ws, cts), 2 if cpu else 10)

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
        impl = resolve_impl(cfg.attention.impl)
        out["attention_impl"] = impl.value
        core = attention_core(cfg.attention.impl)
        ks = jax.random.split(jax.random.key(2), 4)
        bsz = cfg.train.batch_size
        q = jax.random.normal(ks[0], (bsz, t, nh, hd), jnp.bfloat16)
        k = jax.random.normal(ks[1], (bsz, t, kh, hd), jnp.bfloat16)
        vv = jax.random.normal(ks[2], (bsz, t, kh, hd), jnp.bfloat16)
        do = jax.random.normal(ks[3], (bsz, t, nh, hd), jnp.bfloat16)

        @jax.jit
        def run(q, k, vv, do):
            o, vjp = jax.vjp(lambda q, k, vv: core(q, k, vv, causal=True), q, k, vv)
            return o, vjp(do)

        flops = 3 * acc.attention_flops_per_token(m, t, causal=impl != AttentionImpl.xla) / m.num_layers * bsz * t
        return flops / _timed(lambda: run(q, k, vv, do), 3 if cpu else 10)

    def host():
        """Device -> pinned host (remat offload's path), one way, as a compiled transfer.

        Inside a jitted step, offload is an XLA copy to the pinned_host memory space. The
        first version timed an eager `jax.device_put` instead and measured 1.11 GB/s on an
        H200, while the offload step itself implied ~60 GB/s (docs/benchmarks.md); an eager
        put takes a slower runtime path, so the transfer is compiled here."""
        nbytes = (64 << 20) if cpu else (1 << 30)
        x = jnp.ones((nbytes // 2,), jnp.bfloat16)
        dst = x.sharding.with_memory_kind("pinned_host")
        to_host = jax.jit(lambda a: a, out_shardings=dst)
        return nbytes / _timed(lambda: to_host(x), 3 if cpu else 5)

    measure("matmul_square", square)
    measure("matmul", layer_matmuls)
    measure("f32_matmul", head_backward_f32)
    out["copy_bytes"] = (64 << 20) if cpu else (1 << 30)
    measure("copy", copy(out["copy_bytes"]))
    if not cpu:
        measure("copy_4gib", copy(4 << 30))
    measure("attention", attention)
    measure("host", host)
    emit("calibrate", **out)


# ------------------------------------------------------------------------ one policy


def _xla_bytes(compiled) -> int:
    ma = compiled.memory_analysis()
    return ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes


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


def run_policy(args) -> None:
    """In the child: measure at --batch, then search the largest batch until --deadline."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from scaling import accounting as acc
    from scaling.train import abstract_state, init_state, make_setup, make_train_step

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
        xla = _xla_bytes(compiled)
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
         peak=stats.get("peak_bytes_in_use"), xla=xla, seconds=seconds, compile_s=compile_s,
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

    # Largest batch: compile-only probes, bracketed, starting from the planner's prediction.
    del compiled
    abstract = abstract_state(setup)
    probes: dict[int, int] = {cfg.train.batch_size: xla}
    compiled_at: dict[int, object] = {}

    def probe(b: int) -> int:
        spec = jax.ShapeDtypeStruct((b, cfg.train.seq_len + 1), jnp.int32, sharding=setup.batch_sharding)
        c = step.lower(abstract, spec).compile()
        probes[b] = _xla_bytes(c)
        compiled_at[b] = c
        return probes[b]

    def predicted_largest() -> int:
        best = 0
        for b in range(1, args.max_batch + 1):
            if acc.training_memory(cfg, acc.MeshShape(), hw=None if dev.platform == "cpu" else _hw(dev.device_kind),
                                   batch_size=b, accelerator=dev.platform != "cpu").total > limit:
                break
            best = b
        return best

    def fits(b):
        return probes[b] <= limit

    skipped = None
    b_pred = predicted_largest()
    nxt = max(1, min(args.max_batch, b_pred))
    while True:
        if time.time() + 1.5 * compile_s > args.deadline:
            skipped = f"budget: stopped after {len(probes) - 1} probes"
            break
        if nxt not in probes:
            probe(nxt)
        ok = [b for b in probes if fits(b)]
        bad = [b for b in probes if not fits(b)]
        lo, hi = (max(ok) if ok else 0), (min(bad) if bad else None)
        if hi is not None and hi == lo + 1 or (hi is None and lo >= args.max_batch) or hi == 1:
            break
        # Next: where the line through the two nearest probes crosses the limit, inside (lo, hi).
        pts = sorted(probes.items(), key=lambda kv: abs(kv[0] - nxt))[:2]
        (b1, m1), (b2, m2) = sorted(pts)
        slope = (m2 - m1) / (b2 - b1) if b2 != b1 else 0
        est = int(b1 + (limit - m1) / slope) if slope > 0 else (lo * 2 or 1)
        upper = (hi - 1) if hi is not None else args.max_batch
        nxt = min(max(est, lo + 1), upper)
        if nxt in probes:  # the estimate sits on a probed point: step towards the gap
            nxt = lo + 1 if nxt <= lo else nxt - 1
    ok = [b for b in probes if fits(b)]
    found = max(ok) if ok else 0
    result = {"policy": args.policy, "predicted": b_pred, "found": found, "probes": sorted(probes.items()),
              "bracketed": (found + 1) in probes or found >= args.max_batch, "skipped": skipped}
    # Confirm with one real step at the batch found (same state; the probe's executable). If
    # the allocator cannot place it after all (fragmentation), try one batch lower.
    if found and found != cfg.train.batch_size and time.time() + 10 < args.deadline:
        for b in (found, found - 1):
            if b < 1 or (b != found and time.time() + 1.5 * compile_s > args.deadline):
                break
            try:
                c = compiled_at.pop(b, None) or probe(b) and compiled_at.pop(b)
                compiled_at.clear()
                big = batch_of(b)
                state, metrics = c(state, big)
                jax.block_until_ready(metrics)
                stats = dev.memory_stats() or {}
                result.update(confirmed=True, peak=stats.get("peak_bytes_in_use"), loss=float(metrics["loss"]))
                if b != found:
                    result.update(found=b, note=f"a real step at {found} ran out of memory; {b} ran")
                break
            except Exception as e:  # noqa: BLE001 - out of memory at the batch XLA said fits
                result.update(confirmed=False, error=f"{type(e).__name__}: {str(e).splitlines()[0]}"[:200])
    elif found == cfg.train.batch_size:
        result.update(confirmed=True, peak=stats.get("peak_bytes_in_use"))
    else:
        result.update(confirmed=None)
    emit("search", **result)


def _hw(kind: str):
    from scaling import hardware

    return hardware.by_device_kind(kind)


# -------------------------------------------------------------------------- parent


def spawn(cmd: list[str], timeout: float, env: dict) -> tuple[list[dict], str]:
    """Run a child; its JSON lines (even from a child killed at the timeout) and its stderr tail."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            subprocess.run(cmd, stdout=out, stderr=err, text=True, timeout=max(timeout, 1), env=env)
            note = ""
        except subprocess.TimeoutExpired:
            note = f"timed out after {timeout:.0f} s"
        out.seek(0)
        err.seek(0)
        lines = [json.loads(x) for x in out.read().splitlines() if x.startswith("{")]
        tail = (err.read().strip().splitlines() or [""])[-1][:200]
    return lines, note or tail


def predictions(args, policy: str, batch: int, cal: dict | None, limit: float | None) -> dict:
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
        rates = acc.Rates(cal.get("matmul") or default.matmul, cal.get("attention") or default.attention,
                          cal.get("copy") or default.hbm, cal.get("host") or default.host,
                          cal.get("f32_matmul") or default.f32_matmul, "measured in this run")
    if cal and rates.matmul and rates.hbm and (rates.attention or accel is False):
        st = acc.training_time(cfg, mesh, hw, rates=rates, accelerator=accel)
        out.update(seconds=st.seconds, matmul_s=st.matmul_seconds, attention_s=st.attention_seconds,
                   memory_s=st.memory_seconds, host_s=st.host_seconds, traffic=st.traffic)
        # The same with the square 8192^3 matmul's rate for the bf16 matmuls, beside it.
        if cal.get("matmul_square"):
            square = acc.training_time(cfg, mesh, hw, rates=dataclasses.replace(rates, matmul=cal["matmul_square"]),
                                       accelerator=accel)
            out["seconds_square"] = square.seconds
    if hw:
        roof = acc.training_roofline(cfg, mesh, hw)
        out.update(roofline=roof.step_seconds, model_flops=roof.model_flops, peak_flops=hw.bf16_flops)
    if limit:
        best = 0
        for b in range(1, args.max_batch + 1):
            if acc.training_memory(cfg, mesh, hw=hw, accelerator=accel, batch_size=b).total > limit:
                break
            best = b
        out["largest"] = best
    return out


def fmt(x, scale=1.0, spec=",.2f", none="n/a") -> str:
    return none if x is None else format(x * scale, spec)


def rate(x: float, unit: str) -> str:
    """FLOP/s or B/s with an SI prefix (T on a GPU, G on a CPU)."""
    for prefix, v in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= v:
            return f"{x / v:,.3g} {prefix}{unit}"
    return f"{x:,.3g} {unit}"


def err(pred, meas) -> str:
    return "n/a" if pred is None or not meas else f"{pred / meas - 1:+.0%}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="preset under configs/models/ (default 1b)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="the batch every policy is measured at")
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
    args = p.parse_args()
    if args.child == "calibrate":
        calibrate(args)
        return 0
    if args.child == "policy":
        run_policy(args)
        return 0

    os.environ["JAX_PLATFORMS"] = "cpu"  # the parent predicts on the CPU and leaves the device to the children
    import jax

    jax.config.update("jax_platforms", "cpu")
    start = time.time()
    end = start + args.budget_s
    env = dict(_ENV)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", args.mem_fraction)
    base = [sys.executable, __file__, "--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch),
            "--steps", str(args.steps), "--max-batch", str(args.max_batch)]
    if args.capacity_gib:
        base += ["--capacity-gib", str(args.capacity_gib)]
    if args.no_search:
        base.append("--no-search")
    notes: list[str] = []

    lines, why = spawn(base + ["--child", "calibrate"], min(180, end - time.time()), env)
    cal = next((x for x in lines if x["kind"] == "calibrate"), None)
    if cal:
        print(f"calibrate: {json.dumps(cal)}", file=sys.stderr, flush=True)
    else:
        notes.append(f"calibration failed ({why}): no calibrated prediction")
        print(notes[-1], file=sys.stderr)

    policies = [x for x in args.policies.split(",") if x]
    rows = []
    for i, policy in enumerate(policies):
        left = end - time.time()
        share = left / (len(policies) - i)
        if left < 20:
            notes.append(f"{policy}: not run (budget spent)")
            rows.append({"policy": policy, "error": "not run: budget spent"})
            continue
        cmd = base + ["--child", "policy", "--policy", policy, "--deadline", str(time.time() + share - 5)]
        child_env = dict(env)
        dump = None
        if args.peak_buffers:
            dump = tempfile.mkdtemp(prefix=f"bench_remat_{policy}_")
            child_env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=NONE"
                                      " --xla_dump_hlo_module_re=.*jit_step_fn.*").strip()
            child_env["BENCH_REMAT_DUMP"] = dump
        t0 = time.time()
        lines, why = spawn(cmd, share + 30, child_env)
        if dump:
            shutil.rmtree(dump, ignore_errors=True)
        row = {"policy": policy, "wall_s": time.time() - t0}
        for x in lines:
            if x["kind"] in ("measure", "error"):
                row.update({k: v for k, v in x.items() if k != "kind"})
            elif x["kind"] == "search":
                row["search"] = {k: v for k, v in x.items() if k not in ("kind", "policy")}
            elif x["kind"] == "peak_buffers":
                row["peak_buffers"] = x["text"]
        if "seconds" not in row and "error" not in row:
            row["error"] = f"no result ({why})"
        if "seconds" in row and "search" not in row and not args.no_search:
            row["search"] = {"skipped": f"not finished ({why or 'budget'})"}
        s = row.get("search", {})
        if s.get("skipped"):
            notes.append(f"{policy}: largest-batch search {s['skipped']}")
        rows.append(row)
        print(f"{policy}: {json.dumps({k: v for k, v in row.items() if k != 'peak_buffers'})}", file=sys.stderr, flush=True)

    # Predictions, on the CPU.
    for row in rows:
        if "seconds" in row or "error" in row:
            row["pred"] = predictions(args, row["policy"], args.batch, cal, row.get("bytes_limit"))

    seq = next((r["seq"] for r in rows if "seq" in r), args.seq)
    small = all((r.get("xla") or GiB) < GiB for r in rows)  # a CPU smoke run: MiB, not GiB
    unit, ub = ("MiB", 2**20) if small else ("GiB", GiB)
    dev = cal["device"] if cal else "?"
    lines = [
        f"# bench_remat: `{args.model}`, bf16 compute, batch {args.batch} x {seq}, one {dev}",
        "",
        f"{time.strftime('%Y-%m-%d')}, jax {cal['jax'] if cal else '?'}; `python experiments/bench_remat.py "
        + " ".join(sys.argv[1:]) + f"`; {time.time() - start:.0f} s.",
        "",
    ]
    if cal:
        def r(key, unit):
            return f"**{rate(cal[key], unit)}**" if cal.get(key) else f"n/a ({cal.get(key + '_error', '?')}; table default used)"

        lines += [
            f"Measured in this run: the layer's bf16 matmuls (forward + backward at {args.batch} x {seq} tokens) "
            f"{r('matmul', 'FLOP/s')} (a square {cal.get('matmul_n', '?')}^3: {r('matmul_square', 'FLOP/s')}); "
            f"the output head's f32 backward matmuls {r('f32_matmul', 'FLOP/s')}; device copy "
            f"(x * 2, {cal['copy_bytes'] / GiB:g} GiB, read + write) {r('copy', 'B/s')}"
            + (f" ({rate(cal['copy_4gib'], 'B/s')} at 4 GiB)" if cal.get("copy_4gib") else "")
            + f"; {cal.get('attention_impl', '?')} attention fwd+bwd at the model's shapes {r('attention', 'FLOP/s')} "
            f"(3 x causal forward FLOPs); device -> pinned host {r('host', 'B/s')}.",
            "",
        ]
    lines += [
        "Peak: `memory_stats()['peak_bytes_in_use']`; XLA: `memory_analysis()` (temp + args + outputs - aliased); "
        "predicted: `accounting.training_memory` (largest phase) and `accounting.training_time` (calibrated: measured "
        "rates above, kernels adding up); roofline: `accounting.training_roofline` (datasheet peaks, perfect "
        "overlap); MFU: model FLOPs / (datasheet peak x measured step). Errors are predicted / measured - 1.",
        "",
        f"| policy | peak {unit} | XLA {unit} | predicted {unit} | error | predicted peak phase | step ms | predicted ms "
        f"(matmul + attn + memory) | error | predicted ms, {cal.get('matmul_n', 8192) if cal else 8192}^3 rate | roofline ms | MFU | "
        f"largest batch (measured) | predicted largest | peak {unit} at largest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pr = r.get("pred", {})
        if "seconds" not in r:
            lines.append(f"| {r['policy']} | {r.get('error', 'failed')} | | {fmt(pr.get('memory'), 1 / ub)} | | "
                         f"{pr.get('phase', '')} | | {fmt(pr.get('seconds'), 1e3, ',.1f')} | | "
                         f"{fmt(pr.get('seconds_square'), 1e3, ',.1f')} | {fmt(pr.get('roofline'), 1e3, ',.1f')} | | | "
                         f"{pr.get('largest', 'n/a')} | |")
            continue
        meas_mem = r.get("peak") or r.get("xla")
        parts = (f" ({pr['matmul_s'] * 1e3:,.1f} + {pr['attention_s'] * 1e3:,.1f} + {pr['memory_s'] * 1e3:,.1f}"
                 + (f"; host {pr['host_s'] * 1e3:,.1f}" if pr.get("host_s") else "") + ")") if "seconds" in pr else ""
        mfu = (pr["model_flops"] / (pr["peak_flops"] * r["seconds"])) if "model_flops" in pr else None
        s = r.get("search", {})
        if s.get("found") is not None:
            conf = {True: "", False: f" (step failed: {s.get('error', '?')})", None: " (not confirmed)"}[s.get("confirmed")]
            largest = f"{s['found']}{'' if s.get('bracketed') else ' (not bracketed)'}{conf}"
        else:
            largest = f"skipped: {s['skipped']}" if s.get("skipped") else "n/a"
        lines.append(
            f"| {r['policy']} | {fmt(r.get('peak'), 1 / ub)} | {fmt(r['xla'], 1 / ub)} | {fmt(pr.get('memory'), 1 / ub)} | "
            f"{err(pr.get('memory'), meas_mem)} | {pr.get('phase', '')} | {r['seconds'] * 1e3:,.1f} | "
            f"{fmt(pr.get('seconds'), 1e3, ',.1f')}{parts} | {err(pr.get('seconds'), r['seconds'])} | "
            f"{fmt(pr.get('seconds_square'), 1e3, ',.1f')} ({err(pr.get('seconds_square'), r['seconds'])}) | "
            f"{fmt(pr.get('roofline'), 1e3, ',.1f')} | {fmt(mfu, 100, '.1f')}{'%' if mfu else ''} | {largest} | "
            f"{pr.get('largest', 'n/a')} | {fmt(s.get('peak'), 1 / ub)} |"
        )
    searched = [r for r in rows if r.get("search", {}).get("probes")]
    if searched:
        lines += ["", f"Largest-batch probes (batch: XLA {unit}; limit "
                  f"{fmt(searched[0].get('bytes_limit'), 1 / ub)} {unit}: the device's bytes_limit or --capacity-gib):", ""]
        for r in searched:
            s = r["search"]
            lines.append(f"- {r['policy']}: planner {s['predicted']}; "
                         + ", ".join(f"{b}: {m / ub:.2f}" for b, m in s["probes"]))
    if notes:
        lines += ["", "Skipped or failed:", ""] + [f"- {n}" for n in notes]
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_remat.md").write_text(table + "\n")
        (out / "bench_remat.json").write_text(json.dumps(
            {"calibrate": cal, "rows": [{k: v for k, v in r.items() if k != "peak_buffers"} for r in rows],
             "notes": notes, "argv": sys.argv[1:]}, indent=1, default=str))
        for r in rows:
            if r.get("peak_buffers"):
                (out / f"peak_buffers_{r['policy']}.txt").write_text(r["peak_buffers"] + "\n")
        print(f"wrote {out / 'bench_remat.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
