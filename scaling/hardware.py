"""Hardware table: peak rates and sizes, each with its source.

Bandwidths in bytes/s; FLOP/s are dense bf16 (no sparsity).

- `ici_bandwidth`: per device, all intra-node/intra-slice links together, one direction
  (NVLink egress for GPUs; links x one-way link bandwidth for TPUs).
- `axis_bandwidth`: what one ring collective along ONE mesh axis gets per device. On an
  NVSwitch node every GPU reaches every other at full NVLink egress, so it equals
  `ici_bandwidth`. On a TPU torus a 1D ring along one axis uses that axis's two links
  (one each way), so it is 2 x the one-way link bandwidth: the book's W_ici for a
  bidirectional ring ("How to Scale Your Model", sharded-matmuls chapter: an AllGather of
  V bytes over one axis takes T ~ V / W_ici).
- `dcn_bandwidth`: the network (NIC / DCN) per device, used by axes that leave a node.
- `devices_per_node`: how many devices share the fast interconnect (an NVLink node; a TPU
  slice).

Corrections made against the sources (issue 6): TPU DCN was 2.5e10 B/s per chip; Google's
pages give 50 Gb/s per chip for v5p (6.25e9 B/s) and 6.4 Tb/s per 256-chip pod for v5e
(25 Gb/s = 3.125e9 B/s per chip). v5p HBM is 95 GiB at 2,765 GB/s per Google (the book
rounds to 96 GB and 2.8e12). GPU HBM sizes are GiB-scale stacks (80 GiB on H100), but the
usable amount after the CUDA context is a little less: see `usable_fraction`. The H200's
"141 GB" is GiB-scale too: it was 141e9 B (131 GiB), below the 128.5 GiB a measured H200 step
peaked at (docs/benchmarks.md) after `usable_fraction`; nvidia-smi on an H200 reports 143,771 MiB
(140.4 GiB; docs/results/nvidia_smi_h200.csv, 2026-11-29).

`by_device_kind` maps the strings JAX reports (`jax.Device.device_kind`, the CUDA device name
on GPUs) to entries: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H200",
"NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "TPU v5 lite" (v5e), "TPU v5" (v5p). A variant
of a listed chip that has different rates (H100 NVL, GH200, H200 NVL, A100 PCIe) gets None, not
its sibling's numbers.

Achievable rates (`matmul_fraction`, `attention_fraction`, `hbm_fraction`, `link_fraction`): the datasheet peak is
a ceiling no kernel reaches. The calibrated step time (`scaling.accounting.training_time`)
divides work by what kernels are measured to reach, as fractions of the peaks above, each
with where it was measured (`calibration`). experiments/bench_remat.py measures all three in
the same run as the training steps it predicts and passes them in instead of these defaults.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax


# Measured on one H200 (2026-11-22, jax 0.11.2; docs/benchmarks.md, docs/attention.md,
# docs/decoding.md): bf16 matmul 8192^3 744 TFLOP/s = 0.752 of 989 (experiments/bench_matmul_shapes.py,
# 2026-12-02: 710, 744 and 777 in three runs of 10 queued calls; the median. It had been 631, from
# bench_train.py waiting for each call, which adds the host's round trip to a 1.4 ms product. The
# bf16 matmul kernels of seven profiled training steps, 125m/350m/1b scanned and unrolled, ran at
# 736-779: docs/benchmarks.md, "Forty-eighth session"); JAX device copy (x * 2, 4 GiB, read + write) 2.91 TB/s = 0.606 of 4.8 (torch's copy_
# reached 4.27 TB/s; JAX's own copy is what JAX's kernels get, so the default uses it);
# flash attention forward + backward, causal, head dim 64, T 2048, B 8, 32 q heads on 8 KV heads
# (the 1b's shape): our Mosaic GPU kernels, which `attention.impl=auto` trains with on Hopper,
# 335 TFLOP/s counted as 3.5 x forward (experiments/bench_attention.py --queue 10, 2026-12-02;
# cuDNN 294 in the same run), i.e. 335 * 3 / 3.5 = 287 TFLOP/s counted as 3 x forward, the
# accounting's convention = 0.290 of 989. In ten profiled H200 training steps (125m, 350m, 1b;
# remat none and dots; scanned and unrolled) the attention kernels ran at 258-305 in that
# convention. (It had been cuDNN's 219, timed one synchronised call at a time: the host's round
# trip was in it, and our kernel is the one that runs. docs/benchmarks.md, "Forty-ninth session".)
# `attention.impl=cudnn` is priced at this rate too: 0.88x of it measured, not modelled.
# f32 matmuls (TF32 tensor cores, XLA's default precision for f32 on the GPU; the one-pass
# loss's output-head backward runs in f32): the training profile of docs/benchmarks.md
# (second session) shows those two kernels at 10.3 + 5.2 ms for 4·B·T·D·V = 4.29e12 FLOPs
# (1b, batch 8 x 2048) = 277 TFLOP/s.
# Collectives over 2 H200s on NVLink (experiments/bench_collectives.py, 2026-11-29; docs/benchmarks.md,
# "Multi-GPU scaling"): bf16 arrays of 128 MiB (the 1b's layer weights are 116 MiB) moved at what the
# ring formula reads as 217 GB/s per device (all-gather), 205 (reduce-scatter), 244 (all-reduce):
# 222 on average, 0.49 of the 450 GB/s egress (1 GiB arrays: 0.57-0.63; 16 MiB arrays timed the host's
# dispatch, ~0.14 ms a call for every kind, not the link).
_H200_MEASURED = dict(matmul_fraction=744 / 989, attention_fraction=287 / 989, hbm_fraction=2.91 / 4.8,
                      f32_matmul_fraction=277 / 989, link_fraction=222 / 450)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    ici_bandwidth: float
    dcn_bandwidth: float
    source: str
    axis_bandwidth: float = 0.0  # 0: same as ici_bandwidth (switched interconnect)
    devices_per_node: int = 8
    host_offload: bool = True  # pinned host memory space for remat offload
    usable_fraction: float = 0.92  # of hbm_bytes, for "does it fit" (runtime, fragmentation)
    host_bandwidth: float = 0.0  # device <-> host bytes/s one way (remat offload); 0 = unknown
    # Achievable fractions of the peaks (see the module docstring and `calibration`).
    matmul_fraction: float = 1.0  # large bf16 matmul FLOP/s / bf16_flops
    attention_fraction: float = 1.0  # flash attention fwd+bwd FLOP/s (3 x causal forward) / bf16_flops
    hbm_fraction: float = 1.0  # device copy (read + write) bytes/s / hbm_bandwidth
    f32_matmul_fraction: float = 1.0  # f32-input matmul FLOP/s (TF32 on NVIDIA) / bf16_flops
    link_fraction: float = 1.0  # a collective's achieved per-device ring bandwidth / ring_bandwidth (in a node)
    calibration: str = "not measured: datasheet peaks (fractions 1.0)"

    @property
    def ring_bandwidth(self) -> float:
        return self.axis_bandwidth or self.ici_bandwidth

    @property
    def usable_bytes(self) -> float:
        return self.hbm_bytes * self.usable_fraction


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "NVIDIA H100 SXM", 989e12, 3.35e12, 80 * 2**30, 450e9, 50e9,
        "NVIDIA H100 datasheet (SXM5: 989 dense bf16 TFLOP/s, 3.35 TB/s HBM3, 80 GB, 900 GB/s NVLink "
        "bidirectional = 450 GB/s egress); ConnectX-7 400 Gb/s NIC per GPU (DGX H100); PCIe Gen5 x16 to "
        "the host (64 GB/s one way)",
        host_bandwidth=64e9,
        **_H200_MEASURED,
        calibration="not measured on an H100: the H200's measured fractions (same Hopper SXM compute; "
        "HBM3 vs HBM3e may differ)",
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM", 989e12, 4.8e12, 141 * 2**30, 450e9, 50e9,
        "NVIDIA H200 datasheet (989 dense bf16 TFLOP/s, 4.8 TB/s HBM3e, 141 GB (GiB-scale: nvidia-smi "
        "reports 143,771 MiB), 900 GB/s NVLink bidirectional); 400 Gb/s NIC per GPU; PCIe Gen5 x16 to the "
        "host (64 GB/s one way)",
        host_bandwidth=64e9,
        **_H200_MEASURED,
        calibration="measured on one H200, 2026-11-22: matmul 744 TFLOP/s (8192^3, bench_matmul_shapes.py, 2026-12-02), JAX copy "
        "2.91 TB/s (bench_decode.py), flash attention (ours, Mosaic GPU) d64 T2048 287 TFLOP/s (bench_attention.py, "
        "2026-12-02), f32 (TF32) "
        "head-backward matmuls 277 TFLOP/s (bench_train.py profile); collectives on 2 H200s 222 GB/s per device "
        "(128 MiB arrays, bench_collectives.py, 2026-11-29)",
    ),
    "a100": Hardware(
        "NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80 * 2**30, 300e9, 25e9,
        "NVIDIA A100 datasheet (312 dense bf16 TFLOP/s, 2,039 GB/s HBM2e, 80 GB, 600 GB/s NVLink "
        "bidirectional); 200 Gb/s HDR NIC per GPU (DGX A100); PCIe Gen4 x16 to the host (32 GB/s one way)",
        host_bandwidth=32e9,
    ),
    "tpu_v5e": Hardware(
        "TPU v5e", 197e12, 8.1e11, 16e9, 4.5e10 * 4, 3.125e9,
        "How to Scale Your Model, TPUs chapter table (1.97e14 bf16 FLOP/s, 8.1e11 B/s HBM, 16 GB, "
        "4.5e10 B/s per ICI link one way, 2D torus: 4 links); DCN: cloud.google.com/tpu/docs/v5e "
        "(6.4 Tb/s per 256-chip pod)",
        axis_bandwidth=2 * 4.5e10,
        devices_per_node=256,
    ),
    "tpu_v5p": Hardware(
        "TPU v5p", 459e12, 2.765e12, 95 * 2**30, 9e10 * 6, 6.25e9,
        "cloud.google.com/tpu/docs/v5p (459 bf16 TFLOP/s, 95 GiB HBM2e at 2,765 GB/s, 50 Gb/s DCN "
        "per chip); How to Scale Your Model TPUs chapter (9e10 B/s per ICI link one way, 3D torus: "
        "6 links)",
        axis_bandwidth=2 * 9e10,
        devices_per_node=8960,
    ),
    "h100_pcie": Hardware(
        "NVIDIA H100 PCIe", 756e12, 2.0e12, 80 * 2**30, 300e9, 50e9,
        "NVIDIA H100 datasheet, PCIe column (1,513 bf16 TFLOP/s with sparsity = 756 dense, 2 TB/s HBM2e, "
        "80 GB, 114 SMs, 350 W; NVLink bridge 600 GB/s bidirectional = 300 GB/s egress, between a pair of "
        "cards); PCIe Gen5 x16 to the host (64 GB/s one way); the NIC per GPU (400 Gb/s) is the server's, "
        "assumed as for the SXM",
        devices_per_node=2,
        host_bandwidth=64e9,
    ),
    "a100_40gb": Hardware(
        "NVIDIA A100 SXM 40GB", 312e12, 1.555e12, 40 * 2**30, 300e9, 25e9,
        "NVIDIA A100 datasheet, 40GB SXM column (312 dense bf16 TFLOP/s, 1,555 GB/s HBM2, 40 GB, 600 GB/s "
        "NVLink bidirectional); 200 Gb/s HDR NIC per GPU (DGX A100 40GB); PCIe Gen4 x16 to the host "
        "(32 GB/s one way)",
        host_bandwidth=32e9,
    ),
}


def get_hardware(name: str) -> Hardware:
    """A table entry by its key, in any case, with '-' or ' ' for '_' ("H100", "tpu-v5e", "v5p"), or
    by a device name as `by_device_kind` reads it ("NVIDIA H100 80GB HBM3", "TPU v5 lite")."""
    key = "_".join(str(name).strip().lower().replace("-", " ").replace("_", " ").split())
    key = {"v5e": "tpu_v5e", "v5p": "tpu_v5p"}.get(key, key)
    if key in HARDWARE:
        return HARDWARE[key]
    # A device's own name ("NVIDIA H100 80GB HBM3" from nvidia-smi or jax.Device.device_kind)
    # names an entry too; a variant with other rates (H100 NVL, A100 PCIe) still does not.
    hw = by_device_kind(str(name))
    if hw is None:
        raise ValueError(f"unknown hardware {name!r}; allowed: {', '.join(HARDWARE)}")
    return hw


def detect(device: jax.Device | None = None) -> Hardware | None:
    """The table entry for a JAX device (by device_kind), or None (e.g. the CPU)."""
    import jax  # (here, not at the top: `plan --help` reads the table without starting JAX)

    device = device or jax.devices()[0]
    return by_device_kind(device.device_kind)


def by_device_kind(kind: str) -> Hardware | None:
    """The table entry for a `jax.Device.device_kind` string, or None where the table has no
    entry with that device's rates (the CPU, other chips, variants listed in the module docstring).

    JAX's strings: the CUDA device name on GPUs ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
    "NVIDIA H200", "NVIDIA A100-SXM4-80GB"); "TPU v5 lite" for v5e and "TPU v5" for v5p on TPUs.
    """
    k = " ".join(kind.lower().replace("-", " ").replace("_", " ").split())
    tpu = re.fullmatch(r"tpu ?v(\d+) ?(lite|e|p)?( pod)?", k)
    if tpu:
        version, variant = tpu.group(1), tpu.group(2)
        if version == "5":
            return HARDWARE["tpu_v5e"] if variant in ("lite", "e") else HARDWARE["tpu_v5p"]
        return None
    words = set(k.split())
    if words & {"nvl", "gh200", "gh100"}:  # NVL cards and Grace Hopper: other clocks, memory
        return None
    if "h200" in words:
        return HARDWARE["h200"]
    if "h100" in words:
        return HARDWARE["h100_pcie"] if "pcie" in words else HARDWARE["h100"]
    if "a100" in words:
        if "pcie" in words:  # 250-300 W cards: 1,555 / 1,935 GB/s, NVLink bridges; not in the table
            return None
        return HARDWARE["a100_40gb"] if "40gb" in words else HARDWARE["a100"]
    return None
