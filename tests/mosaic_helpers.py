"""What the Mosaic GPU kernel tests share: tolerances, the Hopper check, seeds and inputs."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np

# Relative L2 error bounds against the f32 reference, per input dtype (inputs, P and dS are
# rounded to the dtype before their matmuls, as in every flash kernel).
TOL = {jnp.bfloat16: 1.5e-2, jnp.float16: 2e-3}
ON_HOPPER = jax.default_backend() == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"


def seed() -> int:
    """A fresh seed per run; FLASH_SEED=<seed> reproduces one."""
    return int(os.environ.get("FLASH_SEED", np.random.SeedSequence().entropy % 2**32))


def rel(a, b) -> float:
    """Relative L2 error of a against b, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(seed, b, t, s, h, kv, d, dtype):
    """q, k, v, do: standard normal [B, T, H, D], [B, S, KV, D] x 2, [B, T, H, D] in `dtype`."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for shape in
                 ((b, t, h, d), (b, s, kv, d), (b, s, kv, d), (b, t, h, d)))


RACE_WRITE = re.compile(r"^\s*write of .* from Warpgroup\(.*\), (\S+):(\d+):\d+ \(.*\)$", re.M)


def non_tma_races(printed: str) -> list[str]:
    """The write sites, other than TMA loads, of the races that Pallas' GPU interpret mode printed
    with `InterpretGPUParams(detect_races=True)`.

    TMA loads are left out: in jax 0.11.2 the detector orders a `copy_gmem_to_smem` neither after
    the barrier wait before it nor after its own thread's earlier reads, so it flags even the
    textbook ring (the consumer arrives at `free` after reading a slot, the producer waits on
    `free`, then refills the slot). Every other write a race names, a thread's store into shared
    memory, is a real race."""
    sites = []
    for path, line in RACE_WRITE.findall(printed):
        with open(path) as f:
            source = f.readlines()[int(line) - 1]
        if "copy_gmem_to_smem" not in source:
            sites.append(f"{path}:{line}: {source.strip()}")
    return sites
