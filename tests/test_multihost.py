"""Two processes x 4 CPU devices train like one process x 8 devices.

Each child is `python -m scaling train` with jax.distributed over 127.0.0.1 (gloo CPU
collectives); together they form a data=2, fsdp=4 mesh, and each feeds only its own rows
of every batch. Their losses must equal an in-process 8-device run of the same config
(rtol 1e-5: only the reduction order across devices and processes differs), and only
process 0 may write metrics.jsonl. The children compile at XLA backend optimisation level
0 (half the compile time on CPU; same f32 numerics contract).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from scaling.config import load_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
CONFIG = "configs/models/tiny.yaml"
OVERRIDES = [
    "--data.source=synthetic",
    "--model.compute_dtype=float32",
    "--mesh.data=2",
    "--mesh.fsdp=4",
    "--train.batch_size=8",
    "--train.seq_len=32",
    f"--train.steps={STEPS}",
    "--train.log_every=1",
    "--train.eval_every=0",
    "--checkpoint.enabled=false",
    "--logging.tensorboard=false",
    "--logging.progress=false",
]
TIMEOUT_S = 240  # for both children, after the reference; a healthy pair takes ~30 s of CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_two_processes_match_one(tmp_path, devices):
    run_dir = tmp_path / "multi"
    procs = _launch(tmp_path, run_dir, free_port(), OVERRIDES, "proc")
    try:
        single = single_process_losses()  # meanwhile, the reference in this process
    finally:
        _wait(procs, time.monotonic() + TIMEOUT_S)
    logs = {pid: (tmp_path / f"proc{pid}.log").read_text() for pid in range(2)}
    for pid, (p, _) in enumerate(procs):
        assert p.returncode == 0, f"process {pid} exited with {p.returncode}:\n{logs[pid][-3000:]}"
    multi = read_losses(run_dir)
    assert len(multi) == STEPS, f"expected {STEPS} records from process 0 alone, got {len(multi)}"

    np.testing.assert_allclose(multi, single, rtol=1e-5, atol=0)
    # tokens/s counts the global batch (8 rows x 32 tokens), not process 0's rows alone.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rated = [r for r in records if r.get("step_time")]
    assert rated and all(r["tokens_per_sec"] * r["step_time"] == pytest.approx(8 * 32, rel=1e-9) for r in rated)


def single_process_losses(steps: int = STEPS) -> np.ndarray:
    """The same config on this process's 8 devices: train()'s init, batches and step."""
    import jax

    from scaling.data import make_dataset
    from scaling.sharding import use_sharding
    from scaling.train import global_batch, init_state, make_setup, make_train_step

    setup = make_setup(load_config(ROOT / CONFIG, OVERRIDES + [f"--train.steps={steps}"]))
    assert dict(setup.mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1} and jax.device_count() == 8
    state, data, losses = init_state(setup), make_dataset(setup.cfg), []
    with use_sharding(setup.mesh, setup.rules):
        batch = global_batch(setup, next(data.train))
        step = make_train_step(setup).lower(state, batch).compile(compiler_options={"xla_backend_optimization_level": 0})
        for i in range(steps):
            if i:
                batch = global_batch(setup, next(data.train))
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return np.array(losses)

def test_process_id_is_checked():
    from scaling.config import MeshConfig
    from scaling.distributed import maybe_initialize

    with pytest.raises(ValueError, match=r"process_id .* must be in \[0, 2\)"):
        maybe_initialize(MeshConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2))
    assert maybe_initialize(MeshConfig()) is False


def _launch(tmp_path: Path, run_dir: Path, port: int, args: list[str], tag: str) -> list:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
        "JAX_PLATFORMS": "cpu",
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",
    }
    procs = []
    for pid in range(2):
        cmd = [
            sys.executable, "-m", "scaling", "train", "--config", CONFIG, *args, "--run_dir", str(run_dir),
            f"--mesh.coordinator_address=127.0.0.1:{port}", "--mesh.num_processes=2", f"--mesh.process_id={pid}",
        ]  # fmt: skip
        log = open(tmp_path / f"{tag}{pid}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def _wait(procs: list, deadline: float) -> list:
    try:
        for p, _ in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return [p.returncode for p, _ in procs]


def test_a_sigterm_to_one_process_stops_all_at_one_step_and_the_run_resumes_exactly(tmp_path, devices):
    """A scheduler's SIGTERM reaching one process first: each process used to act on its own
    signal, so the signalled one entered the (collective) checkpoint save alone while the other
    ran the next step: both hung, then crashed, and no checkpoint was written. Now every process
    saves at one step (JAX's preemption sync) and exits 0, and the resumed pair logs the losses
    of an uninterrupted 8-device run."""
    steps = 12
    args = [*OVERRIDES, f"--train.steps={steps}", "--checkpoint.enabled=true", "--checkpoint.every=1000",
            "--checkpoint.async_save=false"]
    run_dir = tmp_path / "run"
    procs = _launch(tmp_path, run_dir, free_port(), args, "first")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        if any(p.poll() is not None for p, _ in procs):
            break
        time.sleep(0.1)
    procs[1][0].send_signal(signal.SIGTERM)  # process 1 only
    try:
        reference = single_process_losses(steps)  # meanwhile, in this process
    finally:
        rcs = _wait(procs, time.monotonic() + TIMEOUT_S)
    logs = [(tmp_path / f"first{pid}.log").read_text() for pid in range(2)]
    assert rcs == [0, 0], f"exit codes {rcs}:\n" + "\n".join(log[-3000:] for log in logs)
    saved = sorted(int(d.name) for d in (run_dir / "checkpoints").iterdir() if d.name.isdigit())
    assert len(saved) == 1 and 3 <= saved[0] < steps, saved
    assert f"saved checkpoint at step {saved[0]} in {run_dir}; exiting" in logs[0], logs[0][-2000:]

    procs = _launch(tmp_path, run_dir, free_port(), args, "resumed")
    rcs = _wait(procs, time.monotonic() + TIMEOUT_S)
    logs = [(tmp_path / f"resumed{pid}.log").read_text() for pid in range(2)]
    assert rcs == [0, 0], f"exit codes {rcs}:\n" + "\n".join(log[-3000:] for log in logs)
    assert f"resuming from checkpoint step {saved[0]}" in logs[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    np.testing.assert_allclose(read_losses(run_dir), reference, rtol=1e-5, atol=0)
