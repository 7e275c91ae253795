"""Multi-host start-up through jax.distributed (a no-op for single-process runs).

Every process runs the same program. `jax.distributed.initialize` must come before
anything touches a JAX backend (even `jax.devices()`): it makes `jax.devices()` the
global device list and `jax.local_devices()` this process's share. After it, the usual
single-controller code works unchanged: the mesh spans all processes' devices, arrays
are global, and each process feeds only its own rows of a batch
(`jax.make_array_from_process_local_data`).

On CPU (tests, laptops) the cross-process collectives go through gloo; GPUs use NCCL.

The settings come from `mesh.coordinator_address / num_processes / process_id`, each
falling back to JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID when unset.
They are checked before anything starts (a `MeshError`: one line, exit code 2 on the
command line): a process count of 2 or more needs an address of the form HOST:PORT and a
process id in [0, count); an address or a process id without a count, a count below 1, a
non-integer variable, or a flag and a variable that disagree are refused rather than
silently running single-process (every process would then train alone and write as
process 0).
"""

from __future__ import annotations

import os

import jax

from scaling.config import MeshConfig
from scaling.sharding.mesh import MeshError

_initialized = False

_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


def _setting(cfg: MeshConfig, field: str):
    """(value, where it came from) for one setting: the flag, else the variable, else None."""
    env = _ENV[field]
    flag = getattr(cfg, field)
    if flag == "":
        flag = None
    raw = os.environ.get(env) or None
    value = raw
    if raw is not None and field != "coordinator_address":
        try:
            value = int(raw)
        except ValueError:
            raise MeshError(f"multi-host: {env}={raw!r} is not an integer") from None
    if flag is not None and value is not None and flag != value:
        raise MeshError(
            f"multi-host: mesh.{field}={flag!r} and {env}={raw!r} disagree; give one of them "
            f"(or the same value in both)"
        )
    if flag is not None:
        return flag, f"mesh.{field} (set to {flag})"
    if value is not None:
        return value, f"{env} (set to {raw})"
    return None, f"mesh.{field} (or {env})"


def resolve(cfg: MeshConfig) -> tuple[str, int, int] | None:
    """The checked (coordinator_address, num_processes, process_id), or None for a
    single-process run. Raises MeshError for inconsistent settings."""
    address, where_address = _setting(cfg, "coordinator_address")
    num, where_num = _setting(cfg, "num_processes")
    pid, where_pid = _setting(cfg, "process_id")
    if num is None:
        given = [w for v, w in ((address, where_address), (pid, where_pid)) if v is not None]
        if given:
            raise MeshError(
                f"multi-host: {' and '.join(given)} given without the process count; set "
                f"mesh.num_processes (or JAX_NUM_PROCESSES) to the number of processes (>= 2), "
                f"or leave all three unset for a single-process run"
            )
        return None
    if num < 1:
        raise MeshError(f"multi-host: {where_num} must be >= 1 (1 = single process)")
    if num == 1:
        if pid not in (None, 0):
            raise MeshError(f"multi-host: {where_pid} must be 0 with {where_num}")
        return None
    if pid is None or not 0 <= pid < num:
        unset = " is not set; it" if pid is None else ""
        raise MeshError(f"multi-host: {where_pid}{unset} must be in [0, {num}) with {where_num}")
    if address is None:
        raise MeshError(
            f"multi-host: {where_num} needs the coordinator's HOST:PORT in "
            f"mesh.coordinator_address (or JAX_COORDINATOR_ADDRESS); process 0's host runs it"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MeshError(f"multi-host: {where_address} must be HOST:PORT with a port in [1, 65535]")
    return address, num, pid


def maybe_initialize(cfg: MeshConfig) -> bool:
    """Initialise jax.distributed from the config or JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID. Returns True when running multi-process."""
    global _initialized
    settings = resolve(cfg)
    if settings is None:
        return False
    address, num, pid = settings
    if not _initialized:
        # Only the CPU client reads this option, so it is safe to set everywhere; asking
        # jax.default_backend() here instead would start the backend before initialize.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
        _initialized = True
    return True
