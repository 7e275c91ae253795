"""Training throughput on 1 GPU, then 2 GPUs as data=2 and as fsdp=2: tokens/s, MFU, scaling.

    python experiments/bench_multigpu.py                       # 1b preset, bf16, seq 2048
    python experiments/bench_multigpu.py --batch-per-device 8  # fix the batch instead of filling memory
    python experiments/bench_multigpu.py --model tiny --steps 3 --cpu-devices 8   # CPU smoke run

Weak scaling: every run keeps the same batch per device, so the 2-device runs process twice
the tokens per step, and scaling efficiency = tokens/s per device of a run / tokens/s per
device of the first run in --runs (the single device by default).
MFU = flops_per_token x tokens/s / (devices x peak bf16 FLOP/s), with the FLOPs of
scaling.accounting (dense matmuls + causal attention, training = 3 x forward; remat
recompute is not counted, as in PaLM's MFU) and the peak of scaling.hardware.
Beside each measured step: `accounting.training_time`'s prediction at the hardware table's
rates, and the part of it that is collectives (the JSON keeps the overlapped and serial parts).
`--profile DIR` traces 3 more steps of each run after the timed ones (DIR/<run>/) and adds the
collective kernels' time per step per device from the trace (`scaling.profile_summary`), beside
the prediction's collectives, and the trace's idle time per step (no kernel on any device).

`--batch-per-device auto` (the default) compiles the 1-device step at batches 1 and 2, reads
XLA's memory analysis, extrapolates linearly to --memory-fraction of the device memory, and
halves on an out-of-memory error. The markdown table is printed and, when $OUT is set, also
written to $OUT/bench_multigpu.md (with the raw numbers in bench_multigpu.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="preset name in configs/models/ (default: 1b)")
    p.add_argument("--seq-len", type=int, default=2048, help="capped at the preset's max_seq_len")
    p.add_argument("--batch-per-device", default="auto", help="sequences per device, or 'auto' to fill memory")
    p.add_argument("--memory-fraction", type=float, default=0.85, help="share of device memory 'auto' aims for")
    p.add_argument("--device-memory-gib", type=float, default=0, help="memory per device for 'auto' when the device reports none (CPU)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run (the first compiles)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    p.add_argument("--remat", default="none", help="remat.policy (none, full, dots, ...)")
    p.add_argument("--attention", default="auto", help="attention.impl (auto, cudnn, pallas, xla)")
    p.add_argument("--cpu-devices", type=int, default=0, help="simulate N CPU devices (smoke test without a GPU)")
    p.add_argument("--profile", default="", help="trace 3 steps of each run into this folder (see above)")
    p.add_argument("--override", action="append", default=[], help="extra config override, e.g. model.num_layers=2")
    p.add_argument("--runs", default="single,data,fsdp", help=f"comma list of {', '.join(RUNS)} (the first is the "
                   "scaling baseline)")
    args = p.parse_args(argv)
    names = [r for r in args.runs.split(",") if r]
    bad = [r for r in names if r not in RUNS]
    if bad or not names:
        p.error(f"--runs: unknown {bad or 'empty list'}; choose from {', '.join(RUNS)}")
    args.runs = names
    return args


RUNS = {  # name: (label, devices, data, fsdp, tensor)
    "single": ("1 device", 1, 1, 1, 1),
    "data": ("2 devices, data=2", 2, 2, 1, 1),
    "fsdp": ("2 devices, fsdp=2", 2, 1, 2, 1),
    "tensor": ("2 devices, tensor=2", 2, 1, 1, 2),
}
ARGS = parse_args()
if ARGS.cpu_devices:
    # Must precede the first `import jax`.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ARGS.cpu_devices}"
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scaling import accounting, hardware  # noqa: E402
from scaling.config import load_config  # noqa: E402
from scaling.data import make_dataset  # noqa: E402
from scaling.sharding import use_sharding  # noqa: E402
from scaling.train import global_batch, init_state, make_setup, make_train_step  # noqa: E402

@dataclasses.dataclass
class Result:
    label: str
    devices: int
    mesh: str
    batch: int  # global, sequences
    seq_len: int
    step_time: float
    tokens_per_sec: float
    mfu: float | None
    efficiency: float | None = None
    # accounting.training_time at the hardware table's rates: the step, and its collectives' share
    # (training_time puts them all on the critical path, comm_serial; comm_overlapped is its 0)
    predicted: float | None = None
    comm_overlapped: float | None = None
    comm_serial: float | None = None
    # --profile: from a trace of 3 steps, per step and device (collective kernels), per step (idle)
    traced_collectives: float | None = None
    traced_idle: float | None = None


def make_config(n_devices: int, data: int, fsdp: int, batch_per_device: int, seq_len: int, tensor: int = 1):
    overrides = [
        "data.source=synthetic",
        f"model.compute_dtype={ARGS.dtype}",
        f"train.seq_len={seq_len}",
        f"train.batch_size={batch_per_device * n_devices}",
        f"train.steps={ARGS.warmup + ARGS.steps}",
        "optimizer.warmup_steps=0",
        "checkpoint.enabled=false",
        f"remat.policy={ARGS.remat}",
        f"attention.impl={ARGS.attention}",
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        f"mesh.tensor={tensor}",
        *ARGS.override,
    ]
    return load_config(ROOT / "configs" / "models" / f"{ARGS.model}.yaml", overrides)


def compiled_step(cfg, devices):
    setup = make_setup(cfg, devices=devices)
    state = init_state(setup)
    data = make_dataset(cfg, log=lambda *_: None)
    with use_sharding(setup.mesh, setup.rules):
        batches = [global_batch(setup, next(data.train)) for _ in range(2)]
        step = make_train_step(setup).lower(state, batches[0]).compile()
    return setup, state, batches, step


def step_bytes(cfg, devices) -> int | None:
    """Peak bytes per device XLA plans for one train step (arguments + outputs + temps)."""
    setup = make_setup(cfg, devices=devices)
    from scaling.train import abstract_state

    abs_state = abstract_state(setup)
    abs_batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), np.int32, sharding=setup.batch_sharding)
    with use_sharding(setup.mesh, setup.rules):
        mem = make_train_step(setup).lower(abs_state, abs_batch).compile().memory_analysis()
    if mem is None:
        return None
    # The state is donated, so its outputs alias its arguments.
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes)


def auto_batch(seq_len: int) -> int:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit") or ARGS.device_memory_gib * 2**30
    if not limit:
        print("batch: no device memory limit reported (CPU? see --device-memory-gib); using 2 per device", flush=True)
        return 2
    m1 = step_bytes(make_config(1, 1, 1, 1, seq_len), [device])
    m2 = step_bytes(make_config(1, 1, 1, 2, seq_len), [device])
    if m1 is None or m2 is None or m2 <= m1:
        print("batch: XLA gave no usable memory analysis; using 1 per device", flush=True)
        return 1
    per_seq, fixed = m2 - m1, m1 - (m2 - m1)
    b = max(1, int((ARGS.memory_fraction * limit - fixed) // per_seq))
    print(
        f"batch: {fixed / 2**30:.1f} GiB fixed + {per_seq / 2**30:.2f} GiB per sequence of {seq_len}; "
        f"{ARGS.memory_fraction:.0%} of {limit / 2**30:.0f} GiB -> {b} per device",
        flush=True,
    )
    return b


def is_oom(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def bench(label: str, n: int, data: int, fsdp: int, tensor: int, batch_per_device: int, seq_len: int) -> Result:
    devices = jax.devices()[:n]
    cfg = make_config(n, data, fsdp, batch_per_device, seq_len, tensor)
    setup, state, batches, step = compiled_step(cfg, devices)
    with use_sharding(setup.mesh, setup.rules):
        for i in range(ARGS.warmup):
            state, metrics = step(state, batches[i % 2])
        jax.block_until_ready((state, metrics))
        t0 = time.perf_counter()
        for i in range(ARGS.steps):
            state, metrics = step(state, batches[i % 2])
        jax.block_until_ready((state, metrics))
        dt = time.perf_counter() - t0
        traced = None
        if ARGS.profile:
            state, traced = profile(label, step, state, batches)
    loss = float(metrics["loss"])
    if not np.isfinite(loss):
        raise RuntimeError(f"{label}: non-finite loss {loss}")
    tokens_per_sec = ARGS.steps * cfg.train.batch_size * seq_len / dt
    hw = hardware.detect(devices[0])
    flops = accounting.flops_per_token(cfg.model, seq_len).total
    mfu = flops * tokens_per_sec / (hw.bf16_flops * n) if hw else None
    mesh = "x".join(f"{k}={v}" for k, v in setup.mesh.shape.items() if v > 1) or "single"
    st = accounting.training_time(cfg, accounting.MeshShape(data, fsdp, tensor, rules=cfg.mesh.rules), hw) if hw else None
    del state, batches, step
    return Result(label, n, mesh, cfg.train.batch_size, seq_len, dt / ARGS.steps, tokens_per_sec, mfu,
                  predicted=st.seconds if st else None, comm_overlapped=st.comm_seconds if st else None,
                  comm_serial=st.serial_comm_seconds if st else None, **(traced or {}))


PROFILED_STEPS = 3


def profile(label, step, state, batches) -> tuple:
    """(state, {collective kernel time per step per device, idle time per step}) from a trace of
    PROFILED_STEPS steps (the kernels of all devices are summed in the trace's totals)."""
    from scaling import profile_summary as ps

    folder = Path(ARGS.profile) / label.replace(" ", "_").replace(",", "").replace("=", "")
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        for i in range(PROFILED_STEPS):
            state, metrics = step(state, batches[i % 2])
        jax.block_until_ready((state, metrics))
    s, _ = ps.summarize_path(folder, steps=PROFILED_STEPS)
    (folder / "summary.md").write_text(ps.to_markdown(s, title=f"{label}: {PROFILED_STEPS} steps"))
    devices = max(1, s["devices"])
    return state, {"traced_collectives": s["categories"][ps.COLLECTIVE]["us"] / PROFILED_STEPS / devices * 1e-6,
                   "traced_idle": s["idle_us"] / PROFILED_STEPS * 1e-6}


def table(results: list[Result], header: str) -> str:
    lines = [
        header,
        "",
        "| run | devices | mesh | batch (seqs) | seq | step (ms) | tokens/s | tokens/s/device | MFU | scaling eff. "
        "| predicted ms | predicted / measured | of it, collectives ms |"
        + (" traced collectives ms | traced idle ms |" if ARGS.profile else ""),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if ARGS.profile else ""),
    ]
    for r in results:
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
        eff = f"{r.efficiency:.1%}" if r.efficiency is not None else "-"
        pred = (f"{r.predicted * 1e3:,.1f} | {r.predicted / r.step_time:.3f} | "
                f"{(r.comm_overlapped + r.comm_serial) * 1e3:,.2f}") if r.predicted else "n/a | n/a | n/a"
        lines.append(
            f"| {r.label} | {r.devices} | {r.mesh} | {r.batch} | {r.seq_len} | {r.step_time * 1e3:,.1f} | "
            f"{r.tokens_per_sec:,.0f} | {r.tokens_per_sec / r.devices:,.0f} | {mfu} | {eff} | {pred} |"
            + (f" {_ms(r.traced_collectives)} | {_ms(r.traced_idle)} |" if ARGS.profile else "")
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.2f}"


