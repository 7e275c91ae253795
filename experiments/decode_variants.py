"""Where does a batch-1 decode step's time go? Decode-step variants side by side, one GPU run.

    python experiments/decode_variants.py                        # the default variant table
    python experiments/decode_variants.py --models 1b --profile  # + a kernel-level trace summary

Each variant runs in its own process (XLA flags are read once, at backend start-up) and
times `--new-tokens` greedy decode steps of random bf16 weights at batch 1, prompt 128,
with experiments/bench_decode.py's measurement (same roofline: weights + filled KV bytes
over the copy bandwidth measured in the parent). A variant is a name, a set of XLA flags,
the decoder's `min_batch` (rows padded up to it, so M = 1 matmuls take the M >= 8 path) and
its decode attention (pallas: the flash-decoding kernel; fused: the kernel with RoPE and the
cache write folded in) and its layers (xla, or pallas: scaling.kernels.decode_gemv; pallas_tma
with its TMA gate/up, "+pdl" launching the TMA kernels by PDL, "+all" running the output,
down and head projections by TMA too, "+grid" those of them with enough CTAs).

`--profile` traces one decode call of the first variant op by op (profiling turns command
buffers off unless XLA is told otherwise) and prints the GPU kernels of one step: count,
total time, the idle time between kernels, and the top kernels by time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CMDBUF_LOOPS = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
CONCURRENT = "--xla_gpu_graph_enable_concurrent_region=true"
VARIANTS = {
    # name: (XLA flags, min_batch, decode attention, decode layers)
    "default": ("", None, "auto", "auto"),
    "batch1_pallas": ("", 1, "pallas", "xla"),
    "min_batch8": ("", 8, "pallas", "xla"),
    "fused_b8": ("", 8, "fused", "xla"),
    "fused_b8_concurrent": (CONCURRENT, 8, "fused", "xla"),
    "no_cmdbuf": ("--xla_gpu_enable_command_buffer=", 1, "pallas", "xla"),
    "cmdbuf_loops": (CMDBUF_LOOPS, 1, "pallas", "xla"),
    "cmdbuf_loops_min1": (CMDBUF_LOOPS + " --xla_gpu_graph_min_graph_size=1", 1, "pallas", "xla"),
    "cmdbuf_loops_b8": (CMDBUF_LOOPS + " --xla_gpu_graph_min_graph_size=1", 8, "pallas", "xla"),
    "concurrent_b8": (CONCURRENT, 8, "pallas", "xla"),
    # Autotuning every tiling: did not finish compiling within 200 s on an H200.
    "exhaustive_b8": ("--xla_gpu_exhaustive_tiling_search=true", 8, "pallas", "xla"),
    "no_triton_gemm": ("--xla_gpu_enable_triton_gemm=false", 1, "pallas", "xla"),
    "no_triton_gemm_b8": ("--xla_gpu_enable_triton_gemm=false", 8, "pallas", "xla"),
    "min_batch16": ("", 16, "pallas", "xla"),
    # scaling.kernels.decode_gemv: norm/RoPE/cache write/SwiGLU/residuals folded into 4 kernels
    "pallas_layers": ("", None, "pallas", "pallas"),
    "pallas_layers_concurrent": (CONCURRENT, None, "pallas", "pallas"),
    # + the flash-decoding splits merged by the kernel's last program (no combine kernel)
    "pallas_layers_combined": ("", None, "pallas_combined", "pallas"),
    # + the gate/up + SwiGLU streamed by TMA (scaling.kernels.decode_tma; Hopper)
    "pallas_layers_tma": ("", None, "pallas", "pallas_tma"),
    # + that kernel launched early by PDL (TmaSettings.pdl; "+pdl" below), with XLA's own
    # kernels as they are, and with XLA's PDL on too (its kernels wait at their start)
    "pallas_layers_tma_pdl": ("", None, "pallas", "pallas_tma+pdl"),
    "pallas_layers_tma_pdl_xla": ("--xla_gpu_enable_pdl=true", None, "pallas", "pallas_tma+pdl"),
    # every projection but q/k/v by TMA (TmaSettings.projections; "+all"): output, down, head too
    "pallas_layers_tma_all": ("", None, "pallas", "pallas_tma+all"),
    "pallas_layers_tma_all_pdl": ("--xla_gpu_enable_pdl=true", None, "pallas", "pallas_tma+all+pdl"),
    # the projections whose grid has >= decode_tma.MIN_CTAS CTAs ("+grid"): 1b gate/up and head,
    # 7b all four
    "pallas_layers_tma_grid": ("", None, "pallas", "pallas_tma+grid"),
    # + q/k/v by decode_tma.qkv_rope_tma, the cache written by the fused attention kernel (head_dim 128)
    "pallas_layers_tma_grid_qkv": ("", None, "pallas", "pallas_tma+grid+qkv"),
    # the same launched by PDL, with XLA's command buffers (CUDA graphs) and without them
    "pallas_layers_tma_grid_pdl": ("", None, "pallas", "pallas_tma+grid+pdl"),
    "pallas_layers_tma_grid_nocmdbuf": ("--xla_gpu_enable_command_buffer=", None, "pallas", "pallas_tma+grid"),
    "pallas_layers_tma_grid_pdl_nocmdbuf": ("--xla_gpu_enable_command_buffer=", None, "pallas", "pallas_tma+grid+pdl"),
    # q/k/v by TMA too, so the boundary from one layer's down projection to the next layer's
    # q/k/v is between two Mosaic kernels as well (twelfth session)
    "pallas_layers_tma_grid_qkv_pdl_nocmdbuf": ("--xla_gpu_enable_command_buffer=", None, "pallas",
                                                "pallas_tma+grid+qkv+pdl"),
    # XLA's own PDL alone: its kernels (and, if its Triton pipeline treats them alike, the Pallas
    # Triton kernels it compiles) wait at their start, so each may launch before the previous ends
    "pallas_layers_xla_pdl": ("--xla_gpu_enable_pdl=true", None, "pallas", "pallas"),
    # the decoder's default: Pallas layers for small batches, XLA above (on the row layout)
    "auto_layers": ("", None, "pallas", "auto"),
}


def run_one(args) -> dict:
    sys.path.insert(0, str(ROOT / "experiments"))
    sys.path.insert(0, str(ROOT))
    import numpy as np

    import bench_decode
    from scaling import decode
    from scaling.model import build_model

    out = {}
    for name in args.models.split(","):
        cfg = bench_decode.preset(name)
        model = build_model(cfg)
        from scaling.kernels.decode_gemv import LayerBlocks

        blocks = LayerBlocks.parse(args.gemv_blocks) if args.gemv_blocks else None
        from scaling.kernels import decode_tma

        layers, *options = args.layers.split("+")  # pallas_tma+pdl, +all (every projection by TMA)
        tma_blocks = (decode_tma.TmaBlocks(*(int(v) for v in args.tma_blocks.split("/"))) if args.tma_blocks
                      else decode_tma.DEFAULT_BLOCKS)
        projections = ("gate_up",)
        if "all" in options:
            projections = decode_tma.PROJECTIONS
        elif "grid" in options:
            projections = decode_tma.projections_by_grid(cfg, -(-cfg.vocab_size // decode.HEAD_ROWS) * decode.HEAD_ROWS,
                                                         tma_blocks)
        if "qkv" in options:
            projections = (*projections, decode_tma.QKV)
        tma = decode_tma.TmaSettings(projections=projections, pdl="pdl" in options, blocks=tma_blocks)
        dec = decode.Decoder(model, chunk=args.chunk, min_batch=args.min_batch, attention=args.attention,
                             layers=layers, gemv_blocks=blocks, tma=tma)
        del model
        t = time.perf_counter()
        r = bench_decode.bench_ours(dec, cfg, args.batch, args.prompt, args.new_tokens, np.random.default_rng(0))
        r["wall_s"] = time.perf_counter() - t
        out[name] = r
        print(f"  {name}: {r['step_ms']:.3f} ms/step, {r['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
        if args.profile_dir:
            out[name]["profile"] = profile(dec, cfg, args, Path(args.profile_dir) / name)
        del dec
    return out


def profile(dec, cfg, args, log_dir: Path) -> dict:
    """Trace one decode call; summarise the GPU kernels of one step."""
    import jax
    import numpy as np

    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    max_len = -(-(args.prompt + args.new_tokens) // 128) * 128
    dec.generate(prompts, dec.chunk + 1, max_len=max_len)
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        dec.generate(prompts, dec.chunk + 1, max_len=max_len)
    traces = sorted(log_dir.rglob("perfetto_trace.json.gz"))
    if not traces:
        return {"error": f"no perfetto trace under {log_dir}"}
    try:
        return summarise(traces[-1], steps=dec.chunk)
    except ValueError as e:  # e.g. the module was not found under that name
        return {"error": str(e)[:300]}


def summarise(path: Path, steps: int, top: int = 25) -> dict:
    """Per decode step, from scaling.profile_summary over the decode chunk's module (`steps`
    steps; the prefill is another module): kernel count, busy/idle time, top kernels."""
    from scaling.profile_summary import summarize_path

    s, _ = summarize_path(path, steps=steps, module="jit__decode_chunk", top=top)
    n_kernels = sum(c["count"] for c in s["categories"].values())
    return {
        "module": s["module"],
        "kernels_per_step": n_kernels / steps,
        "busy_us_per_step": s["busy_us"] / steps,
        "span_us_per_step": s["window_us"] / steps,
        "idle_us_per_step": s["idle_us"] / steps,
        "mean_kernel_us": s["kernel_us"] / max(n_kernels, 1),
        "top": [{"name": r["name"][:90], "count_per_step": r["count"] / steps, "us_per_step": r["us"] / steps}
                for r in s["top_kernels"]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b,llama2_7b")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="trace the first variant and summarise its kernels")
    ap.add_argument("--bw-gib", type=float, default=4.0, help="buffer size of the bandwidth measurement")
    ap.add_argument("--tag", default="decode_variants", help="file name stem of the outputs")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--min-batch", type=lambda v: None if v == "None" else int(v), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--attention", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--profile-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layers", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--tma-blocks", default="", help="layers='pallas_tma': block_f/block_k/stages of the TMA "
                    "gate/up kernel (default decode_tma.DEFAULT_BLOCKS)")
    ap.add_argument("--gemv-blocks", default="", help="Pallas layer tiles, a decode_gemv.LayerBlocks.parse spec "
                    "(e.g. qkv=256/16/2/4/4,gate_up=512/64/1/8/1)")
    args = ap.parse_args()

    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0

    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    sys.path.insert(0, str(ROOT / "experiments"))
    sys.path.insert(0, str(ROOT))
    import bench_decode

    bw = bench_decode.measure_bandwidth(int(args.bw_gib * (1 << 30)))
    peak_bw = max(bw.values())
    print(f"copy bandwidth: { {k: f'{v / 1e12:.2f} TB/s' for k, v in bw.items()} }", flush=True)
    out_dir = Path(os.environ.get("OUT", ROOT / "runs" / "decode_variants"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for i, name in enumerate(args.variants.split(",")):
        flags, min_batch, attention, layer_impl = VARIANTS[name]
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        cmd = [sys.executable, __file__, "--one", name, "--models", args.models, "--batch", str(args.batch),
               "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--chunk", str(args.chunk),
               "--min-batch", str(min_batch), "--attention", attention, "--layers", layer_impl,
               "--gemv-blocks", args.gemv_blocks, "--tma-blocks", args.tma_blocks]
        if args.profile and i == 0:
            cmd += ["--profile-dir", str(out_dir / f"trace_{args.tag}")]
        print(f"[{name}] XLA_FLAGS={env['XLA_FLAGS']!r} min_batch={min_batch} attention={attention} layers={layer_impl}",
              flush=True)
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            results[name] = json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-1500:]}
            sys.stderr.write(p.stderr[-600:] if not line else "")
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"timed out after {args.timeout} s"}
        print(f"[{name}] {time.perf_counter() - t:.0f} s", flush=True)

    lines = ["| variant | model | ms/step | tok/s | % of copy BW |", "|---|---|---|---|---|"]
    for name, res in results.items():
        if "error" in res:
            lines.append(f"| {name} | - | error: {res['error'][-200:]!r} | | |")
            continue
        for model, r in res.items():
            lines.append(f"| {name} | {model} | {r['step_ms']:.3f} | {r['tok_s']:,.0f} | "
                         f"{100 * r['bytes_per_step'] / (r['step_ms'] / 1e3) / peak_bw:.1f}% |")
    table = "\n".join(lines)
    print(table)
    for name, res in results.items():
        for model, r in (res.items() if "error" not in res else []):
            if "profile" in r:
                print(f"\nprofile {name} {model}: " + json.dumps({k: v for k, v in r["profile"].items() if k != "top"}))
                for row in r["profile"].get("top", []):
                    print(f"  {row['us_per_step']:8.1f} us  x{row['count_per_step']:5.1f}  {row['name']}")
    (out_dir / f"{args.tag}.json").write_text(json.dumps({"bandwidth": bw, "results": results}, indent=1))
    (out_dir / f"{args.tag}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
