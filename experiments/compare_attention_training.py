"""Same training run with each attention implementation: do the loss curves agree?

    python experiments/compare_attention_training.py --impls xla,cudnn,pallas --steps 100

Trains the same model from the same initial parameters on the same batches (real text),
once per implementation, and prints the losses side by side. bf16 compute makes curves
differ by rounding; the cudnn-vs-xla difference is the yardstick for "within bf16 noise".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="25m")
    p.add_argument("--impls", default="xla,cudnn,pallas")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--data-path", default=None, help="text corpus (default: the embedded stdlib corpus)")
    p.add_argument("--override", action="append", default=[])
    args = p.parse_args()

    from scaling.config import load_config
    from scaling.train import train

    curves = {}
    for impl in args.impls.split(","):
        overrides = [
            f"--attention.impl={impl}",
            f"--train.steps={args.steps}",
            f"--train.batch_size={args.batch}",
            f"--train.seq_len={args.seq}",
            "--train.log_every=1",
            "--train.eval_every=0",
            "--data.tokenizer=byte",
            "--checkpoint.enabled=false",
            "--logging.progress=false",
            "--logging.tensorboard=false",
            "--mesh.fsdp=1",
            *(["--data.path=" + args.data_path] if args.data_path else []),
            *("--" + o for o in args.override),
        ]
        cfg = load_config(f"configs/models/{args.model}.yaml", overrides)
        run_dir = tempfile.mkdtemp(prefix=f"cmp-{impl}-")
        import jax

        train(cfg, run_dir, devices=jax.devices()[:1], log=lambda m: None)
        curves[impl] = [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"loss"' in line]
        print(f"{impl}: first {curves[impl][0]:.4f} last {curves[impl][-1]:.4f}", flush=True)

    ref = "xla" if "xla" in curves else next(iter(curves))
    lines = ["| step | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    for s in sorted({0, 4, 9, 24, 49, args.steps - 1} & set(range(args.steps))):
        lines.append(f"| {s + 1} | " + " | ".join(f"{c[s]:.4f}" for c in curves.values()) + " |")
    lines.append("")
    for impl, c in curves.items():
        if impl == ref:
            continue
        diffs = [abs(a - b) for a, b in zip(c, curves[ref])]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        lines.append(f"{impl} vs {ref}: max |loss diff| {max(diffs):.4f} (step {worst + 1}: {c[worst]:.4f} vs "
                     f"{curves[ref][worst]:.4f}), mean {sum(diffs) / len(diffs):.4f} over {len(diffs)} steps")
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):  # the table, and every step's loss so that outliers can be looked at
        with open(os.path.join(os.environ["OUT"], "compare_attention_training.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(os.environ["OUT"], "compare_attention_training.json"), "w") as f:
            json.dump(dict(argv=sys.argv, curves=curves), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
