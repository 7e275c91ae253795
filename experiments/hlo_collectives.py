"""The collectives XLA compiles into a sharded train step, by kind and dtype, beside the accounting's.

    PYTHONPATH=. python3 experiments/hlo_collectives.py --model 1b --mesh fsdp=2 --mesh tensor=2   # 2 GPUs
    PYTHONPATH=. XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python3 experiments/hlo_collectives.py --model tiny --mesh fsdp=2                            # CPU

For each mesh (over every visible device): compile the train step (no step runs), read the
optimized HLO, and count each collective instruction's output bytes by opcode and element type,
separately for the entry computation and for the computations a loop runs (the layers' scan:
those run once per layer). Beside them, `accounting.training_comms`' collectives for the same
config, and both summed per step and per kind: XLA's with every computation counted as often
as it runs (a while body its known trip count times its caller's) and in the accounting's
convention (a reduce-scatter by its input). `--set KEY=VALUE` adds config overrides (the
chunked loss, tied embeddings, grad accumulation, rule sets...). The recorded 2-H200 outputs
(docs/results/hlo_collectives_session47/) are what tests/test_accounting_gpu_collectives.py
holds the accounting to. XLA:CPU partitions differently (everything in f32, reduce-scatters as
all-reduces, 7 Megatron all-reduces per layer): its comparison is not the GPU's.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys

_INSTR = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                    r"(-start)?\(")
_ARRAY = re.compile(r"\b(f32|bf16|f16|s32|u32|pred)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def detail(hlo: str) -> list[tuple[str, str, str]]:
    """(computation, opcode, result shape) of every collective, in the HLO's order."""
    out, comp = [], "?"
    for line in hlo.splitlines():
        if line and not line[0].isspace() and "{" in line:
            comp = line.split("(")[0].replace("ENTRY", "").strip().lstrip("%")
        m = _INSTR.match(line)
        if m:
            out.append((comp, m.group(2), m.group(1).strip()))
    return out


def collectives(hlo: str) -> dict[tuple[str, str, str], list[int]]:
    """(where, opcode, dtype) -> [count, bytes]; where is 'entry' or 'loop body' (the rest)."""
    out: dict = collections.defaultdict(lambda: [0, 0])
    where = "loop body"
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            where = "entry"
        elif line and not line[0].isspace() and "{" in line:
            where = "loop body"
        m = _INSTR.match(line)
        if not m:
            continue
        results = _ARRAY.findall(m.group(1))
        if m.group(3) and len(results) > 1:
            results = results[len(results) // 2:]  # an async -start's tuple: (operands, outputs)
        # A combined collective's tuple result holds several arrays: all of them count (once).
        for dtype, dims in results:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            rec = out[(where, m.group(2), dtype)]
            rec[1] += n * _BYTES[dtype]
        if results:
            out[(where, m.group(2), results[0][0])][0] += 1
    return out


_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+)")
_REF = re.compile(r"%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")


def computations(hlo: str) -> dict[str, list[str]]:
    """name -> its instruction lines, in the HLO's order (callees before their callers)."""
    out: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            body = out.setdefault(_COMP.match(line).group(1), [])
        elif body is not None and line.startswith(" "):
            body.append(line)
    return out


def multiplicity(comps: dict[str, list[str]]) -> dict[str, int]:
    """How often each computation runs per step: a while body its known trip count times its
    caller's; anything else called (fusions, async wrappers, conditions) as often as its caller."""
    entry = next(reversed(comps))  # ENTRY comes last
    edges: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
    callers = dict.fromkeys(comps, 0)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line) if " while(" in line else None
            body = re.search(r"body=%([\w.\-]+)", line) if trip else None
            for ref in set(_REF.findall(line.split("(", 1)[1] if "(" in line else "")):
                if ref in comps and ref != name:
                    edges[name].append((ref, int(trip.group(1)) if body and ref == body.group(1) else 1))
                    callers[ref] += 1
    mult = dict.fromkeys(comps, 0)
    mult[entry] = 1
    ready = [name for name, n in callers.items() if n == 0]  # Kahn's order: every caller before its callees
    while ready:
        name = ready.pop()
        for ref, factor in edges[name]:
            mult[ref] += mult[name] * factor
            callers[ref] -= 1
            if not callers[ref]:
                ready.append(ref)
    return mult


def group_size(line: str, devices: int) -> int:
    """Devices in one replica group of a collective (all of them when the groups are empty)."""
    m = _MESH_GROUPS.search(line)  # mesh['data'=1,'fsdp'=2] {'fsdp'}: the named axes' sizes
    if m:
        sizes = {k.strip("'"): int(v) for k, v in (item.split("=") for item in m.group(1).split(","))}
        return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
    m = _IOTA_GROUPS.search(line)
    if m:
        return int(m.group(2))
    m = _LIST_GROUPS.search(line)
    return len(m.group(1).split(",")) if m else devices


