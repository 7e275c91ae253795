"""Does the jitted train step compile once? Each attention core, three calls, in a fresh process.

Lowering a Pallas kernel can import modules lazily that add options to jax's trace context, so
the step's second call misses the jit cache and compiles again (seen on the CPU with the Pallas
interpreter: `scaling.attention.prepare`). This checks the cores on the machine it runs on:

    python experiments/check_recompile.py [--impls auto,pallas,cudnn,xla] [--seq 1024]

Prints, per core, the three calls' wall times and the step's jit cache entries (1 is right).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import jax, numpy as np
from scaling.config import load_config
from scaling.train import global_batch, init_state, make_setup, make_train_step
impl, seq = sys.argv[1], int(sys.argv[2])
cfg = load_config("configs/models/25m.yaml", [f"--attention.impl={impl}", "--data.source=synthetic",
    "--train.batch_size=4", f"--train.seq_len={seq}", "--mesh.fsdp=1", "--mesh.data=-1"])
setup = make_setup(cfg, devices=jax.devices()[:1])
state = init_state(setup)
step = make_train_step(setup)
rng = np.random.default_rng(0)
times = []
for i in range(3):
    batch = global_batch(setup, rng.integers(0, cfg.model.vocab_size, (4, seq + 1), dtype=np.int32))
    t = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    times.append(round(time.perf_counter() - t, 3))
print(json.dumps({"impl": impl, "seq": seq, "call_s": times, "cache_entries": step._cache_size(),
                  "loss": float(m["loss"])}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default="auto,pallas,cudnn,xla")
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args(argv)
    rows = []
    for impl in args.impls.split(","):
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, impl, str(args.seq)], capture_output=True, text=True,
                             timeout=600)
        line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
        row = json.loads(line) if line else {"impl": impl, "error": out.stderr[-1500:]}
        row["process_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return 0 if all(r.get("cache_entries") == 1 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
