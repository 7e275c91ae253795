"""A profiled training step's device time by kind of kernel beside `accounting.training_time`'s terms.

    python experiments/step_profile_vs_prediction.py docs/results/matmul_session48/profile_*.json

Reads the summaries `bench_train.py --profile-variant` writes (`profile_<model>-<seq>-<batch>_<variant>.json`,
one device; remat none, dots, selective or full) and prints, per step: bf16 matmul kernels (the matmul category without
the f32 head-backward `f32f32` kernels) and the TFLOP/s they ran at; the f32 ones; attention
(the attention category plus Pallas/Mosaic kernels, which the summary files under "other");
the memory-bound kernels (elementwise fusions + copies); each beside the prediction at the
hardware table's rates (--hardware). Which term is off, not only whether the sum is.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"profile_(?P<model>.+?)-(?P<seq>\d+)-(?P<batch>\d+)_(?P<attn>\w+)-(?P<remat>\w+)-(?P<layers>scan|unrolled)\.json$")


def measured(summary: dict) -> dict[str, float]:
    """Seconds per step by term, from a profile_summary dict (top_kernels holds the big f32 and Mosaic kernels)."""
    steps = summary["steps"]
    cat = {k: v["us"] / steps * 1e-6 for k, v in summary["categories"].items()}
    kernels = summary["top_kernels"]
    f32 = sum(k["us"] for k in kernels if "f32f32" in k["name"]) / steps * 1e-6
    mosaic = sum(k["us"] for k in kernels if k["category"] == "other" and "mosaic" in k["name"]) / steps * 1e-6
    # Profiled without command buffers, each kernel carries its HLO op, and the optimizer's
    # kernels (outside autodiff) get a category of their own; the accounting counts them as
    # memory-bound traffic like the rest. (Under command buffers they are elementwise fusions.)
    optimizer = cat.get("optimizer update (outside autodiff)", 0.0)
    return {"bf16 matmul": cat["matmul"] - f32, "f32 matmul": f32, "attention": cat["attention"] + mosaic,
            "memory-bound": cat["elementwise/reduction fusions"] + cat["copy/dynamic-update-slice"] + optimizer,
            "window": summary["window_us"] / steps * 1e-6}


POLICIES = ("none", "dots", "selective", "full")  # the ones a file name can say in full (names needs its list)


def predicted(model: str, seq: int, batch: int, layers: str, hw_name: str, remat: str = "none"):
    from scaling import accounting as acc
    from scaling.config import load_config
    from scaling.hardware import get_hardware

    cfg = load_config(ROOT / "configs" / "models" / f"{model}.yaml", [
        "--data.source=synthetic", f"--train.seq_len={seq}", f"--train.batch_size={batch}", f"--remat.policy={remat}",
        f"--model.scan_layers={'true' if layers == 'scan' else 'false'}"])
    st = acc.training_time(cfg, acc.MeshShape(), get_hardware(hw_name))
    terms = {"bf16 matmul": st.matmul_flops / st.rates.matmul, "f32 matmul": st.matmul_seconds - st.matmul_flops / st.rates.matmul,
             "attention": st.attention_seconds, "memory-bound": st.memory_seconds, "window": st.seconds}
    return terms, st.matmul_flops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", nargs="+", help="profile_<model>-<seq>-<batch>_<attn>-<remat>-<layers>.json files")
    p.add_argument("--hardware", default="h200", help="hardware table entry of the prediction")
    args = p.parse_args(argv)
    print("| step | term | measured ms | predicted ms | predicted / measured |\n|---|---|---:|---:|---:|")
    for path in args.profiles:
        m = NAME.search(Path(path).name)
        if not m or m["remat"] not in POLICIES:
            print(f"error: {path}: expected profile_<model>-<seq>-<batch>_<attn>-<{'|'.join(POLICIES)}>-"
                  "<scan|unrolled>.json",
                  file=sys.stderr)
            return 2
        meas = measured(json.loads(Path(path).read_text()))
        pred, flops = predicted(m["model"], int(m["seq"]), int(m["batch"]), m["layers"], args.hardware, m["remat"])
        step = f"{m['model']} {m['seq']}x{m['batch']} {m['layers']}" + ("" if m["remat"] == "none" else f" {m['remat']}")
        for term in meas:
            note = f" ({flops / meas[term] / 1e12:,.0f} TFLOP/s)" if term == "bf16 matmul" and meas[term] else ""
            print(f"| {step} | {term}{note} | {meas[term] * 1e3:,.1f} | {pred[term] * 1e3:,.1f} | "
                  f"{pred[term] / meas[term]:.3f} |" if meas[term] else f"| {step} | {term} | 0 | {pred[term] * 1e3:,.1f} | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
