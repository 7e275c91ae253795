"""Training throughput on one GPU: our train step in several variants vs. PyTorch, same run.

    python experiments/bench_train.py                       # the default table (1b, seq 2048, batch 8)
    python experiments/bench_train.py --model 350m --seq 4096 --batch 8
    python experiments/bench_train.py --variants cudnn/none/scan,pallas/none/scan --no-torch
    python experiments/bench_train.py --model tiny --seq 128 --batch 8 --steps 3 --no-torch   # CPU smoke

Each variant runs in its own subprocess so its peak memory and compile time are its own.
A variant is attention/remat/layers (layers: scan or unrolled). Reports tokens/s, step time,
MFU against the 989 TFLOP/s datasheet peak and against the bf16 matmul rate measured in this
run, peak device memory and compile time. FLOPs per token come from scaling.accounting
(dense matmuls x 6 + causal attention), the same count for PyTorch's row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

DEFAULT_VARIANTS = "cudnn/none/scan,cudnn/dots/scan,cudnn/selective/scan,cudnn/full/scan,cudnn/none/unrolled,xla/full/scan,pallas/none/scan"


def run_variant(args, variant: str) -> dict:
    import jax
    import numpy as np

    from scaling import accounting
    from scaling.config import load_config
    from scaling.train import global_batch, init_state, make_setup, make_train_step
    from scaling.sharding import use_sharding

    attn, remat, layers = variant.split("/")
    overrides = [
        "--data.source=synthetic",
        f"--train.batch_size={args.batch}",
        f"--train.seq_len={args.seq}",
        f"--train.steps={args.steps + args.warmup + 1}",
        f"--train.grad_accum={args.accum}",
        f"--attention.impl={attn}",
        f"--remat.policy={remat}",
        f"--model.scan_layers={'true' if layers == 'scan' else 'false'}",
        f"--model.max_seq_len={max(args.seq, 128)}",
        "--mesh.fsdp=1",
        "--checkpoint.enabled=false",
    ]
    cfg = load_config(f"configs/models/{args.model}.yaml", overrides)
    setup = make_setup(cfg, devices=jax.devices()[:1])
    state = init_state(setup)
    step = make_train_step(setup)
    rng = np.random.default_rng(0)
    batches = [
        global_batch(setup, rng.integers(0, cfg.model.vocab_size, (args.batch, args.seq + 1), dtype=np.int32))
        for _ in range(2)
    ]
    with use_sharding(setup.mesh, setup.rules):
        t0 = time.perf_counter()
        compiled = step.lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        for i in range(args.warmup):
            state, m = compiled(state, batches[i % 2])
        float(m["loss"])
        t0 = time.perf_counter()
        for i in range(args.steps):
            state, m = compiled(state, batches[i % 2])
        loss = float(m["loss"])  # blocks on the last step
        dt = (time.perf_counter() - t0) / args.steps
    stats = jax.devices()[0].memory_stats() or {}
    tokens = args.batch * args.seq
    flops = accounting.flops_per_token(cfg.model, args.seq)
    return {
        "variant": variant,
        "tokens_per_sec": tokens / dt,
        "step_time_ms": dt * 1e3,
        "tflops": flops.total * tokens / dt / 1e12,
        "peak_mem_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "compile_s": compile_s,
        "loss": loss,
        "flops_per_token": flops.total,
    }


def run_torch(args, compile_: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from scaling import accounting
    from scaling.config import load_config

    m = load_config(f"configs/models/{args.model}.yaml").model
    hf_cfg = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.mlp_dim,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.resolved_head_dim,
        max_position_embeddings=max(args.seq, m.max_seq_len),
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_cfg).cuda()  # f32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    data = torch.randint(0, m.vocab_size, (2, args.batch, args.seq + 1), device="cuda")

    # HF shifts labels internally, so labels = input_ids.
    def step_hf(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    fn = step_hf
    t0 = time.perf_counter()
    if compile_:
        model = torch.compile(model)
    torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup):
        fn(data[i % 2])
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(args.steps):
        loss = fn(data[i % 2])
    end.record()
    torch.cuda.synchronize()
    dt = start.elapsed_time(end) / 1e3 / args.steps
    tokens = args.batch * args.seq
    flops = accounting.flops_per_token(m, args.seq)
    return {
        "variant": f"pytorch {'compiled' if compile_ else 'eager'}",
        "tokens_per_sec": tokens / dt,
        "step_time_ms": dt * 1e3,
        "tflops": flops.total * tokens / dt / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "compile_s": compile_s,
        "loss": float(loss),
        "flops_per_token": flops.total,
    }


def matmul_rate() -> float:
    import jax
    import jax.numpy as jnp

    n = 8192
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def child(args, spec: str) -> int:
    try:
        if spec.startswith("torch"):
            res = run_torch(args, compile_=spec == "torch-compiled")
        elif spec == "matmul":
            res = {"variant": "matmul", "flops": matmul_rate()}
        else:
            res = run_variant(args, spec)
    except Exception as e:  # report, keep the table going
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        res = {"variant": spec, "error": msg}
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args, args.child)

    import jax

    specs = ["matmul", *args.variants.split(",")]
    if not args.no_torch:
        specs += ["torch-eager", "torch-compiled"]
    base = [sys.executable, __file__, "--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch),
            "--accum", str(args.accum), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    results = []
    for spec in specs:
        try:
            out = subprocess.run(base + ["--child", spec], capture_output=True, text=True, timeout=args.timeout)
            lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {"variant": spec, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
        except subprocess.TimeoutExpired:
            res = {"variant": spec, "error": f"timed out after {args.timeout}s"}
        results.append(res)
        print(json.dumps(res), flush=True)

    peak = 989e12
    matmul = next((r.get("flops") for r in results if r["variant"] == "matmul"), None)
    torch_c = next((r for r in results if r["variant"] == "pytorch compiled" and "error" not in r), None)
    dev = jax.devices()[0].device_kind
    lines = [
        f"# bench_train: {args.model}, batch {args.batch} x seq {args.seq}, accum {args.accum}",
        f"date {datetime.date.today()}, device {dev}, jax {jax.__version__}",
        f"measured bf16 matmul (8192^3): {matmul / 1e12:.0f} TFLOP/s" if matmul else "",
        "",
        "| variant (attention/remat/layers) | tokens/s | step ms | MFU (989) | MFU (measured matmul) | peak GiB | compile s | vs PyTorch compiled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["variant"] == "matmul":
            continue
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error']} | | | | | | |")
            continue
        ratio = f"{r['tokens_per_sec'] / torch_c['tokens_per_sec']:.2f}x" if torch_c else "-"
        mm = f"{r['tflops'] * 1e12 / matmul:.1%}" if matmul else "-"
        lines.append(
            f"| {r['variant']} | {r['tokens_per_sec']:,.0f} | {r['step_time_ms']:.1f} | {r['tflops'] * 1e12 / peak:.1%} | {mm} "
            f"| {r['peak_mem_gib']:.1f} | {r['compile_s']:.0f} | {ratio} |"
        )
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"bench_train_{args.model}_{args.seq}.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(os.environ["OUT"], f"bench_train_{args.model}_{args.seq}.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
