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
import os
import sys

from scaling import accounting as acc
from scaling.config import Config, RematPolicyName
from scaling.hardware import HARDWARE, Hardware, get_hardware
from scaling.sharding.mesh import MeshError, resolve_mesh_shape

GiB = 2**30
SEARCH_POLICIES = (RematPolicyName.none, RematPolicyName.dots, RematPolicyName.selective, RematPolicyName.full)


def _g(x: float) -> str:
    if 0 < x < 0.01 * GiB:  # (the norm scales' all-reduce: 0.00 GiB said nothing)
        return f"{x / 2**20:,.2f} MiB"
    return f"{x / GiB:,.2f} GiB"


# XLA's GPU client allocates pinned host buffers (remat offload) from one BFC pool capped by
# this variable, default 64 GiB (xla/pjrt/gpu); measured on an H200, a step whose offloaded
# residuals approach the cap fails even below it (docs/benchmarks.md, remat, third session).
HOST_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def xla_host_pool_bytes() -> float:
    return float(os.environ.get(HOST_POOL_ENV) or 64) * 2**30


def _t(s: float) -> str:
    if 0 < s < 1e-5:
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
    mem = acc.training_memory(cfg, mesh, hw=hw, policy=policy, grad_accum=accum)
    roof = acc.training_roofline(cfg, mesh, hw, policy=policy, grad_accum=accum)
    time = acc.training_time(cfg, mesh, hw, policy=policy, grad_accum=accum)
    return Candidate(mesh, policy, accum, mem, roof, time, hw.usable_bytes)


def report(cfg: Config, mesh: acc.MeshShape, hw: Hardware) -> str:
    m, t = cfg.model, cfg.train
    c = evaluate(cfg, mesh, hw, cfg.remat.policy, t.grad_accum)
    f = acc.flops_per_token(m, t.seq_len)
    fi = acc.flops_per_token(m, t.seq_len, training=False)
    mem, act, roof, st = c.memory, c.memory.activations, c.roofline, c.time
    # FSDP's threshold in the dtype the gathers carry on a GPU: XLA:GPU casts each weight shard
    # to the compute dtype before gathering it, as training_comms prices it [XLA-GPU].
    crit = acc.critical_tokens_per_device(hw, bytes_per_param=min(acc.dtype_bytes(m.param_dtype),
                                                                  acc.dtype_bytes(m.compute_dtype)))
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
        f"  matmuls {_t(st.matmul_seconds)} + attention {_t(st.attention_seconds)} + memory-bound "
        f"{_t(st.memory_seconds)} = {_t(st.compute_seconds)}"
        + (f" (incl. collectives {_t(st.serial_comm_seconds)}: on the critical path)" if st.serial_comm_seconds else "")
        + (f"; host offload {_t(st.host_seconds)} (added: not overlapped)" if st.host_seconds else ""),
        *[f"    {k:44s} {v / 1e9:8.2f} GB  {_t(v / st.rates.hbm):>10s}" for k, v in st.traffic.items() if v],
        f"  step: {_t(st.seconds)}; predicted MFU {roof.model_flops / (hw.bf16_flops * st.seconds):.1%}; "
        f"{roof.tokens_per_step / st.seconds:,.0f} tokens/s",
    ]
    return "\n".join(lines)


def _factorizations(n: int):
    for d in range(1, n + 1):
        if n % d:
            continue
        for tp in range(1, n // d + 1):
            if (n // d) % tp == 0:
                yield d, n // d // tp, tp


def _accums(cfg: Config, mesh: acc.MeshShape) -> list[int]:
    """grad_accum values whose micro-batch the mesh's batch axes divide."""
    b = cfg.train.batch_size
    return [a for a in range(1, b + 1) if b % a == 0 and (b // a) % mesh.split("batch") == 0]


def candidate_meshes(cfg: Config, hw: Hardware, devices: int) -> list[acc.MeshShape]:
    """Mesh shapes of `devices` (tensor within a node) that shard the model and split a micro-batch."""
    out = []
    for d, f, tp in _factorizations(devices):
        mesh = acc.MeshShape(d, f, tp, cfg.mesh.rules)
        if tp <= hw.devices_per_node and not acc.divisibility_errors(cfg.model, mesh) and _accums(cfg, mesh):
            out.append(mesh)
    return out


def search(cfg: Config, hw: Hardware, devices: int, top: int = 10) -> list[Candidate]:
    """Mesh shapes (data x fsdp x tensor, tensor within a node) x remat x grad_accum."""
    out = []
    for mesh, policy in itertools.product(candidate_meshes(cfg, hw, devices), SEARCH_POLICIES):
        for accum in _accums(cfg, mesh):
            c = evaluate(cfg, mesh, hw, policy, accum)
            out.append(c)
            if c.fits:
                break  # more accumulation only slows a candidate that already fits
    fitting = sorted((c for c in out if c.fits), key=lambda c: (c.time.seconds, c.roofline.step_seconds))
    return fitting[:top]


def search_table(cands: list[Candidate]) -> str:
    head = ("| data | fsdp | tensor | remat | grad_accum | memory/device | step (calibrated) | tokens/s | MFU | "
            "roofline step | bound |")
    rows = [head, "|" + "---|" * 11]
    for c in cands:
        r, st = c.roofline, c.time
        rows.append(
            f"| {c.mesh.data} | {c.mesh.fsdp} | {c.mesh.tensor} | {c.policy.value} | {c.grad_accum} | "
            f"{c.memory.total / GiB:,.1f} GiB | {_t(st.seconds)} | {r.tokens_per_step / st.seconds:,.0f} | "
            f"{r.model_flops / (r.peak_flops * st.seconds):.1%} | {_t(r.step_seconds)} | {r.bound} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    from scaling.__main__ import _config_args

    def extra(p):
        p.add_argument("--hardware", default="h100", help="one of: " + ", ".join(HARDWARE))
        p.add_argument("--devices", type=int, default=None, help="device count (default: the mesh's fixed sizes, or 8)")
        p.add_argument("--search", action="store_true", help="rank mesh x remat x grad_accum by predicted throughput")
        p.add_argument("--top", type=int, default=10)

    args, cfg = _config_args(argv, "plan", extra)
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
    errors = acc.divisibility_errors(cfg.model, mesh)
    if errors:
        print("warning: this mesh cannot shard: " + "; ".join(errors[:3]), file=sys.stderr)
    print(report(cfg, mesh, hw))
    if args.search:
        cands = search(cfg, hw, devices, args.top)
        print()
        print(f"search over {devices} devices (top {len(cands)} that fit, by the calibrated step time; the roofline beside it):")
        if cands:
            print(search_table(cands))
        elif not candidate_meshes(cfg, hw, devices):
            print(f"no data x fsdp x tensor shape of {devices} devices can run this: each one either leaves a "
                  f"model dimension indivisible or cannot split train.batch_size={cfg.train.batch_size} over its "
                  f"batch axes; change --devices or train.batch_size")
        else:
            print("nothing fits; lower train.batch_size or add devices")
    return 0
