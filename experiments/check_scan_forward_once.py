"""Does the compiled train step run the flash forward once per layer? (GPU)

    python experiments/check_scan_forward_once.py --model 350m --batch 4 --seq 2048

Compiles the scanned remat-`none` step twice, with `train.train_step_compiler_options` (XLA:GPU's
dynamic-slice fusion off) and with XLA's defaults, and prints for each: the flash-forward custom
calls in the compiled HLO (the loop body is compiled once, so 1 means once per layer; XLA's
dynamic-slice fusion had cloned it into a second one that writes the scan's residual stacks) and
the step time over --steps steps (docs/benchmarks.md, "Forty-eighth session").
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def forward_calls(hlo: str) -> int:
    """Custom calls of the attention kernels' forward (op_name .../_forward/...) in HLO text."""
    return sum(1 for line in hlo.splitlines()
               if "custom-call(" in line and re.search(r'op_name="[^"]*_forward', line)
               and ("mosaic" in line or "triton" in line))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="350m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)

    import jax

    from scaling import train as T
    from scaling.config import load_config
    from scaling.data import make_dataset
    from scaling.sharding import use_sharding

    cfg = load_config(ROOT / "configs" / "models" / f"{args.model}.yaml", [
        "--data.source=synthetic", f"--train.batch_size={args.batch}", f"--train.seq_len={args.seq}",
        "--remat.policy=none", "--model.scan_layers=true", "--checkpoint.enabled=false"])
    ours = T.train_step_compiler_options(cfg)
    for label, options in (("train_step_compiler_options", ours), ("XLA defaults", {})):
        T.train_step_compiler_options = lambda cfg, o=options: o  # noqa: E731
        setup = T.make_setup(cfg, devices=jax.devices()[:1])
        state = T.init_state(setup)
        data = make_dataset(cfg, log=lambda *_: None)
        with use_sharding(setup.mesh, setup.rules):
            batch = T.global_batch(setup, next(data.train))
            step = T.make_train_step(setup).lower(state, batch).compile()
            calls = forward_calls(step.as_text())
            state, m = step(state, batch)
            jax.block_until_ready(m)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = step(state, batch)
            jax.block_until_ready(m)
        dt = (time.perf_counter() - t0) / args.steps
        print(f"{label} {options}: {calls} flash-forward custom call(s) in the HLO; step {dt * 1e3:.1f} ms; "
              f"loss {float(m['loss']):.4f}", flush=True)
        del state, step
    return 0


if __name__ == "__main__":
    sys.exit(main())
