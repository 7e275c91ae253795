"""`python -m scaling plan`: the book's accounting for one config, without allocating anything.

    python -m scaling plan --config configs/models/llama3_8b.yaml --hardware h100 --devices 8 \
        --train.batch_size=64 --train.seq_len=4096 [--search]

Prints params, FLOPs, bytes per device (by phase of the step), collectives per mesh axis, the
book's roofline (datasheet peaks, perfect overlap) and the calibrated step time (achievable
rates, kernels adding up on one stream) for the config's mesh and remat policy; `--search` ranks
mesh shape x remat policy x grad_accum by the calibrated step time among the candidates that
fit in device memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys

from scaling.config import Config, RematPolicyName

# (scaling.accounting, scaling.hardware and scaling.sharding import JAX and Flax: imported in the
# functions that use them, so that `plan --help` and a usage error answer before they load)

GiB = 2**30
SEARCH_POLICIES = (RematPolicyName.none, RematPolicyName.dots, RematPolicyName.selective, RematPolicyName.full)


def _g(x: float) -> str:
    if 0 < x < 0.01 * 2**20:  # (a small model's norm scales: 0.00 MiB said nothing either)
        return f"{x / 2**10:,.2f} KiB"
    if 0 < x < 0.01 * GiB:  # (the norm scales' all-reduce: 0.00 GiB said nothing)
        return f"{x / 2**20:,.2f} MiB"
    return f"{x / GiB:,.2f} GiB"


def _traffic_rows(st: acc.StepTime) -> list[str]:
    """Decimal bytes (against TB/s rates), one unit for the table: MB where every row is below
    a GB (a small model's rows had read 0.00 GB)."""
    rows = {k: v for k, v in st.traffic.items() if v}
    scale, unit = (1e9, "GB") if max(rows.values(), default=0) >= 1e9 else (1e6, "MB")
    return [f"    {k:44s} {v / scale:8.2f} {unit}  {_t(v / st.rates.hbm):>10s}" for k, v in rows.items()]


# XLA's GPU client allocates pinned host buffers (remat offload) from one BFC pool capped by
# this variable, default 64 GiB (xla/pjrt/gpu); measured on an H200, a step whose offloaded
# residuals approach the cap fails even below it (docs/benchmarks.md, remat, third session).
HOST_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def xla_host_pool_bytes() -> float:
    return float(os.environ.get(HOST_POOL_ENV) or 64) * 2**30


def _t(s: float) -> str:
    if 0 < s < 1e-3:  # (in ms, a small model's rows kept one or two digits and did not add up)
        return f"{s * 1e6:,.2f} us"
    return f"{s * 1e3:,.2f} ms"


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: acc.MeshShape
    policy: RematPolicyName
    grad_accum: int
    memory: acc.MemoryBytes
    roofline: acc.Roofline
    time: acc.StepTime

    @property
    def fits(self) -> bool:
        return self._hw_usable >= self.memory.total

    _hw_usable: float = 0.0


def evaluate(cfg: Config, mesh: acc.MeshShape, hw: Hardware, policy: RematPolicyName, accum: int) -> Candidate:
    from scaling import accounting as acc

    mem = acc.training_memory(cfg, mesh, hw=hw, policy=policy, grad_accum=accum)
    roof = acc.training_roofline(cfg, mesh, hw, policy=policy, grad_accum=accum)
    time = acc.training_time(cfg, mesh, hw, policy=policy, grad_accum=accum)
    return Candidate(mesh, policy, accum, mem, roof, time, hw.usable_bytes)


def report(cfg: Config, mesh: acc.MeshShape, hw: Hardware) -> str:
    from scaling import accounting as acc

    m, t = cfg.model, cfg.train
    c = evaluate(cfg, mesh, hw, cfg.remat.policy, t.grad_accum)
    f = acc.flops_per_token(m, t.seq_len)
    fi = acc.flops_per_token(m, t.seq_len, training=False)
    mem, act, roof, st = c.memory, c.memory.activations, c.roofline, c.time
    # FSDP's threshold in the dtype the gathers carry on a GPU: XLA:GPU casts each weight shard
    # to the compute dtype before gathering it, as training_comms prices it [XLA-GPU].
    gathered_bytes = min(acc.dtype_bytes(m.param_dtype), acc.dtype_bytes(m.compute_dtype))
    crit = acc.critical_tokens_per_device(hw, bytes_per_param=gathered_bytes)
    # (f32 compute runs every matmul at the f32 rate: training_time prices them so.)
    f32_compute = acc.dtype_bytes(m.compute_dtype) == acc.F32
    crit_rates = dataclasses.replace(st.rates, matmul=st.rates.f32_matmul or st.rates.matmul) if f32_compute else st.rates
    crit_measured = acc.critical_tokens_per_device(hw, bytes_per_param=gathered_bytes, rates=crit_rates)
    # A device holds its batch shard's tokens: tensor parallelism splits the weights, not the batch.
    tokens_dev = t.batch_size * t.seq_len / mesh.split("batch") / t.grad_accum
    lines = [
        f"hardware   {hw.name}: {hw.bf16_flops / 1e12:,.0f} TFLOP/s bf16, {hw.hbm_bandwidth / 1e12:.2f} TB/s HBM, "
        f"{hw.hbm_bytes / GiB:,.0f} GiB ({hw.usable_fraction:.0%} usable), {hw.ring_bandwidth / 1e9:,.0f} GB/s per "
        f"axis in-node, {hw.dcn_bandwidth / 1e9:,.1f} GB/s across nodes",
        f"mesh       {mesh.sizes} = {mesh.devices} devices, rules={mesh.rules}; remat={cfg.remat.policy.value}; "
        f"batch {t.batch_size} x seq {t.seq_len}, grad_accum {t.grad_accum}",
        "",
        f"params     {acc.param_count(m):,} ({acc.params_per_device(m, mesh):,} per device)",
        f"FLOPs/tok  training: dense {f.dense:.3e} + attention (causal) {f.attention:.3e} = {f.total:.3e}; "
        f"6N = {f.six_n:.3e}",
        f"           inference: dense {fi.dense:.3e} + attention {fi.attention:.3e}; 2N = {fi.six_n:.3e}",
        f"           remat recompute: +{acc.recompute_flops_per_token(m, t.seq_len, cfg.remat.policy, cfg.remat.names):.3e}",
        "",
        "memory per device",
        f"  params               {_g(mem.params)}",
        f"  grads                {_g(mem.grads)}",
        f"  AdamW moments        {_g(mem.optimizer)}",
        f"  activations / layer  {_g(act.per_layer)}  (x {m.num_layers} = {_g(act.layers)} saved)",
        f"  transient, loss/head {_g(act.head)}  (final norm, f32 logits + their gradient)",
        f"  transient, layer bwd {_g(act.working_layer)}  (one layer's complete residual set + temporaries)",
        *( [f"  offloaded to host    {_g(act.host)}  (per device; XLA's GPU client takes pinned host memory "
            f"from one pool of {_g(xla_host_pool_bytes())} per process{': OVER IT, the step will fail' if act.host > xla_host_pool_bytes() else ''}; "
            f"{HOST_POOL_ENV} sets it)"] if act.host else []),
        "  by phase (the transients are live at different times; the peak is the largest):",
        *[f"    {name:20s} {_g(v)}{'  <- peak' if name == mem.peak_phase else ''}" for name, v in mem.phases.items()],
        f"  peak                 {_g(mem.total)}  of {_g(hw.usable_bytes)} usable: "
        f"{'fits' if c.fits else 'DOES NOT FIT'}",
        f"  KV cache (decode, batch {t.batch_size}, seq {t.seq_len}, bf16): "
        f"{_g(acc.kv_cache_bytes(m, t.batch_size, t.seq_len) / mesh.devices)} per device",
        "",
        f"communication per step (times at the datasheet's {hw.ring_bandwidth / 1e9:,.0f} GB/s in a node; the "
        "calibrated step below uses the measured link rate)",
    ]
    comms = acc.training_comms(cfg, mesh, hw)
    for x in comms:
        lines.append(f"  {x.axis:7s} {x.kind:15s} {x.what:34s} {_g(x.bytes):>14s}  {_t(x.seconds):>12s}")
    if not comms:
        lines.append("  none (one device)")
    lines += [
        "",
        "roofline per step (the book's bound: datasheet peaks, perfect overlap)",
        f"  compute {_t(roof.compute_seconds)} | memory {_t(roof.memory_seconds)} | comms {_t(roof.comm_seconds)}",
        f"  step: {_t(roof.step_seconds)} overlapped ({roof.bound}-bound), {_t(roof.step_seconds_no_overlap)} "
        f"without overlap",
        f"  arithmetic intensity {roof.intensity:,.0f} FLOPs/byte (critical {hw.bf16_flops / hw.hbm_bandwidth:,.0f})",
        f"  tokens/device/micro-batch {tokens_dev:,.0f}; compute-bound above: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in crit.items()),
        f"  predicted MFU ceiling {roof.mfu:.1%}; {roof.tokens_per_second:,.0f} tokens/s",
        "",
        "calibrated step time (achievable rates; kernels on one stream add up)",
        f"  rates: matmul {st.rates.matmul / 1e12:,.0f} TFLOP/s (f32 {(st.rates.f32_matmul or st.rates.matmul) / 1e12:,.0f}), "
        f"attention {st.rates.attention / 1e12:,.0f} TFLOP/s, HBM {st.rates.hbm / 1e12:.2f} TB/s, "
        f"collectives in a node {(st.rates.link or hw.ring_bandwidth) / 1e9:,.0f} GB/s ({st.rates.source})",
        "  " + _calibrated_sum(st),
        *_traffic_rows(st),
        f"  step: {_t(st.seconds)}; predicted MFU {roof.model_flops / (hw.bf16_flops * st.seconds):.1%}; "
        f"{roof.tokens_per_step / st.seconds:,.0f} tokens/s",
        # The book's thresholds at the achievable rates: the matmul rate falls less than the
        # link's, so FSDP needs more tokens per device than the datasheet line says.
        "  compute-bound above, at these rates: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in crit_measured.items() if k != "fsdp (across nodes)")
        + " tokens/device (on 2 H200s the collectives did not overlap the compute at all: docs/benchmarks.md)",
    ]
    return "\n".join(lines)


def _calibrated_sum(st: acc.StepTime) -> str:
    """The step's terms and their total: every term printed is one the total adds (the
    collectives had been left out of the sum they were 'included' in)."""
    terms = [("matmuls", st.matmul_seconds), ("attention", st.attention_seconds),
             ("memory-bound", st.memory_seconds)]
    if st.serial_comm_seconds:
        terms.append(("collectives (on the critical path)", st.serial_comm_seconds))
    if st.host_seconds:
        terms.append(("host offload (not overlapped)", st.host_seconds))
    total = st.compute_seconds + st.host_seconds
    return " + ".join(f"{k} {_t(v)}" for k, v in terms) + f" = {_t(total)}"


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _factorizations(n: int):
    """Every (data, fsdp, tensor) with product n, over n's divisors (the loop over 1..n it
    replaces took 2 s at 10^7 devices, linear in n)."""
    divs = _divisors(n)
    for d in divs:
        for tp in divs:
            if (n // d) % tp == 0:
                yield d, n // d // tp, tp


def _accums(cfg: Config, mesh: acc.MeshShape) -> list[int]:
    """grad_accum values whose micro-batch the mesh's batch axes divide."""
    b = cfg.train.batch_size
    return [a for a in range(1, b + 1) if b % a == 0 and (b // a) % mesh.split("batch") == 0]


def batch_errors(cfg: Config, mesh: acc.MeshShape) -> list[str]:
    """What `train.check_runnable` refuses about the batch split: a fraction of a sequence per
    device, which plan had priced (tokens per device and all) without a word."""
    t, n = cfg.train, mesh.split("batch")
    axes = ", ".join(f"mesh.{a}={mesh.sizes[a]}" for a in mesh.axes_of("batch", params=False))
    micro = t.batch_size // t.grad_accum
    if t.batch_size % n:
        return [f"train.batch_size={t.batch_size} is not divisible by the {n} devices the batch is split over "
                f"({axes}); use a multiple of {n}"]
    if micro % n:
        return [f"train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum} = {micro} rows a micro-batch, "
                f"not divisible by the {n} devices the batch is split over ({axes}); make it a multiple of {n}"]
    return []


def mesh_errors(cfg: Config, mesh: acc.MeshShape) -> list[str]:
    """Why training could not run on this mesh (the trainer refuses each: exit 2), or []."""
    from scaling import accounting as acc

    return acc.divisibility_errors(cfg.model, mesh) + batch_errors(cfg, mesh)


def runnable_shapes(cfg: Config, devices: int) -> list[tuple[int, int, int]]:
    """(data, fsdp, tensor) shapes of `devices` that the config can train on as it stands."""
    from scaling import accounting as acc

    return [s for s in _factorizations(devices) if not mesh_errors(cfg, acc.MeshShape(*s, cfg.mesh.rules))]


def mesh_error_message(cfg: Config, mesh: acc.MeshShape, *, shapes: bool = True) -> str:
    """The errors, then (`shapes`) the mesh shapes of as many devices that would run."""
    errors = mesh_errors(cfg, mesh)
    msg = f"mesh {mesh.sizes} ({mesh.devices} devices, mesh.rules={mesh.rules}) cannot run this config: " + "; ".join(
        errors[:4]) + (f"; and {len(errors) - 4} more" if len(errors) > 4 else "")
    if not shapes:
        return msg
    ok = runnable_shapes(cfg, mesh.devices)
    if not ok:
        return msg + (f"\nno data x fsdp x tensor shape of {mesh.devices} devices can run it; change --devices, "
                      "train.batch_size or train.grad_accum")
    listed = ", ".join("x".join(map(str, s)) for s in ok[:30]) + (f", ... ({len(ok)} in all)" if len(ok) > 30 else "")
    return msg + (f"\nmesh.data x mesh.fsdp x mesh.tensor that run on {mesh.devices} devices: {listed}; "
                  "or --search to rank them")


def _rejection(cfg: Config, hw: Hardware, mesh: acc.MeshShape) -> str | None:
    """Why the search skips a shape (None: it does not)."""
    from scaling import accounting as acc

    if mesh.tensor > hw.devices_per_node:
        return f"tensor beyond a node of {hw.devices_per_node}"
    if acc.divisibility_errors(cfg.model, mesh):
        return "a model dimension indivisible"
    if not _accums(cfg, mesh):
        return f"train.batch_size={cfg.train.batch_size} not split evenly over the batch axes"
    return None


def candidate_meshes(cfg: Config, hw: Hardware, devices: int) -> list[acc.MeshShape]:
    """Mesh shapes of `devices` (tensor within a node) that shard the model and split a micro-batch."""
    from scaling import accounting as acc

    meshes = (acc.MeshShape(d, f, tp, cfg.mesh.rules) for d, f, tp in _factorizations(devices))
    return [m for m in meshes if _rejection(cfg, hw, m) is None]


def evaluate_all(cfg: Config, hw: Hardware, devices: int) -> list[Candidate]:
    """Every candidate the search prices: per mesh x policy, grad_accum up to the first that fits."""
    out = []
    for mesh, policy in itertools.product(candidate_meshes(cfg, hw, devices), SEARCH_POLICIES):
        for accum in _accums(cfg, mesh):
            c = evaluate(cfg, mesh, hw, policy, accum)
            out.append(c)
            if c.fits:
                break  # more accumulation only slows a candidate that already fits
    return out


def rank(cands: list[Candidate]) -> list[Candidate]:
    return sorted((c for c in cands if c.fits), key=lambda c: (c.time.seconds, c.roofline.step_seconds))


def search(cfg: Config, hw: Hardware, devices: int, top: int = 10) -> list[Candidate]:
    """Mesh shapes (data x fsdp x tensor, tensor within a node) x remat x grad_accum."""
    return rank(evaluate_all(cfg, hw, devices))[:top]


def merge_ties(cands: list[Candidate]) -> list[tuple[Candidate, str]]:
    """One row per (mesh, grad_accum) whose policies price the same (dots and selective save the
    same tensors: accounting.layer_residuals), labelled 'dots = selective': twin rows had taken
    places in the top N from the next distinct candidate."""
    rows: list[tuple[Candidate, str]] = []
    seen: dict[tuple, int] = {}
    for c in cands:
        key = (c.mesh, c.grad_accum, c.memory.total, c.time.seconds, c.roofline.step_seconds)
        if key in seen:
            i = seen[key]
            rows[i] = (rows[i][0], f"{rows[i][1]} = {c.policy.value}")
        else:
            seen[key] = len(rows)
            rows.append((c, c.policy.value))
    return rows


def search_summary(cfg: Config, hw: Hardware, devices: int, evaluated: list[Candidate]) -> str:
    """What the search covered and why shapes were skipped."""
    from scaling import accounting as acc

    shapes = [acc.MeshShape(*s, cfg.mesh.rules) for s in _factorizations(devices)]
    why: dict[str, int] = {}
    for m in shapes:
        r = _rejection(cfg, hw, m)
        if r:
            why[r] = why.get(r, 0) + 1
    skipped = "; ".join(f"{n} with {r}" for r, n in why.items())
    fit = sum(c.fits for c in evaluated)
    return (f"searched {len(shapes)} data x fsdp x tensor shapes of {devices} devices "
            f"({len(shapes) - sum(why.values())} kept{': skipped ' + skipped if skipped else ''}) "
            f"x remat {', '.join(p.value for p in SEARCH_POLICIES)} x grad_accum (from 1 up to the first that "
            f"fits); {len(evaluated)} candidates priced, {fit} fit in {_g(hw.usable_bytes)} usable")


def nothing_fits(hw: Hardware, evaluated: list[Candidate]) -> str:
    """The smallest candidate's memory and what would shrink it."""
    c = min(evaluated, key=lambda c: c.memory.total)
    mem = c.memory
    state = mem.params + mem.grads + mem.optimizer
    fix = ("params, grads and AdamW moments alone exceed it: add devices (a larger fsdp)" if state > hw.usable_bytes
           else "the activations of one micro-batch's sequences do: lower train.seq_len or add devices")
    return (f"nothing fits: the least memory, data {c.mesh.data} x fsdp {c.mesh.fsdp} x tensor {c.mesh.tensor} "
            f"with remat {c.policy.value} and grad_accum {c.grad_accum}, needs {_g(mem.total)} per device "
            f"(params + grads + moments {_g(state)}) of {_g(hw.usable_bytes)} usable; {fix}")


def search_table(cands: list[Candidate], labels: list[str] | None = None) -> str:
    head = ("| data | fsdp | tensor | remat | grad_accum | memory/device | step (calibrated) | tokens/s | MFU | "
            "roofline step | bound |")
    rows = [head, "|" + "---|" * 11]
    for i, c in enumerate(cands):
        r, st = c.roofline, c.time
        rows.append(
            f"| {c.mesh.data} | {c.mesh.fsdp} | {c.mesh.tensor} | {labels[i] if labels else c.policy.value} | "
            f"{c.grad_accum} | {c.memory.total / GiB:,.1f} GiB | {_t(st.seconds)} | "
            f"{r.tokens_per_step / st.seconds:,.0f} | {r.model_flops / (r.peak_flops * st.seconds):.1%} | "
            f"{_t(r.step_seconds)} | {r.bound} |"
        )
    return "\n".join(rows)


def _run_search(cfg: Config, hw: Hardware, devices: int, top: int) -> int:
    evaluated = evaluate_all(cfg, hw, devices)
    rows = merge_ties(rank(evaluated))[:top]
    print()
    print(search_summary(cfg, hw, devices, evaluated))
    if rows:
        print(f"top {len(rows)} by the calibrated step time (the roofline beside it):")
        print(search_table([c for c, _ in rows], [label for _, label in rows]))
        return 0
    if not evaluated:
        print(f"no data x fsdp x tensor shape of {devices} devices can run this: each one either leaves a "
              f"model dimension indivisible or cannot split train.batch_size={cfg.train.batch_size} over its "
              f"batch axes; change --devices or train.batch_size")
        return 2  # (as when nothing fits: the search found no answer)
    print(nothing_fits(hw, evaluated))
    return 2


def main(argv: list[str]) -> int:
    from scaling.__main__ import _config_args
    from scaling.hardware import HARDWARE, get_hardware  # (--help lists its names; it imports JAX)

    def extra(p):
        p.add_argument("--hardware", default="h100",
                       help="one of: " + ", ".join(HARDWARE) + " (or a device name as JAX reports it)")
        p.add_argument("--devices", type=int, default=None, help="device count (default: the mesh's fixed sizes, or 8)")
        p.add_argument("--search", action="store_true", help="rank mesh x remat x grad_accum by predicted throughput")
        p.add_argument("--top", type=int, default=10)

    args, cfg = _config_args(argv, "plan", extra)
    from scaling import accounting as acc
    from scaling.sharding.mesh import MeshError, resolve_mesh_shape

    try:
        hw = get_hardware(args.hardware)
    except ValueError as e:
        print(f"error: --hardware: {e}", file=sys.stderr)
        return 2
    if args.devices is not None and args.devices < 1:
        print(f"error: --devices must be >= 1, got {args.devices}", file=sys.stderr)
        return 2
    if args.top < 1:
        print(f"error: --top must be >= 1, got {args.top}", file=sys.stderr)
        return 2
    mc = cfg.mesh
    fixed = [s for s in (mc.data, mc.fsdp, mc.tensor) if s != -1]
    if args.devices is not None:
        devices = args.devices
    else:  # (8 where an axis takes the rest, else what the fixed axes multiply to)
        devices = 8 if -1 in (mc.data, mc.fsdp, mc.tensor) else max(1, fixed[0] * fixed[1] * fixed[2])
    try:
        shape = resolve_mesh_shape(mc, devices)
    except MeshError as e:
        print(f"mesh error: {e}", file=sys.stderr)
        return 2
    mesh = acc.MeshShape(*shape, rules=mc.rules)
    if mesh_errors(cfg, mesh):
        # The trainer refuses such a mesh; its report priced fractions of heads and sequences.
        # A search still runs: the config's mesh is only its starting point.
        if not args.search:
            print("error: " + mesh_error_message(cfg, mesh), file=sys.stderr)
            return 2
        print(f"note: {mesh_error_message(cfg, mesh, shapes=False)}; no report for it, the search follows",
              file=sys.stderr)
    else:
        print(report(cfg, mesh, hw))
    if args.search:
        return _run_search(cfg, hw, devices, args.top)
    return 0
