"""The training loop's throughput from two source trees, alternating: `python -m scaling train`.

`bench_train.py` times the jitted step in a loop of its own; this times the whole loop users run
(data, dispatch, logging, what the loop waits on), so a change to `scaling/train.py` can be
compared with the tree before it in one run:

    git archive HEAD~1 scaling configs | tar -x -C /tmp/old
    python experiments/bench_train_loop.py --trees old=/tmp/old,new=. --rounds 2

Each run trains on synthetic tokens without checkpoints or eval; a configuration's tokens/s is
the median of its log records after the first (which includes the compile). Output: a markdown
table (and JSON) under --out, with each tree's tokens/s and their ratio to the first tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (config file, overrides): a step of ~0.4 s, ~10 ms and ~2 ms on an H200
DEFAULT_CONFIGS = {
    "1b b8 s2048": ("configs/models/1b.yaml", ["--train.batch_size=8", "--train.seq_len=2048", "--train.steps=40",
                                               "--train.log_every=5"]),
    "25m b16 s512": ("configs/models/25m.yaml", ["--train.batch_size=16", "--train.seq_len=512", "--train.steps=400",
                                                 "--train.log_every=50"]),
    "tiny b16 s128": ("configs/models/tiny.yaml", ["--train.batch_size=16", "--train.seq_len=128", "--train.steps=1000",
                                                   "--train.log_every=100"]),
}
COMMON = ["--data.source=synthetic", "--checkpoint.enabled=false", "--train.eval_every=0",
          "--logging.tensorboard=false"]


def run_once(tree: Path, config: str, overrides: list[str], timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "scaling", "train", "--config", config, *COMMON, *overrides,
               f"--run_dir={run_dir}"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tree)
        except subprocess.TimeoutExpired:  # (a row of its own: the other runs go on)
            return {"error": f"timed out after {timeout} s", "wall_s": time.perf_counter() - t0}
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout)[-2000:], "wall_s": wall}
        metrics = Path(run_dir) / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][1:]
        if not rates:  # (the first record includes the compile)
            return {"error": f"{len(records)} log records: no rate after the first (more steps or a smaller "
                             "--train.log_every)", "wall_s": wall}
        return {"tokens_per_sec": statistics.median(rates), "records": len(rates), "wall_s": wall,
                "mfu": statistics.median([r["mfu"] for r in records if r.get("mfu") is not None][1:] or [0.0])}


def parse_trees(text: str) -> dict[str, Path]:
    """--trees name=path,...: names unique, each path a source tree (with scaling/)."""
    trees: dict[str, Path] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, path = (x.strip() for x in item.partition("="))
        if not sep or not name or not path:
            raise ValueError(f"--trees: {item!r} is not name=path")
        if name in trees:
            raise ValueError(f"--trees: the name {name!r} is given twice")
        if not (Path(path) / "scaling" / "__init__.py").is_file():
            raise ValueError(f"--trees: {name}={path} is not a source tree (no {Path(path) / 'scaling' / '__init__.py'})")
        trees[name] = Path(path)
    if not trees:
        raise ValueError("--trees: none given")
    return trees


def format_table(results: dict, trees: list[str], configs: list[str]) -> str:
    """Each tree's tokens/s per run, and each other tree's ratio to the first (its median tokens/s
    over the first's: > 1 is faster)."""
    base, others = trees[0], trees[1:]
    head = ["config", *(f"{t} tokens/s" for t in trees), *(f"{t} / {base}" for t in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in configs:
        rates = {t: [x["tokens_per_sec"] for x in results[c][t] if "tokens_per_sec" in x] for t in trees}
        cells = [", ".join(f"{v:,.0f}" for v in rates[t]) or "failed" for t in trees]
        ratios = [f"{statistics.median(rates[t]) / statistics.median(rates[base]):.3f}"
                  if rates[t] and rates[base] else "-" for t in others]
        lines.append("| " + " | ".join([c, *cells, *ratios]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="name=path,name=path (the first is the ratio's base)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {list(DEFAULT_CONFIGS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=int, default=240, help="seconds per run at most")
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="output folder (default $OUT)")
    args = p.parse_args(argv)
    try:
        trees = parse_trees(args.trees)
    except ValueError as e:
        p.error(str(e))
    configs = list(dict.fromkeys(c.strip() for c in args.configs.split(",") if c.strip()))
    unknown = [c for c in configs if c not in DEFAULT_CONFIGS]
    if unknown or not configs:
        p.error(f"--configs: unknown {unknown}; allowed {list(DEFAULT_CONFIGS)}")
    for flag in ("rounds", "timeout"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {args.out!r} is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out!r}: cannot make the folder ({e.strerror or e})")
    if not os.access(out, os.W_OK | os.X_OK):
        p.error(f"--out {args.out!r}: the folder is not writable")
    results: dict[str, dict[str, list]] = {c: {t: [] for t in trees} for c in configs}
    for r in range(args.rounds):
        for c in configs:
            order = list(trees) if r % 2 == 0 else list(reversed(trees))  # alternate which tree goes first
            for t in order:
                res = run_once(trees[t], *DEFAULT_CONFIGS[c], args.timeout)
                results[c][t].append(res)
                print(f"round {r} {c} {t}: {json.dumps(res)[:300]}", flush=True)
    table = format_table(results, list(trees), configs)
    print(table)
    (out / "bench_train_loop.md").write_text(table + "\n")
    (out / "bench_train_loop.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