def main() -> int:
    if jax.device_count() < 2:
        print(f"error: needs 2 devices, found {jax.device_count()} ({jax.devices()})", file=sys.stderr)
        return 2
    preset = load_config(ROOT / "configs" / "models" / f"{ARGS.model}.yaml", ARGS.override)
    seq_len = min(ARGS.seq_len, preset.model.max_seq_len)
    if seq_len != ARGS.seq_len:
        print(f"seq_len: {ARGS.seq_len} exceeds the {ARGS.model} preset's max_seq_len; using {seq_len}")
    batch = auto_batch(seq_len) if ARGS.batch_per_device == "auto" else int(ARGS.batch_per_device)

    while True:
        try:
            results = run_all(batch, seq_len)
            break
        except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
            if not is_oom(e) or batch == 1:
                raise
            batch //= 2
            print(f"out of memory; rerunning every configuration at batch {batch} per device", flush=True)
        finally:
            gc.collect()
            jax.clear_caches()
    return report(results)


def run_all(batch: int, seq_len: int) -> list[Result]:
    """Every run at the same batch per device (weak scaling)."""
    results = []
    for label, n, data, fsdp, tensor in (RUNS[name] for name in ARGS.runs):
        print(f"{label}: batch {batch} per device x {n}, seq {seq_len} ...", flush=True)
        results.append(bench(label, n, data, fsdp, tensor, batch, seq_len))
        r = results[-1]
        print(f"  {r.tokens_per_sec:,.0f} tokens/s, step {r.step_time * 1e3:,.1f} ms", flush=True)
        gc.collect()
        jax.clear_caches()
    return results


def report(results: list[Result]) -> int:
    base = results[0].tokens_per_sec / results[0].devices  # per device, of the first run in --runs
    for r in results[1:]:
        r.efficiency = r.tokens_per_sec / (r.devices * base)
    dev = jax.devices()[0]
    header = (
        f"### {ARGS.model}: {dev.device_kind} ({jax.default_backend()}), compute {ARGS.dtype}, remat {ARGS.remat}, "
        f"attention {ARGS.attention}, {ARGS.steps} timed steps after {ARGS.warmup} warm-up"
    )
    md = table(results, header)
    print("\n" + md)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_multigpu.md").write_text(md + "\n")
        (Path(out) / "bench_multigpu.json").write_text(
            json.dumps({"args": vars(ARGS), "device": dev.device_kind, "results": [dataclasses.asdict(r) for r in results]}, indent=2)
        )
        print(f"\nwritten to {out}/bench_multigpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
