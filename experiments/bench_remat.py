"""Remat policies on one device: peak memory and step time, measured vs predicted, and the
largest batch each policy fits.

    python experiments/bench_remat.py                      # 1b preset, bf16, seq 2048 (GPU)
    python experiments/bench_remat.py --model tiny --steps 2   # CPU smoke run

Each (policy, batch) runs in its own subprocess: `peak_bytes_in_use` is a process-lifetime
high-water mark, and an out-of-memory failure must not end the sweep. Predictions come from
scaling.accounting (training_memory, training_roofline). One markdown table is printed and
written to $OUT/bench_remat.md when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("none", "full", "dots", "selective", "names", "offload")
# names: keep the q/k/v and out projections only (the attention side of `selective`).
NAMES = {"names": ("query_proj", "key_proj", "value_proj", "out_proj"),
         "offload": ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up")}
GiB = 2**30


def make_config(model: str, policy: str, batch: int, seq: int, steps: int):
    from scaling.config import load_config

    path = ROOT / "configs" / "models" / f"{model}.yaml"
    cfg = load_config(path if path.exists() else model)
    seq = min(seq, cfg.model.max_seq_len)
    overrides = [
        "--model.compute_dtype=bfloat16", f"--train.batch_size={batch}", f"--train.seq_len={seq}",
        f"--train.steps={steps + 1}", f"--remat.policy={policy}", "--mesh.data=1", "--mesh.fsdp=1", "--mesh.tensor=1",
        "--data.source=synthetic", "--checkpoint.enabled=false",
    ]
    if policy in NAMES:
        overrides.append(f"--remat.names=[{', '.join(NAMES[policy])}]")
    return load_config(path if path.exists() else model, overrides)


def run_one(args) -> dict:
    """In the subprocess: init, compile, time `steps` train steps, report peak memory."""
    import jax
    import numpy as np

    from scaling import accounting as acc
    from scaling import hardware
    from scaling.train import init_state, make_setup, make_train_step

    cfg = make_config(args.model, args.policy, args.batch, args.seq, args.steps)
    dev = jax.devices()[0]
    setup = make_setup(cfg, devices=[dev])
    state = init_state(setup)
    step = make_train_step(setup)
    rng = np.random.default_rng(0)
    batch = jax.device_put(
        rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), dtype=np.int32),
        setup.batch_sharding,
    )
    compiled = step.lower(state, batch).compile()
    ma = compiled.memory_analysis()
    xla_bytes = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    state, metrics = step(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - t0) / args.steps
    stats = dev.memory_stats() or {}
    hw = hardware.detect(dev)
    mesh = acc.MeshShape(1, 1, 1)
    mem = acc.training_memory(cfg, mesh, accelerator=jax.default_backend() != "cpu", hw=hw)
    roof = acc.training_roofline(cfg, mesh, hw) if hw else None
    return {
        "policy": args.policy, "batch": cfg.train.batch_size, "seq": cfg.train.seq_len,
        "peak": stats.get("peak_bytes_in_use"), "xla": xla_bytes, "predicted": mem.total,
        "seconds": seconds, "predicted_seconds": roof.step_seconds if roof else None,
        "mfu": roof.model_flops / (roof.peak_flops * seconds) if roof else None, "loss": float(metrics["loss"]),
    }


def spawn(args, policy: str, batch: int) -> dict | None:
    cmd = [sys.executable, __file__, "--one", "--model", args.model, "--policy", policy, "--batch", str(batch),
           "--seq", str(args.seq), "--steps", str(args.steps)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    err = (p.stderr.strip().splitlines() or ["?"])[-1]
    print(f"  {policy} batch {batch}: failed ({err[:160]})", file=sys.stderr)
    return None


def largest_batch(args, policy: str, start: int) -> int:
    """Doubling from `start` until a run fails (out of memory) or --max-batch; 0 if none ran."""
    best, b = 0, start
    while b <= args.max_batch:
        if spawn(args, policy, b) is None:
            break
        best, b = b, b * 2
    return best


def predicted_largest_batch(args, policy: str) -> int | None:
    from scaling import accounting as acc
    from scaling import hardware


    hw = hardware.detect()
    if hw is None:
        return None
    best, b = 0, 1
    while b <= args.max_batch:
        cfg = make_config(args.model, policy, b, args.seq, args.steps)
        if acc.training_memory(cfg, acc.MeshShape(1, 1, 1), hw=hw).total > hw.usable_bytes:
            break
        best, b = b, b * 2
    return best


def fmt_bytes(x) -> str:
    return "n/a" if x is None else f"{x / GiB:,.2f}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--max-batch", type=int, default=64, help="cap of the largest-batch search")
    p.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="none", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args)), flush=True)
        return 0

    rows = []
    for policy in args.policies.split(","):
        r = spawn(args, policy, args.batch)
        fit = None if args.no_search else largest_batch(args, policy, args.batch if r else 1)
        rows.append((policy, r, fit, predicted_largest_batch(args, policy)))
        print(f"{policy}: {r}, largest batch {fit}", file=sys.stderr, flush=True)

    seq = next((r["seq"] for _, r, _, _ in rows if r), args.seq)
    lines = [
        f"Remat policies, `{args.model}` preset, bf16 compute, batch {args.batch} x seq {seq}, one device "
        f"(peak: memory_stats peak_bytes_in_use; XLA: memory_analysis temp + args + outputs - aliased; "
        f"predicted: scaling.accounting.training_memory / training_roofline)",
        "",
        "| policy | peak GiB | XLA GiB | predicted GiB | step ms | predicted ms | MFU | largest batch | predicted largest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, r, fit, pfit in rows:
        if r is None:
            lines.append(f"| {policy} | failed | | | | | | {fit if fit is not None else 'n/a'} | {pfit or 'n/a'} |")
            continue
        pms = "n/a" if r["predicted_seconds"] is None else f"{r['predicted_seconds'] * 1e3:,.1f}"
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {policy} | {fmt_bytes(r['peak'])} | {fmt_bytes(r['xla'])} | {fmt_bytes(r['predicted'])} | "
            f"{r['seconds'] * 1e3:,.1f} | {pms} | {mfu} | {fit if fit is not None else 'n/a'} | "
            f"{pfit if pfit is not None else 'n/a'} |"
        )
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_remat.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
