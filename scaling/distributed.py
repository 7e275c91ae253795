"""Multi-host start-up through jax.distributed (a no-op for single-process runs)."""

from __future__ import annotations

import os

import jax

from scaling.config import MeshConfig

_initialized = False


def maybe_initialize(cfg: MeshConfig) -> bool:
    """Initialise jax.distributed from the config or JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID. Returns True when running multi-process."""
    global _initialized
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = cfg.num_processes or (int(os.environ["JAX_NUM_PROCESSES"]) if "JAX_NUM_PROCESSES" in os.environ else None)
    pid = cfg.process_id if cfg.process_id is not None else (
        int(os.environ["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in os.environ else None
    )
    if address is None or num is None or num <= 1:
        return False
    if pid is None:
        raise ValueError("multi-host: mesh.process_id (or JAX_PROCESS_ID) must be set with mesh.num_processes > 1")
    if not _initialized:
        if jax.default_backend() == "cpu" or os.environ.get("JAX_PLATFORMS", "") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
        _initialized = True
    return True
