"""Decode steps at batches 2-8: XLA's layers against the Pallas and TMA layer kernels, same run.

Why: `layers="auto"` runs batch 1 on the megakernel but every larger batch on XLA's layers, which
reached only 45-53% of the copy bandwidth for the 1b at batch 8 (docs/benchmarks.md, thirty-second
session). The TMA projections (scaling/kernels/decode_tma.py) put up to 8 rows in wgmma's N
columns, so their cost should barely grow from batch 1 to 8; the Triton layer kernels' CUDA-core
products do grow. This script times each layer implementation at each batch, side by side, so
auto's choice above batch 1 rests on a measurement.

    PYTHONPATH=.:experiments python3 experiments/bench_small_batch.py --models 1b,llama2_7b \
        --batches 2,4,8 --prompts 128,2048

Writes `$OUT/small_batch.md` (and `.json`); the table so far after each case.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import numpy as np

import bench_decode
from scaling import decode
from scaling.kernels import decode_tma
from scaling.model import build_model

# name: Decoder keyword arguments (tma: decode_tma.TmaSettings projections, None: the default's)
VARIANTS = {
    "xla": dict(layers="xla"),
    "pallas": dict(layers="pallas"),
    "tma": dict(layers="pallas_tma"),
    "tma_all": dict(layers="pallas_tma", tma=decode_tma.PROJECTIONS),
    "tma_all_qkv": dict(layers="pallas_tma", tma=(*decode_tma.PROJECTIONS, decode_tma.QKV)),
}


def decoder_kwargs(variant: str) -> dict:
    if variant not in VARIANTS:
        raise SystemExit(f"--variants: unknown {variant!r}; allowed {sorted(VARIANTS)}")
    kw = dict(VARIANTS[variant])
    if "tma" in kw:
        kw["tma"] = decode_tma.TmaSettings(projections=tuple(kw["tma"]))
    return kw


def render(rows: list[dict], bw: dict, versions: dict) -> str:
    lines = [f"versions: {versions}", "copy bandwidth: " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in bw.items()), "",
             "| model | prompt | batch | variant | layers run | ms/step | tokens/s | % of copy BW | vs xla |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {(r["model"], r["prompt"], r["batch"]): r["step_ms"] for r in rows if r["variant"] == "xla" and "step_ms" in r}
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"| {r['model']} | {r['prompt']} | {r['batch']} | {r['variant']} | | {r.get('skip', '')} | | | |")
            continue
        ref = base.get((r["model"], r["prompt"], r["batch"]))
        ratio = f"{ref / r['step_ms']:.3f}x" if ref else ""
        lines.append(f"| {r['model']} | {r['prompt']} | {r['batch']} | {r['variant']} | {r['layers']} | "
                     f"{r['step_ms']:.3f} | {r['tok_s']:,.0f} | {100 * r['frac']:.1f}% | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="1b,llama2_7b")
    p.add_argument("--batches", default="2,4,8")
    p.add_argument("--prompts", default="128,2048")
    p.add_argument("--variants", default="xla,pallas,tma,tma_all,tma_all_qkv")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bw-gib", type=float, default=2)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        decoder_kwargs(v)  # (refuses unknown names before anything compiles)
    import jax

    versions = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
    bw = bench_decode.measure_bandwidth(int(args.bw_gib * (1 << 30)))
    peak = max(bw.values())  # (as bench_decode: JAX's wall-clock copy reads low, 2.8 against torch's 4.22 TB/s on an H200)
    print(f"copy bandwidth {peak / 1e12:.2f} TB/s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    out = os.environ.get("OUT")
    for name in args.models.split(","):
        cfg = bench_decode.preset(name)
        model = build_model(cfg)
        for variant in variants:
            row0 = {"model": name, "variant": variant}
            try:
                dec = decode.Decoder(model, attention="pallas", chunk=16, **decoder_kwargs(variant))
            except ValueError as e:
                rows.append({**row0, "prompt": "", "batch": "", "skip": f"{e}"[:200]})
                print(rows[-1], flush=True)
                continue
            for prompt in map(int, args.prompts.split(",")):
                for batch in map(int, args.batches.split(",")):
                    row = {**row0, "prompt": prompt, "batch": batch,
                           "layers": dec._step_layers(dec.bucket(batch)).value}
                    t = time.perf_counter()
                    try:
                        r = bench_decode.bench_ours(dec, cfg, batch, prompt, args.new_tokens, rng, args.reps)
                    except Exception as e:  # noqa: BLE001
                        row["skip"] = f"{type(e).__name__}: {str(e)[:200]}"
                    else:
                        row.update(r, frac=r["achieved_Bps"] / peak, wall_s=time.perf_counter() - t)
                    rows.append(row)
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                    if out:
                        Path(out, "small_batch.partial.md").write_text(render(rows, bw, versions))
            del dec
            gc.collect()
        del model
        gc.collect()
    table = render(rows, bw, versions)
    print(table)
    if out:
        Path(out, "small_batch.md").write_text(table)
        Path(out, "small_batch.json").write_text(json.dumps({"versions": versions, "bandwidth": bw, "rows": rows},
                                                            indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
