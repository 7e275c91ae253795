"""Two CPU processes of one jax.distributed run, for the multi-host checkpoint tests: `run_pair`
starts a test file as a script in two processes; in each, `join` joins the run and gives the
sharded state (an array of N elements, one shard per process) of a step."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

N = 8192  # elements: one shard per process, stored in the OCDBT data files


def value(step: int) -> np.ndarray:
    return np.arange(N, dtype=np.float32) * step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(script: str, tmp_path: Path, tag: str, run_dirs: list[Path], phase: str, deadline_s: float,
             env_extra: dict | None = None) -> tuple[list[int], list[str]]:
    """Run `script port pid run_dir phase` as two processes to the end (or the deadline);
    (exit codes, logs)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
           **(env_extra or {})}
    port, procs = free_port(), []
    for pid in range(2):
        log = open(tmp_path / f"{tag}{pid}.log", "w")
        cmd = [sys.executable, script, str(port), str(pid), str(run_dirs[pid]), phase]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + deadline_s
    for p, log in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
    return [p.returncode for p, _ in procs], [(tmp_path / f"{tag}{pid}.log").read_text() for pid in range(2)]


def join(port: str, pid: int):
    """In a child: join the two-process run; (the state's sharding, state(step) -> {"w": array})."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec("x"))

    def state(step):
        return {"w": jax.make_array_from_callback((N,), sharding, lambda idx: value(step)[idx])}

    return sharding, state


def save_steps_1_and_2(ck, state) -> None:
    """The "save" phase: steps 1 and 2, each with its loader position."""
    for s in (1, 2):
        ck.save(s, state(s), {"loader": {"next_index": s}})


def check_step_1_and_train_on(ck, restored, state, pid: int) -> None:
    """After a restore that should fall back to step 1: this process's shard is step 1's, and
    training reaches step 2 again (its save must happen)."""
    for shard in restored.state["w"].addressable_shards:  # this process's share
        np.testing.assert_array_equal(np.asarray(shard.data), value(1)[shard.index])
    print(f"[{pid}] restored step {restored.step}, steps {list(ck.manager.all_steps())}", flush=True)
    assert ck.save(2, state(2), {"loader": {"next_index": 2}})