def step_totals(hlo: str, devices: int) -> dict[tuple[str, str], float]:
    """(opcode, dtype) -> bytes per step of the arrays the collectives reduce or gather, in the
    accounting's convention (`accounting.Collective.bytes`): an all-gather's output, a
    reduce-scatter's input (its output times the group), an all-reduce's array, an all-to-all's
    output; a loop body's collectives counted once per trip."""
    comps = computations(hlo)
    mult = multiplicity(comps)
    out: dict[tuple[str, str], float] = collections.defaultdict(float)
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            results = _ARRAY.findall(m.group(1))
            if m.group(3) and len(results) > 1:
                results = results[len(results) // 2:]
            scale = mult[name] * (group_size(line, devices) if m.group(2) == "reduce-scatter" else 1)
            for dtype, dims in results:
                out[(m.group(2), dtype)] += scale * math.prod(int(d) for d in filter(None, dims.split(","))) * _BYTES[dtype]
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b")
    p.add_argument("--mesh", action="append", required=True, help="axis=size[,axis=size] over all devices (repeatable)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--remat", default="none")
    p.add_argument("--detail", action="store_true", help="also list every collective with its computation and shape")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a further config override, e.g. train.loss_chunk=512 or model.tie_embeddings=true (repeatable)")
    args = p.parse_args(argv)

    import jax

    from scaling import accounting as acc
    from scaling.config import load_config
    from scaling.hardware import detect, get_hardware
    from scaling.train import abstract_state, make_setup, make_train_step

    n = jax.device_count()
    print(f"# collectives in the compiled train step: `{args.model}`, {args.dtype}, batch {args.batch} x {args.seq}, "
          f"remat {args.remat}, {n} x {jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    if args.set:
        print(f"overrides: {' '.join(args.set)}\n")
    for spec in args.mesh:
        sizes = {"data": 1, "fsdp": 1, "tensor": 1}
        for item in spec.split(","):
            axis, size = item.split("=")
            sizes[axis] = int(size)
        overrides = [f"--mesh.{a}={s}" for a, s in sizes.items()] + [
            f"--train.batch_size={args.batch}", f"--train.seq_len={args.seq}", f"--model.compute_dtype={args.dtype}",
            f"--remat.policy={args.remat}", "--data.source=synthetic", "--checkpoint.enabled=false"] + [f"--{kv}" for kv in args.set]
        cfg = load_config(f"configs/models/{args.model}.yaml", overrides)
        setup = make_setup(cfg)
        state = abstract_state(setup)
        batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jax.numpy.int32,
                                     sharding=setup.batch_sharding)
        hlo = make_train_step(setup).lower(state, batch).compile().as_text()
        found = collectives(hlo)
        print(f"## mesh {sizes}\n\n| where | collective | dtype | count | MiB (outputs) |\n|---|---|---|---|---|")
        for (where, op, dtype), (count, nbytes) in sorted(found.items()):
            print(f"| {where} | {op} | {dtype} | {count} | {nbytes / 2**20:,.1f} |")
        if args.detail:
            print("\n| computation | collective | result |\n|---|---|---|")
            for comp, op, shape in detail(hlo):
                print(f"| {comp} | {op} | `{shape}` |")
        hw = detect() or get_hardware("h100")  # the CPU: bytes only, no times worth reading
        on_cpu = jax.default_backend() == "cpu"
        predicted = acc.training_comms(cfg, acc.MeshShape(**sizes, rules=cfg.mesh.rules), hw, accelerator=not on_cpu)
        print(f"\nPredicted (`accounting.training_comms`, accelerator={not on_cpu}):\n\n"
              "| axis | collective | what | MiB | ms |\n|---|---|---|---|---|")
        for c in predicted:
            print(f"| {c.axis} | {c.kind} | {c.what} | {c.bytes / 2**20:,.1f} | {c.seconds * 1e3:.2f} |")
        totals = step_totals(hlo, n)
        print("\nPer step, XLA (loop bodies times their trip counts) against the accounting:\n\n"
              "| collective | XLA MiB by dtype | XLA MiB | predicted MiB | predicted / XLA |\n|---|---|---|---|---|")
        for kind in sorted({k for k, _ in totals} | {c.kind for c in predicted}):
            by_dtype = {d: b for (k, d), b in sorted(totals.items()) if k == kind}
            xla = sum(by_dtype.values())
            pred = sum(c.bytes for c in predicted if c.kind == kind)
            ratio = f"{pred / xla:.3f}" if xla else "-"
            print(f"| {kind} | {', '.join(f'{d} {b / 2**20:,.1f}' for d, b in by_dtype.items()) or '-'} | "
                  f"{xla / 2**20:,.1f} | {pred / 2**20:,.1f} | {ratio} |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
