"""Issue 10's meshes on 8 simulated devices: per-device bytes from the real shardings vs the
accounting prediction, and the predicted step time on 8 GPUs. Nothing is allocated: the
shardings come from `make_setup` (abstract shapes), bytes from `sharding.shard_shape`.

    python experiments/mesh_memory.py                   # 1b and llama3_8b, the four meshes
    python experiments/mesh_memory.py --hardware h200 --batch 16 --seq 2048
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MESHES = ((8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2))


def per_device_bytes(tree_abstract, tree_shardings) -> int:
    import math

    import jax
    import numpy as np

    total = 0
    for leaf, sh in zip(jax.tree.leaves(tree_abstract), jax.tree.leaves(tree_shardings)):
        total += math.prod(sh.shard_shape(tuple(leaf.shape))) * np.dtype(leaf.dtype).itemsize
    return total


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="1b,llama3_8b")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args()

    import jax

    from scaling import accounting, hardware
    from scaling.config import load_config
    from scaling.train import abstract_state, make_setup

    hw = hardware.get_hardware(args.hardware)
    rows = [
        "| model | mesh (data, fsdp, tensor) | params+opt GiB/device, from shardings | predicted | "
        f"predicted total GiB/device (batch {args.batch} x {args.seq}, remat none) | predicted step ms ({hw.name} x 8) | bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in args.models.split(","):
        for d, f, t in MESHES:
            cfg = load_config(
                f"configs/models/{model}.yaml",
                [f"--mesh.data={d}", f"--mesh.fsdp={f}", f"--mesh.tensor={t}", f"--train.batch_size={args.batch}",
                 f"--train.seq_len={args.seq}", "--model.compute_dtype=bfloat16", "--attention.impl=cudnn"],
            )
            setup = make_setup(cfg, devices=jax.devices()[:8])
            abstract = abstract_state(setup)
            measured = per_device_bytes(
                {"p": abstract["params"], "o": abstract["opt_state"]},
                {"p": setup.state_shardings["params"], "o": setup.state_shardings["opt_state"]},
            )
            mesh = accounting.MeshShape(d, f, t, cfg.mesh.rules)
            mem = accounting.training_memory(cfg, mesh, hw=hw)
            roof = accounting.training_roofline(cfg, mesh, hw)
            predicted = mem.params + mem.optimizer
            rows.append(
                f"| {model} | ({d}, {f}, {t}) | {measured / 2**30:.2f} | {predicted / 2**30:.2f} | {mem.total / 2**30:.1f} "
                f"| {roof.step_seconds * 1e3:.0f} | {roof.bound} |"
            )
            print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
