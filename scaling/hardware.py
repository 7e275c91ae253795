"""Hardware table: peak rates and sizes, each with its source.

Bandwidths in bytes/s; FLOP/s are dense (no sparsity). `ici_bandwidth` is per device,
one direction (NVLink for GPUs, ICI for TPUs); `dcn_bandwidth` is the network per device.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    ici_bandwidth: float
    dcn_bandwidth: float
    source: str


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "NVIDIA H100 SXM", 989e12, 3.35e12, 80e9, 450e9, 50e9,
        "NVIDIA H100 datasheet (SXM5: 989.4 dense bf16 TFLOP/s, 3.35 TB/s HBM3, 900 GB/s NVLink "
        "bidirectional); 400 Gb/s NIC per GPU",
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM", 989e12, 4.8e12, 141e9, 450e9, 50e9,
        "NVIDIA H200 datasheet (989 dense bf16 TFLOP/s, 4.8 TB/s HBM3e, 141 GB, 900 GB/s NVLink "
        "bidirectional); 400 Gb/s NIC per GPU",
    ),
    "a100": Hardware(
        "NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80e9, 300e9, 25e9,
        "NVIDIA A100 datasheet (312 dense bf16 TFLOP/s, 2,039 GB/s, 600 GB/s NVLink bidirectional); 200 Gb/s NIC",
    ),
    "tpu_v5e": Hardware(
        "TPU v5e", 197e12, 8.1e11, 16e9, 4.5e10 * 4, 2.5e10,
        "How to Scale Your Model, TPUs chapter table (197 bf16 TFLOP/s, 8.1e11 B/s HBM, 16 GB, "
        "4.5e10 B/s per ICI link one way x 4 links)",
    ),
    "tpu_v5p": Hardware(
        "TPU v5p", 459e12, 2.8e12, 96e9, 9e10 * 6, 2.5e10,
        "How to Scale Your Model, TPUs chapter table (459 bf16 TFLOP/s, 2.8e12 B/s HBM, 96 GB, "
        "9e10 B/s per ICI link one way x 6 links)",
    ),
}


def get_hardware(name: str) -> Hardware:
    key = name.lower().replace("-", "_")
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; allowed: {', '.join(HARDWARE)}")
    return HARDWARE[key]


def detect(device: jax.Device | None = None) -> Hardware | None:
    """The table entry for a JAX device (by device_kind), or None (e.g. the CPU)."""
    device = device or jax.devices()[0]
    kind = device.device_kind.lower()
    for key, marker in (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("tpu_v5e", "v5 lite"), ("tpu_v5e", "v5e"), ("tpu_v5p", "v5p")):
        if marker in kind:
            return HARDWARE[key]
    return None
