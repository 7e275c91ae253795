"""Multi-host start-up through jax.distributed (a no-op for single-process runs).

Every process runs the same program. `jax.distributed.initialize` must come before
anything touches a JAX backend (even `jax.devices()`): it makes `jax.devices()` the
global device list and `jax.local_devices()` this process's share. After it, the usual
single-controller code works unchanged: the mesh spans all processes' devices, arrays
are global, and each process feeds only its own rows of a batch
(`jax.make_array_from_process_local_data`).

On CPU (tests, laptops) the cross-process collectives go through gloo; GPUs use NCCL.
"""

from __future__ import annotations

import os

import jax

from scaling.config import MeshConfig

_initialized = False


def _env_int(name: str) -> int | None:
    return int(os.environ[name]) if os.environ.get(name) else None


def maybe_initialize(cfg: MeshConfig) -> bool:
    """Initialise jax.distributed from the config or JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID. Returns True when running multi-process."""
    global _initialized
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = cfg.num_processes if cfg.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
    if address is None or num is None or num <= 1:
        return False
    if pid is None or not 0 <= pid < num:
        raise ValueError(
            f"multi-host: mesh.process_id (or JAX_PROCESS_ID) must be in [0, {num}) with "
            f"mesh.num_processes={num}, got {pid}"
        )
    if not _initialized:
        # Only the CPU client reads this option, so it is safe to set everywhere; asking
        # jax.default_backend() here instead would start the backend before initialize.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
        _initialized = True
    return True
