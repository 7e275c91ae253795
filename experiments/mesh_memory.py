"""Issue 10's meshes on 8 simulated devices: per-device bytes from the real shardings vs the
accounting prediction, and the predicted step time on 8 GPUs. Nothing is allocated: the
shardings come from `make_setup` (abstract shapes), bytes from `sharding.shard_shape`.

    python experiments/mesh_memory.py                   # 1b and llama3_8b, the four meshes
    python experiments/mesh_memory.py --hardware h200 --batch 16 --seq 2048
    python experiments/mesh_memory.py --models tiny --batch 64 --seq 64 --xla --remat full

--xla also compiles each mesh's real train step on the 8 CPU devices (XLA attention: cuDNN does
not compile there) and adds XLA's memory analysis per device, args (params + AdamW state +
batch) and args + temp, beside the accounting's prediction for that program (the CPU's:
gradients allocated eagerly, XLA attention). What still differs is mostly XLA:CPU's own
buffers (the donated AdamW moments copied, the all-reduced [D, V] head gradient, layout
copies), not the model's: scaling/accounting.py and tests/test_accounting_xla.py say which.
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
    # strict: a sharding tree that does not match the state (a leaf missing) would pair each
    # array with another's sharding and undercount, silently.
    for leaf, sh in zip(jax.tree.leaves(tree_abstract), jax.tree.leaves(tree_shardings), strict=True):
        total += math.prod(sh.shard_shape(tuple(leaf.shape))) * np.dtype(leaf.dtype).itemsize
    return total


def num(x: float, decimals: int) -> str:
    """`decimals` places, or 2 significant digits where those would show (almost) nothing: the
    tiny model's 12 MB are 0.01 GiB, its step 0.4 ms."""
    if x and abs(x) < 10 ** (1 - decimals):
        return f"{x:.2g}"
    return f"{x:,.{decimals}f}"


def presets() -> list[str]:
    from pathlib import Path

    return sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "configs" / "models").glob("*.yaml"))


def check_args(p: argparse.ArgumentParser, args) -> dict:
    """Each model's config, or argparse's error (the flag, what is allowed; exit code 2): an
    unknown model or hardware, a batch or sequence length that no run could have, a batch one
    of the meshes cannot split (training refuses it: train.check_runnable)."""
    import math

    from scaling import accounting, hardware
    from scaling.config import ConfigError, RematPolicyName, load_config
    from scaling.sharding import axes as A

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in presets()]
    if not models or bad:
        p.error(f"--models: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'empty'}; allowed: a comma-separated "
                f"list of {', '.join(presets())}")
    try:
        args.hw = hardware.get_hardware(args.hardware)
    except ValueError as e:
        p.error(f"--hardware: {e}")
    for name in ("batch", "seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be a positive integer, got {getattr(args, name)}")
    plain = [r.value for r in RematPolicyName if r not in (RematPolicyName.names, RematPolicyName.offload)]
    if args.remat not in plain:  # names/offload need tags this script does not take
        p.error(f"--remat: {args.remat!r}; allowed: {', '.join(plain)}")
    configs = {}
    for model in models:
        try:
            base = load_config(f"configs/models/{model}.yaml")
        except ConfigError as e:
            p.error(f"--models {model}: {e}")
        if args.seq > base.model.max_seq_len:
            p.error(f"--seq: {args.seq} exceeds {model}'s model.max_seq_len={base.model.max_seq_len}")
        for d, f, t in MESHES:
            mesh = accounting.MeshShape(d, f, t, base.mesh.rules)
            shards = mesh.split(A.BATCH)
            if args.batch % shards:
                need = math.lcm(*(accounting.MeshShape(*m, base.mesh.rules).split(A.BATCH) for m in MESHES))
                p.error(f"--batch: {args.batch} sequences cannot be split over the {shards} devices that mesh "
                        f"(data, fsdp, tensor) = ({d}, {f}, {t}) puts the batch on (mesh.rules={base.mesh.rules}: "
                        f"{' x '.join(mesh.axes_of(A.BATCH, params=False))}); use a multiple of {need} "
                        f"(every mesh of the table)")
            configs[model, (d, f, t)] = load_config(
                f"configs/models/{model}.yaml",
                [f"--mesh.data={d}", f"--mesh.fsdp={f}", f"--mesh.tensor={t}", f"--train.batch_size={args.batch}",
                 f"--train.seq_len={args.seq}", "--model.compute_dtype=bfloat16", "--attention.impl=cudnn",
                 f"--remat.policy={args.remat}"],
            )
    return configs


def xla_header() -> str:
    return (" XLA:CPU args MiB/device | XLA:CPU args + temp MiB/device | predicted for that program MiB/device | "
            "predicted - XLA |")


def xla_cells(cfg) -> str:
    """XLA's per-device memory analysis of the real train step compiled on the 8 CPU devices, and
    the accounting's prediction for that program (the CPU's: eager gradients; XLA attention)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from scaling import accounting
    from scaling.config import AttentionImpl
    from scaling.train import abstract_state, make_setup, make_train_step

    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, impl=AttentionImpl.xla))
    setup = make_setup(cfg, devices=jax.devices()[:8])
    shape = (cfg.train.batch_size, cfg.train.seq_len + 1)
    batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.batch_sharding)
    ma = make_train_step(setup).lower(abstract_state(setup), batch).compile().memory_analysis()
    xla = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    mesh = accounting.MeshShape(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.rules)
    pred = accounting.training_memory(cfg, mesh, accelerator=False).total
    return (f" {num(ma.argument_size_in_bytes / 2**20, 1)} | {num(xla / 2**20, 1)} | {num(pred / 2**20, 1)} | "
            f"{(pred - xla) / xla:+.1%} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="1b,llama3_8b", help="comma-separated presets under configs/models/")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--remat", default="none", help="remat policy of the predictions (and of the --xla compiles)")
    p.add_argument("--xla", action="store_true", help="also compile each step on the CPU devices: XLA's bytes/device")
    args = p.parse_args(argv)
    configs = check_args(p, args)

    import jax

    from scaling import accounting
    from scaling.sharding import MeshError, ShardingError
    from scaling.train import abstract_state, make_setup

    hw = args.hw
    rows = [
        "| model | mesh (data, fsdp, tensor) | params+opt GiB/device, from shardings | predicted | "
        f"predicted total GiB/device (batch {args.batch} x {args.seq}, remat {args.remat}) | "
        f"predicted step ms ({hw.name} x 8) | bound |" + (xla_header() if args.xla else ""),
        "|---|---|---|---|---|---|---|" + ("---|" * 4 if args.xla else ""),
    ]
    for (model, (d, f, t)), cfg in configs.items():
        try:
            setup = make_setup(cfg, devices=jax.devices()[:8])
        except (MeshError, ShardingError) as e:
            print(f"error: {model} on mesh ({d}, {f}, {t}): {e}", file=sys.stderr)
            return 2
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
            f"| {model} | ({d}, {f}, {t}) | {num(measured / 2**30, 2)} | {num(predicted / 2**30, 2)} | "
            f"{num(mem.total / 2**30, 1)} | {num(roof.step_seconds * 1e3, 0)} | {roof.bound} |"
            + (xla_cells(cfg) if args.xla else "")
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
