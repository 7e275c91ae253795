"""Training throughput on one GPU: our train step in several variants vs. PyTorch, same run.

    python experiments/bench_train.py --out DIR          # default configs and variants, within --budget-s
    python experiments/bench_train.py --configs 1b:2048:8,1b:2048:16,350m:4096:8 --budget-s 520 --out DIR
    python experiments/bench_train.py --configs 1b:2048:8 --variants cudnn/none/unrolled \\
        --profile-variant cudnn/none/unrolled --no-torch --out DIR    # throughput + a profile summary
    python experiments/bench_train.py --configs tiny:64:4 --variants xla/none/scan --no-torch \\
        --profile-variant xla/none/scan --steps 3 --warmup 1 --out /tmp/b      # CPU smoke

A configuration is model:seq:batch (a preset in configs/models/). A variant is
attention/remat/layers[/section.key=value...]: attention xla|cudnn|pallas, remat
none|full|dots|selective|names (names keeps --remat-names), layers scan|unrolled; extra fields
are config overrides, e.g. cudnn/none/unrolled/train.loss_chunk=256. `--variants all` is every
attention x remat x layers combination (30). `--variants` applies to the first configuration,
`--other-variants` to the others. Every variant, the PyTorch peers (transformers
LlamaForCausalLM, bf16 autocast, SDPA, fused AdamW; eager and torch.compile) and the matmul
rate run each in its own subprocess, so peak memory and compile time are their own.

Order: the matmul rate; for each configuration its first variant and PyTorch compiled (the
headline ratio); the profiles; then PyTorch eager and the remaining variants. `--budget-s`
caps the whole invocation: a piece whose estimated time (measured from earlier pieces of the
same kind, else a prior from the step's FLOPs) would not fit in what is left is skipped and
reported as skipped; a running piece is cut at the budget.

Reports tokens/s, step time, MFU against the 989 TFLOP/s datasheet peak and against the bf16
matmul rate measured in this run, peak device memory, compile time, the loss of the first step
(same init and batch everywhere: equal up to numerics), and each piece's wall time. FLOPs per
token come from scaling.accounting (dense matmuls x 6 + causal attention), the same count for
PyTorch's rows. Writes bench_train.md and bench_train.json into --out (default $OUT), and per
profiled variant profile_<config>_<variant>.md/.json (scaling.profile_summary: device time per
step by category, idle gaps, top kernels); for the first profile also the Perfetto trace
(.perfetto.json.gz, open in ui.perfetto.dev) and the step's compiled HLO text (.hlo.txt.gz)
when each is under 15 MiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from anywhere

from scaling import strict_json  # noqa: E402  (standard library only: the parent stays free of JAX)

DEFAULT_CONFIGS = "1b:2048:8,350m:4096:8"
# First configuration: every remat policy on the best layout, the chunked loss, the other
# attention kernels (XLA's at `dots`: without remat it keeps every layer's f32 [B, K, G, T, S]
# scores, 4 GiB a layer at 8 x 2048), and scan vs unrolled. ~25 s each for 1b (process start
# and init ~8 s, compile ~10 s, 10 steps ~2.5 s).
DEFAULT_VARIANTS = (
    "cudnn/none/unrolled,cudnn/none/unrolled/train.loss_chunk=512,cudnn/dots/unrolled,cudnn/selective/unrolled,"
    "cudnn/names/unrolled,cudnn/full/unrolled,xla/dots/unrolled,pallas/none/unrolled,cudnn/none/scan"
)
DEFAULT_OTHER_VARIANTS = "cudnn/none/unrolled,cudnn/dots/unrolled"
ATTENTIONS = ("xla", "cudnn", "pallas")
REMATS = ("none", "full", "dots", "selective", "names")
LAYERS = ("unrolled", "scan")
PEAK = 989e12
MAX_FILE = 15 * 2**20


# ----------------------------------------------------------------------------- parsing


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: str
    seq: int
    batch: int

    @property
    def key(self) -> str:
        return f"{self.model}:{self.seq}:{self.batch}"


def presets() -> list[str]:
    """The model presets a configuration may name: configs/models/*.yaml."""
    return sorted(f[: -len(".yaml")] for f in os.listdir(os.path.join(ROOT, "configs", "models")) if f.endswith(".yaml"))


def parse_configs(text: str) -> list[BenchConfig]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = [p.strip() for p in item.split(":")]
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"configuration {item!r} must be model:seq:batch, e.g. 1b:2048:8")
        if parts[0] not in presets():
            raise ValueError(f"configuration {item!r}: no preset configs/models/{parts[0]}.yaml; "
                             f"allowed: {', '.join(presets())}")
        if int(parts[1]) < 1 or int(parts[2]) < 1:
            raise ValueError(f"configuration {item!r}: seq and batch must be >= 1")
        bc = BenchConfig(parts[0], int(parts[1]), int(parts[2]))
        if bc in out:  # (the report's sections and the results go by configuration)
            raise ValueError(f"configuration {bc.key!r} given twice")
        out.append(bc)
    if not out:
        raise ValueError("no configuration given")
    return out


def parse_variants(text: str) -> list[str]:
    if text.strip() == "all":
        return [f"{a}/{r}/{l}" for a in ATTENTIONS for r in REMATS for l in LAYERS]
    out = [v.strip() for v in text.split(",") if v.strip()]
    for v in out:
        variant_overrides(v, ("x",))  # validate early
    return out


def variant_overrides(variant: str, remat_names) -> list[str]:
    """attention/remat/layers[/section.key=value...] -> config overrides."""
    parts = variant.split("/")
    if len(parts) < 3:
        raise ValueError(f"variant {variant!r} must be attention/remat/layers[/section.key=value...]")
    attn, remat, layers, *extra = parts
    if attn not in ATTENTIONS + ("auto",):
        raise ValueError(f"variant {variant!r}: attention must be one of {ATTENTIONS + ('auto',)}")
    if remat not in REMATS + ("offload",):
        raise ValueError(f"variant {variant!r}: remat must be one of {REMATS + ('offload',)}")
    if layers not in LAYERS:
        raise ValueError(f"variant {variant!r}: layers must be one of {LAYERS}")
    out = [
        f"--attention.impl={attn}",
        f"--remat.policy={remat}",
        f"--model.scan_layers={'true' if layers == 'scan' else 'false'}",
    ]
    if remat in ("names", "offload"):
        out.append(f"--remat.names=[{', '.join(remat_names)}]")
    for e in extra:
        if "=" not in e or "." not in e.split("=", 1)[0]:
            raise ValueError(f"variant {variant!r}: extra field {e!r} must be section.key=value")
        out.append(f"--{e}")
    return out


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


# ----------------------------------------------------------------------------- children


def _setup(args, bc: BenchConfig, variant: str):
    import jax
    import numpy as np

    from scaling.config import load_config
    from scaling.train import global_batch, init_state, make_setup, make_train_step

    overrides = [
        "--data.source=synthetic",
        f"--train.batch_size={bc.batch}",
        f"--train.seq_len={bc.seq}",
        f"--train.steps={args.steps + args.warmup + args.profile_steps + 1}",
        f"--train.grad_accum={args.accum}",
        f"--model.max_seq_len={max(bc.seq, 128)}",
        "--mesh.fsdp=1",
        "--checkpoint.enabled=false",
        *variant_overrides(variant, args.remat_names.split(",")),
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "models", f"{bc.model}.yaml"), overrides)
    setup = make_setup(cfg, devices=jax.devices()[:1])
    state = init_state(setup)
    step = make_train_step(setup)
    rng = np.random.default_rng(0)
    batches = [
        global_batch(setup, rng.integers(0, cfg.model.vocab_size, (bc.batch, bc.seq + 1), dtype=np.int32))
        for _ in range(2)
    ]
    return cfg, setup, state, step, batches


def run_variant(args, bc: BenchConfig, variant: str, profile: bool = False) -> dict:
    import jax

    from scaling import accounting
    from scaling.sharding import use_sharding

    cfg, setup, state, step, batches = _setup(args, bc, variant)
    res: dict = {}
    with use_sharding(setup.mesh, setup.rules):
        t0 = time.perf_counter()
        compiled = step.lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        loss0 = None
        for i in range(args.warmup):
            state, m = compiled(state, batches[i % 2])
            if loss0 is None:
                loss0 = float(m["loss"])
        float(m["loss"])
        t0 = time.perf_counter()
        for i in range(args.steps):
            state, m = compiled(state, batches[i % 2])
        loss = float(m["loss"])  # blocks on the last step
        dt = (time.perf_counter() - t0) / args.steps
        if profile:
            res["profile"] = _profile(args, bc, variant, compiled, state, batches)
    stats = jax.devices()[0].memory_stats() or {}
    tokens = bc.batch * bc.seq
    flops = accounting.flops_per_token(cfg.model, bc.seq)
    res.update(
        {
            "tokens_per_sec": tokens / dt,
            "step_time_ms": dt * 1e3,
            "tflops": flops.total * tokens / dt / 1e12,
            "peak_mem_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
            "compile_s": compile_s,
            "loss0": loss0,
            "loss": loss,
            "flops_per_token": flops.total,
            "device": jax.devices()[0].device_kind,
        }
    )
    return res


def _profile(args, bc: BenchConfig, variant: str, compiled, state, batches) -> dict:
    """Trace --profile-steps steps (after warmup and timing), summarize, write into --out."""
    import jax

    from scaling import profile_summary

    n = args.profile_steps
    trace_dir = tempfile.mkdtemp(prefix="bench_trace_")
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0  # host Python frames are not what we look for; keeps the trace small
    jax.block_until_ready(state)
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=opts)
    t0 = time.perf_counter()
    for i in range(n):
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            state, m = compiled(state, batches[i % 2])
    jax.block_until_ready((state, m))
    wall_ms = (time.perf_counter() - t0) / n * 1e3
    jax.profiler.stop_trace()
    hlo_path = os.path.join(trace_dir, "step.hlo.txt.gz")
    with gzip.open(hlo_path, "wt") as f:
        f.write(compiled.as_text())
    s, trace_path = profile_summary.summarize_path(trace_dir, hlo_path)
    if s["steps_source"].startswith("unknown"):
        s, trace_path = profile_summary.summarize_path(trace_dir, hlo_path, steps=n)
    s["expected_steps"] = n
    s["profiled_step_wall_ms"] = wall_ms
    stem = f"profile_{safe_name(bc.key)}_{safe_name(variant)}"
    title = f"{bc.key} {variant}: {n} profiled steps, {wall_ms:.1f} ms/step wall while tracing"
    if s["steps"] != n:
        title += f" (WARNING: the trace counts {s['steps']} steps via {s['steps_source']})"
    md = profile_summary.to_markdown(s, title=title)
    print(md, flush=True)
    written = []
    os.makedirs(args.out, exist_ok=True)
    for name, data in ((f"{stem}.md", md), (f"{stem}.json", json.dumps(s, indent=1))):
        with open(os.path.join(args.out, name), "w") as f:
            f.write(data)
        written.append(name)
    if args.keep_trace:
        for src, name in ((str(trace_path), f"{stem}.perfetto.json.gz"), (hlo_path, f"{stem}.hlo.txt.gz")):
            if os.path.getsize(src) <= MAX_FILE:
                shutil.copy(src, os.path.join(args.out, name))
                written.append(name)
            else:
                print(f"not copied (over 15 MiB): {src} ({os.path.getsize(src) / 2**20:.0f} MiB)", flush=True)
    shutil.rmtree(trace_dir, ignore_errors=True)
    return {"files": written, "window_ms": s["window_us"] / s["steps"] / 1e3, "idle_ms": s["idle_us"] / s["steps"] / 1e3,
            "categories_ms": {k: v["us"] / s["steps"] / 1e3 for k, v in s["categories"].items()}}


def run_torch(args, bc: BenchConfig, compile_: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from scaling import accounting
    from scaling.config import load_config

    m = load_config(os.path.join(ROOT, "configs", "models", f"{bc.model}.yaml")).model
    hf_cfg = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.mlp_dim,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.resolved_head_dim,
        max_position_embeddings=max(bc.seq, m.max_seq_len),
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_cfg).cuda()  # f32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    data = torch.randint(0, m.vocab_size, (2, bc.batch, bc.seq + 1), device="cuda")

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
    loss0 = None
    for i in range(args.warmup):
        loss = fn(data[i % 2])
        if loss0 is None:
            loss0 = float(loss)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(args.steps):
        loss = fn(data[i % 2])
    end.record()
    torch.cuda.synchronize()
    dt = start.elapsed_time(end) / 1e3 / args.steps
    tokens = bc.batch * bc.seq
    flops = accounting.flops_per_token(m, bc.seq)
    return {
        "tokens_per_sec": tokens / dt,
        "step_time_ms": dt * 1e3,
        "tflops": flops.total * tokens / dt / 1e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "compile_s": compile_s,
        "loss0": loss0,
        "loss": float(loss),
        "flops_per_token": flops.total,
        "device": torch.cuda.get_device_name(),
    }


def matmul_rate() -> dict:
    import jax
    import jax.numpy as jnp

    n = 8192
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    # 10 calls queued back to back per sample, one wait: a wait after each call had added the
    # host's round trip to every 1.4 ms product (597-631 TFLOP/s where queued calls give 710-777
    # on an H200, docs/benchmarks.md "Forty-eighth session")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready([f(a, b) for _ in range(10)])
        times.append((time.perf_counter() - t0) / 10)
    return {"flops": 2 * n**3 / sorted(times)[len(times) // 2], "device": jax.devices()[0].device_kind,
            "jax": jax.__version__}


def child(args) -> int:
    spec = args.child
    bc = parse_configs(args.child_config)[0] if args.child_config else None
    try:
        if spec == "matmul":
            res = matmul_rate()
        elif spec in ("torch-eager", "torch-compiled"):
            res = run_torch(args, bc, compile_=spec == "torch-compiled")
        elif spec.startswith("profile:"):
            res = run_variant(args, bc, spec[len("profile:"):], profile=True)
        else:
            res = run_variant(args, bc, spec)
    except Exception as e:  # report, keep the table going
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        res = {"error": msg}
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Piece:
    spec: str  # matmul | torch-eager | torch-compiled | profile:<variant> | <variant>
    config: BenchConfig | None
    priority: int

    @property
    def kind(self) -> str:
        if self.spec in ("matmul", "torch-eager", "torch-compiled"):
            return self.spec
        return "profile" if self.spec.startswith("profile:") else "jax"

    @property
    def label(self) -> str:
        return {"torch-eager": "pytorch eager", "torch-compiled": "pytorch compiled"}.get(self.spec, self.spec)


def make_plan(configs, variants, other_variants, *, torch: bool, matmul: bool, profile_variants=(),
              profile_config: BenchConfig | None = None, torch_eager: bool = True) -> list[Piece]:
    """Pieces in the order they run: headline pieces first, so a budget cuts the extras."""
    pieces = []
    if matmul:
        pieces.append(Piece("matmul", None, 0))
    for i, bc in enumerate(configs):
        vs = variants if i == 0 else other_variants
        if vs:
            pieces.append(Piece(vs[0], bc, 1))
        if torch:
            pieces.append(Piece("torch-compiled", bc, 1))
    for v in profile_variants:
        pieces.append(Piece(f"profile:{v}", profile_config or configs[0], 2))
    for i, bc in enumerate(configs):
        vs = variants if i == 0 else other_variants
        if torch and torch_eager:
            pieces.append(Piece("torch-eager", bc, 3))
        for v in vs[1:]:
            pieces.append(Piece(v, bc, 3 if i == 0 else 4))
    return sorted(pieces, key=lambda p: p.priority)  # stable: keeps the order within a priority


def step_seconds_prior(bc: BenchConfig) -> float:
    """A rough step time from the model's FLOPs at 45% of the datasheet peak."""
    try:
        from scaling import accounting
        from scaling.config import load_config

        m = load_config(os.path.join(ROOT, "configs", "models", f"{bc.model}.yaml"), [f"--model.max_seq_len={max(bc.seq, 128)}"]).model
        return accounting.flops_per_token(m, bc.seq).total * bc.seq * bc.batch / (0.45 * PEAK)
    except Exception:
        return 0.3


def estimate(piece: Piece, done: list[dict], *, steps: int, warmup: int, profile_steps: int) -> float:
    """Seconds this piece will take: measured pieces of the same kind first, else a prior."""
    same = [r["wall_s"] for r in done if r.get("kind") == piece.kind and r.get("config") == (piece.config.key if piece.config else None) and "wall_s" in r]
    if same:
        return max(same)
    if piece.kind == "matmul":
        return 15.0
    step_s = step_seconds_prior(piece.config)
    n = steps + warmup
    prior = {
        "jax": 25 + n * step_s * 1.3,
        "profile": 45 + (n + profile_steps) * step_s * 1.3,
        "torch-eager": 25 + n * step_s * 1.5,
        "torch-compiled": 75 + n * step_s * 1.2,
    }[piece.kind]
    if piece.kind == "profile":  # a plain variant of the same config measured: add the trace's cost
        jax_same = [r["wall_s"] for r in done if r.get("kind") == "jax" and r.get("config") == piece.config.key and "wall_s" in r]
        if jax_same:
            return max(jax_same) + 20 + profile_steps * step_s * 1.5
    other = [r["wall_s"] for r in done if r.get("kind") == piece.kind and "wall_s" in r]
    return max(other) if other and piece.kind != "profile" else prior


def run_piece(args, piece: Piece, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", piece.spec, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--accum", str(args.accum), "--remat-names", args.remat_names,
           "--profile-steps", str(args.profile_steps), "--out", args.out]
    if piece.config:
        cmd += ["--child-config", piece.config.key]
    if args.keep_trace:
        cmd.append("--keep-trace")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if out.stdout:
            print("\n".join(l for l in out.stdout.splitlines() if not l.startswith("RESULT ")), flush=True)
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        res = json.loads(lines[-1][7:]) if lines else {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    except subprocess.TimeoutExpired:
        res = {"error": f"timed out after {timeout:.0f}s"}
    return res


def run_plan(plan: list[Piece], args, *, t_start: float, runner=None, clock=time.monotonic) -> list[dict]:
    """Run the pieces in order; skip (and report) any whose estimate exceeds what is left of --budget-s."""
    runner = runner or run_piece
    results: list[dict] = []
    first_profile = True
    for piece in plan:
        left = args.budget_s - (clock() - t_start)
        est = estimate(piece, results, steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps)
        rec = {"variant": piece.label, "config": piece.config.key if piece.config else None, "kind": piece.kind,
               "estimate_s": est}
        if est > left:
            rec["skipped"] = f"budget (needs ~{est:.0f} s, {max(left, 0):.0f} s left)"
        else:
            keep = args.keep_trace
            if piece.kind == "profile":  # only 8 files come back from $OUT: one trace
                args.keep_trace = keep and first_profile
                first_profile = False
            t0 = clock()
            rec.update(runner(args, piece, timeout=max(min(args.timeout, left), 5)))
            args.keep_trace = keep
            rec["wall_s"] = clock() - t0
        results.append(rec)
        print(json.dumps(rec), flush=True)
    return results


# ----------------------------------------------------------------------------- the report


def _cell(text) -> str:
    """Text as one markdown table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def format_report(results: list[dict], configs: list[BenchConfig], meta: dict) -> str:
    matmul = next((r.get("flops") for r in results if r["variant"] == "matmul" and "flops" in r), None)
    lines = [
        f"# bench_train: {', '.join(c.key for c in configs)} (model:seq:batch)",
        f"date {meta['date']}, device {meta.get('device', '?')}, jax {meta.get('jax', '?')}, "
        f"steps {meta['steps']} after {meta['warmup']} warmup, accum {meta['accum']}, "
        f"budget {meta['budget_s']:.0f} s, used {meta['elapsed_s']:.0f} s",
        f"measured bf16 matmul (8192^3): {matmul / 1e12:.0f} TFLOP/s" if matmul else "measured bf16 matmul: not run",
    ]
    for bc in configs:
        rows = [r for r in results if r.get("config") == bc.key and not r["variant"].startswith("profile:")]
        torch_c = next((r for r in rows if r["variant"] == "pytorch compiled" and "tokens_per_sec" in r), None)
        lines += [
            "",
            f"## {bc.model}, seq {bc.seq}, batch {bc.batch}",
            "",
            "| variant (attention/remat/layers) | tokens/s | step ms | MFU (989) | MFU (measured matmul) | peak GiB "
            "| compile s | loss step 1 | vs PyTorch compiled | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            wall = f"{r['wall_s']:.0f}" if "wall_s" in r else ""
            if "skipped" in r:
                lines.append(f"| {r['variant']} | skipped: {_cell(r['skipped'])} | | | | | | | | |")
                continue
            if "error" in r:
                lines.append(f"| {r['variant']} | error: {_cell(r['error'])} | | | | | | | | {wall} |")
                continue
            ratio = f"{r['tokens_per_sec'] / torch_c['tokens_per_sec']:.2f}x" if torch_c else "-"
            mm = f"{r['tflops'] * 1e12 / matmul:.1%}" if matmul else "-"
            loss0 = f"{r['loss0']:.4f}" if r.get("loss0") is not None else "-"
            lines.append(
                f"| {r['variant']} | {r['tokens_per_sec']:,.0f} | {r['step_time_ms']:.1f} | {r['tflops'] * 1e12 / PEAK:.1%} "
                f"| {mm} | {r['peak_mem_gib']:.1f} | {r['compile_s']:.0f} | {loss0} | {ratio} | {wall} |"
            )
    profs = [r for r in results if r["variant"].startswith("profile:")]
    if profs:
        lines += ["", "## profiles", "", "| config | variant | step ms (timed) | window ms/step | idle ms/step | files | wall s |",
                  "|---|---|---|---|---|---|---|"]
        for r in profs:
            v = r["variant"][len("profile:"):]
            if "skipped" in r or "error" in r:
                why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
                wall = f"{r['wall_s']:.0f}" if "wall_s" in r else ""  # (a skipped piece ran for no time at all)
                lines.append(f"| {r['config']} | {v} | {_cell(why)} | | | | {wall} |")
                continue
            p = r.get("profile", {})
            lines.append(
                f"| {r['config']} | {v} | {r['step_time_ms']:.1f} | {p.get('window_ms', 0):.1f} | {p.get('idle_ms', 0):.1f} "
                f"| {', '.join(p.get('files', []))} | {r['wall_s']:.0f} |"
            )
    other = [r for r in results if r["variant"] == "matmul"]
    for r in other:
        if "wall_s" in r:
            lines.append(f"\nmatmul piece: {r['wall_s']:.0f} s wall")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None, help=f"model:seq:batch,... (default {DEFAULT_CONFIGS})")
    p.add_argument("--model", default=None, help="one configuration (with --seq, --batch) instead of --configs")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="for the first configuration; 'all' for every combination")
    p.add_argument("--other-variants", default=DEFAULT_OTHER_VARIANTS, help="for the other configurations")
    p.add_argument("--remat-names", default="query_proj,key_proj,value_proj,out_proj", help="tags the `names` policy keeps")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-torch-eager", action="store_true", help="PyTorch compiled only (the ratio's peer)")
    p.add_argument("--no-matmul", action="store_true", help="skip the bf16 matmul rate (always skipped on CPU)")
    p.add_argument("--budget-s", type=float, default=510.0, help="cap on this whole invocation, seconds")
    p.add_argument("--timeout", type=int, default=240, help="seconds per piece at most")
    p.add_argument("--profile-variant", default="", help="variant(s) to trace, comma-separated")
    p.add_argument("--profile-config", default=None, help="model:seq:batch of the profile (default: the first configuration)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--keep-trace", action=argparse.BooleanOptionalAction, default=True,
                   help="copy the first profile's Perfetto trace and HLO text into --out")
    p.add_argument("--out", default=os.environ.get("OUT") or None, help="output folder (default $OUT)")
    p.add_argument("--dry-run", action="store_true", help="print the plan with prior time estimates; run nothing")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(ROOT, "runs", f"bench_train-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    if args.child:
        return child(args)

    t_start = time.monotonic()
    one = (args.model, args.seq, args.batch)
    if any(x is not None for x in one):
        if args.configs is not None:
            p.error("give --configs or --model/--seq/--batch, not both")
        args.configs = f"{args.model or '1b'}:{2048 if args.seq is None else args.seq}:{8 if args.batch is None else args.batch}"
    for flag, least in (("steps", 1), ("warmup", 1), ("profile_steps", 1), ("accum", 1), ("timeout", 1)):
        if getattr(args, flag) < least:  # (warm-up: the first step's loss, and the compile outside the timing)
            p.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        p.error(f"--budget-s must be a finite number > 0, got {args.budget_s}")
    try:
        configs = parse_configs(args.configs or DEFAULT_CONFIGS)
        variants = parse_variants(args.variants)
        other_variants = parse_variants(args.other_variants)
        profile_variants = parse_variants(args.profile_variant)
        profile_config = parse_configs(args.profile_config)[0] if args.profile_config else None
    except ValueError as e:
        p.error(str(e))
    if profile_config and not profile_variants:
        p.error("--profile-config names the configuration of --profile-variant, which is not given")
    for bc in configs + ([profile_config] if profile_config else []):
        if bc.batch % args.accum:
            p.error(f"--accum {args.accum} does not divide the batch of configuration {bc.key}")
    if not args.remat_names.strip() or not all(n.strip() for n in args.remat_names.split(",")):
        p.error(f"--remat-names {args.remat_names!r}: a comma list of tags, none empty")
    if not args.dry_run:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            p.error(f"--out {args.out!r} is not a folder")
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            p.error(f"--out {args.out!r}: cannot make the folder ({e.strerror or e})")
        if not os.access(args.out, os.W_OK | os.X_OK):
            p.error(f"--out {args.out!r}: the folder is not writable")
    profile_variants = list(profile_variants)
    if args.keep_trace and len(profile_variants) > 2:
        print("note: more than 2 profiles write more than 8 files into --out, and only 8 come back from $OUT")
    on_cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu" or not (
        shutil.which("nvidia-smi") or os.path.exists("/dev/nvidiactl")) and not args.dry_run
    plan = make_plan(configs, variants, other_variants, torch=not args.no_torch and not on_cpu,
                     matmul=not args.no_matmul and not on_cpu, profile_variants=profile_variants,
                     profile_config=profile_config, torch_eager=not args.no_torch_eager)
    if not plan:
        p.error("nothing to run: no variant, profile, PyTorch or matmul piece (on the CPU only variants and profiles run)")
    if args.dry_run:
        total = 0.0
        for pc in plan:
            est = estimate(pc, [], steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps)
            total += est
            print(f"{total:6.0f} s  {est:5.0f} s  {pc.label} @ {pc.config.key if pc.config else '-'}")
        print(f"prior total {total:.0f} s against a budget of {args.budget_s:.0f} s (measured pieces refine it while running)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    print(f"plan ({len(plan)} pieces, budget {args.budget_s:.0f} s): " + ", ".join(
        f"{pc.label}@{pc.config.key}" if pc.config else pc.label for pc in plan), flush=True)

    results = run_plan(plan, args, t_start=t_start)
    dev = next((r for r in results if "device" in r), {})
    meta = {
        "date": str(datetime.date.today()),
        "device": dev.get("device", "?"),
        "jax": next((r["jax"] for r in results if "jax" in r), None) or _jax_version(),
        "steps": args.steps,
        "warmup": args.warmup,
        "accum": args.accum,
        "budget_s": args.budget_s,
        "elapsed_s": time.monotonic() - t_start,
        "argv": sys.argv[1:] if argv is None else list(argv),
    }
    report = format_report(results, configs, meta)
    print(report)
    with open(os.path.join(args.out, "bench_train.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out, "bench_train.json"), "w") as f:
        json.dump(strict_json.strict({"meta": meta, "results": results}), f, indent=1, allow_nan=False)
    return 0


def _jax_version() -> str:
    try:
        from importlib.metadata import version

        return version("jax")
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
