"""Where a sweep's points run: local processes or a cluster (submitit), behind one interface.

A point is an ordinary training run: `python -m scaling train --config <point.yaml>
--run_dir <dir>` in its own process, so a crash in one point cannot take the runner or
the other points down, and `train` resumes from the run dir's checkpoints on a re-run.

    executor.submit(task) -> handle      start a point (the runner keeps <= executor.slots busy)
    handle.poll() -> Outcome | None      None while it runs
    handle.cancel()                      SIGTERM: the run checkpoints and exits (train.py)
    executor.shutdown()

Executors live in the EXECUTORS registry, keyed by the names `--executor` accepts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

STDERR_TAIL_CHARS = 4000  # the error text recorded for a failed point
SUBMITIT_CLUSTERS = ("slurm", "local", "debug")  # what --cluster accepts (submitit's executors)


class ExecutorError(RuntimeError):
    """An executor cannot start (a missing package, an unknown cluster or option); the
    message names the flag or spec key."""


@dataclasses.dataclass(frozen=True)
class PointTask:
    """What a process needs to run one point (picklable: submitit ships it to a job)."""

    point_id: str
    config_path: str  # the point's full generated config (YAML)
    run_dir: str
    steps: int  # the run is finished when metrics.jsonl reaches this step
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # extra environment
    cwd: str = "."  # relative paths in the config (data.cache_dir) resolve against it


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A finished attempt. status: done, failed, or interrupted (stopped early, resumable)."""

    status: str
    final_loss: float | None
    eval_loss: float | None
    last_step: int
    wall_time: float  # seconds of this attempt
    returncode: int | None
    error: str | None = None


class Handle(Protocol):
    point_id: str
    job_id: str  # a pid or a cluster job id, for the results store

    def poll(self) -> Outcome | None: ...

    def cancel(self) -> None: ...


class Executor(Protocol):
    slots: int  # points that may run at once

    def submit(self, task: PointTask) -> Handle: ...

    def shutdown(self) -> None: ...


# ------------------------------------------------------------------- shared by all


def train_command(task: PointTask) -> list[str]:
    return [sys.executable, "-m", "scaling", "train", "--config", task.config_path, "--run_dir", task.run_dir]


def read_metrics(run_dir: str | Path) -> tuple[int, float | None, float | None]:
    """(last train step, last train loss, last eval loss) from the run's metrics.jsonl.

    The train loss is the loop's mean over its last logging window (train.log_every steps).
    A resumed run appends, so the last record of each kind is the current one.
    """
    path = Path(run_dir) / "metrics.jsonl"
    step, loss, eval_loss = 0, None, None
    if not path.exists():
        return step, loss, eval_loss
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash
            continue
        if "loss" in rec:
            step, loss = int(rec["step"]), rec["loss"]
        if "eval_loss" in rec:
            eval_loss = rec["eval_loss"]
    return step, loss, eval_loss


def last_logged_step(run_dir: str | Path, tail_bytes: int = 8192) -> int:
    """The last train step in the run's metrics.jsonl (0 without one), from the file's end only:
    the sweep's progress bar asks every few seconds, and a long run's file is megabytes."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the seek or by a crash
            continue
        if isinstance(rec, dict) and "loss" in rec:
            return int(rec["step"])
    return 0


def _tail(path: Path, offset: int) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", errors="replace")
    return text[-STDERR_TAIL_CHARS:].strip()


def collect_outcome(task: PointTask, returncode: int | None, wall: float, stderr_offset: int = 0) -> Outcome:
    """Judge an attempt by its exit status and by what its metrics.jsonl says it reached."""
    last_step, loss, eval_loss = read_metrics(task.run_dir)
    if returncode == 0 and last_step >= task.steps:
        return Outcome("done", loss, eval_loss, last_step, wall, returncode)
    err = _tail(Path(task.run_dir) / "stderr.log", stderr_offset)
    if returncode == 0 or (returncode is not None and returncode < 0 and -returncode in (signal.SIGTERM, signal.SIGINT)):
        # train.py exits 0 after a SIGTERM (preemption) with a checkpoint: resumable.
        return Outcome("interrupted", loss, eval_loss, last_step, wall, returncode, f"stopped at step {last_step} of {task.steps}")
    status = exit_text(returncode)
    return Outcome("failed", loss, eval_loss, last_step, wall, returncode, f"{status}: {err}" if err else status)


def exit_text(returncode: int | None) -> str:
    """How a process ended, in words: "exit status -9" hid that a signal killed it."""
    if returncode is None or returncode >= 0:
        return f"exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    # (the kernel's out-of-memory killer sends SIGKILL, and leaves nothing in stderr)
    return f"killed by {name}" + (" (out of memory? the kernel's OOM killer sends it)" if -returncode == signal.SIGKILL else "")


def error_line(error: str | None) -> str:
    """One line for a point's error: the last line of its stderr tail (a traceback's cause),
    after how the process ended ("exit status 2: ... ValueError: ...")."""
    lines = [line for line in (error or "").strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    head = lines[0].split(": ", 1)[0]  # "exit status N" / "killed by SIG..." / "submitit job N"
    return f"{head}: ... {lines[-1].strip()}"


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the runner dies (even by SIGKILL), so no orphan
    keeps writing into a run dir that a resumed runner is about to use. The SIGTERM makes
    train.py checkpoint and exit."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    os.setpgrp()  # own process group: a Ctrl-C at the terminal reaches the runner only


def _spawn(task: PointTask, env_extra: Mapping[str, str], follow_parent: bool) -> tuple[subprocess.Popen, int]:
    run_dir = Path(task.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    err_path = run_dir / "stderr.log"
    offset = err_path.stat().st_size if err_path.exists() else 0
    env = {**os.environ, **task.env, **env_extra, "PYTHONUNBUFFERED": "1"}
    with open(run_dir / "stdout.log", "ab") as out, open(err_path, "ab") as err:
        proc = subprocess.Popen(
            train_command(task),
            stdout=out,
            stderr=err,
            env=env,
            cwd=task.cwd,
            preexec_fn=_die_with_parent if follow_parent and sys.platform.startswith("linux") else None,
        )
    return proc, offset


def run_point(task: PointTask) -> Outcome:
    """Run one point to completion in this process's child (the body of a cluster job)."""
    t0 = time.perf_counter()
    proc, offset = _spawn(task, {}, follow_parent=False)
    try:
        rc = proc.wait()
    except BaseException:  # the job is being cancelled: let the run checkpoint first
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        raise
    return collect_outcome(task, rc, time.perf_counter() - t0, offset)


# ------------------------------------------------------------------ local processes


def visible_gpus() -> list[str]:
    """GPU ids this machine lets us use, without importing JAX (which would claim memory)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def stopped_by_runner(out: Outcome, task: PointTask, how: str) -> Outcome:
    """A point the runner itself stopped (Ctrl-C) is interrupted, not failed, however it died:
    recorded as failed, a re-run with --no-retry-failed left it alone, and a SIGKILL after the
    shutdown's wait read as the out-of-memory killer's."""
    if out.status != "failed":
        return out
    return dataclasses.replace(out, status="interrupted", error=f"stopped at step {out.last_step} of {task.steps} ({how})")


class LocalHandle:
    def __init__(self, task: PointTask, proc: subprocess.Popen, offset: int, gpu: str | None):
        self.point_id = task.point_id
        self.job_id = str(proc.pid)
        self.task, self.proc, self.offset, self.gpu = task, proc, offset, gpu
        self.t0 = time.perf_counter()
        self.cancelled = False

    def poll(self) -> Outcome | None:
        rc = self.proc.poll()
        if rc is None:
            return None
        out = collect_outcome(self.task, rc, time.perf_counter() - self.t0, self.offset)
        if self.cancelled and rc < 0:  # (a non-zero exit status after the stop is still the point's own failure)
            return stopped_by_runner(out, self.task, f"{exit_text(rc).split(' (')[0]} after the runner's stop")
        return out

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.cancelled = True
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.cancelled = True
        self.proc.kill()


class LocalExecutor:
    """`workers` training processes at once on this machine.

    GPUs: each point gets one GPU (CUDA_VISIBLE_DEVICES), the least busy. With more
    workers than GPUs, small points share a GPU, each capped to its share of the memory
    (XLA preallocates 75% per process otherwise, and the second one would not fit).
    CPU: the points share the cores.
    """

    def __init__(self, workers: int = 1, gpus: list[str] | None = None, **_: Any):
        self.slots = max(1, workers)
        self.gpus = visible_gpus() if gpus is None else gpus
        self.busy: dict[str, int] = {g: 0 for g in self.gpus}
        self.handles: list[LocalHandle] = []

    def submit(self, task: PointTask) -> LocalHandle:
        env: dict[str, str] = {}
        gpu = None
        if self.gpus:
            self._release_finished()
            gpu = min(self.gpus, key=lambda g: self.busy[g])
            self.busy[gpu] += 1
            env["CUDA_VISIBLE_DEVICES"] = gpu
            share = math.ceil(self.slots / len(self.gpus))
            if share > 1 and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / share:.3f}"
        proc, offset = _spawn(task, env, follow_parent=True)
        handle = LocalHandle(task, proc, offset, gpu)
        self.handles.append(handle)
        return handle

    def _release_finished(self) -> None:
        for h in [h for h in self.handles if h.proc.poll() is not None]:
            if h.gpu is not None:
                self.busy[h.gpu] -= 1
            self.handles.remove(h)

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """SIGTERM every point (each checkpoints and exits), then wait for them all, together:
        `timeout_s` for the lot, not per point (8 slow savers kept a Ctrl-C waiting 16 min)."""
        for h in self.handles:
            h.cancel()
        deadline = time.monotonic() + timeout_s
        for h in self.handles:
            try:
                h.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h.kill()
                h.proc.wait()


# ---------------------------------------------------------------------- submitit


class SubmititHandle:
    def __init__(self, task: PointTask, job):
        self.point_id = task.point_id
        self.job_id = str(job.job_id)
        self.task, self.job = task, job
        self.t0 = time.perf_counter()
        self.cancelled = False

    def poll(self) -> Outcome | None:
        if not self.job.done():
            return None
        try:
            return self.job.result()
        except Exception as e:  # the job itself died (node failure, timeout, cancel)
            out = collect_outcome(self.task, None, time.perf_counter() - self.t0)
            out = dataclasses.replace(out, status="failed", error=f"submitit job {self.job_id}: {str(e)[-STDERR_TAIL_CHARS:]}")
            # A cancelled job raises (submitit's local jobs a KeyboardInterrupt, SLURM's a
            # failed-job error) after its run checkpointed: the runner's Ctrl-C, not a failure.
            return stopped_by_runner(out, self.task, f"the runner cancelled submitit job {self.job_id}") if self.cancelled else out

    def cancel(self) -> None:
        self.cancelled = True
        try:
            self.job.cancel(check=False)
        except Exception:
            pass


class SubmititExecutor:
    """One submitit job per point: SLURM when `sbatch` is there (AutoExecutor), else local
    processes (submitit's LocalExecutor). `options` go to `update_parameters` (e.g.
    timeout_min, gpus_per_node, cpus_per_task, slurm_partition); job logs go under `folder`.
    """

    def __init__(self, workers: int = 1, folder: str | Path = "submitit", cluster: str | None = None, options: Mapping[str, Any] | None = None, **_: Any):
        try:
            import submitit
        except ImportError:
            raise ExecutorError("--executor submitit needs the `submitit` package (pip install submitit); or use --executor local") from None

        self.slots = max(1, workers)
        if cluster is not None and cluster not in SUBMITIT_CLUSTERS:
            raise ExecutorError(f"--cluster: unknown cluster {cluster!r}; allowed: {', '.join(SUBMITIT_CLUSTERS)}")
        try:
            cluster = cluster or submitit.AutoExecutor.which()
            self.executor = submitit.AutoExecutor(folder=str(job_folder(folder, cluster)), cluster=cluster)
        except (ValueError, RuntimeError) as e:  # e.g. slurm asked for where there is no srun
            raise ExecutorError(f"--cluster {cluster}: {e}") from None
        options = {"timeout_min": 60, **dict(options or {})}
        try:
            self.executor.update_parameters(**options)
        except (NameError, ValueError, TypeError, AssertionError) as e:  # submitit raises NameError for an unknown key
            raise ExecutorError(f"spec key `submitit` (update_parameters options {sorted(options)}): {' '.join(str(e).split())}") from None
        self.handles: list[SubmititHandle] = []

    def submit(self, task: PointTask) -> SubmititHandle:
        handle = SubmititHandle(task, self.executor.submit(run_point, task))
        self.handles.append(handle)
        return handle

    def shutdown(self) -> None:
        for h in self.handles:
            if not h.job.done():
                h.cancel()


def job_folder(folder: str | Path, cluster: str) -> Path:
    """Where submitit writes a job's logs. SLURM expands `%j` (one folder per job); submitit's
    local controller does not, and made a literal `%j` folder: there the files go flat (their
    names start with the job id anyway)."""
    return Path(folder) / "%j" if cluster == "slurm" else Path(folder)


EXECUTORS: dict[str, Callable[..., Executor]] = {"local": LocalExecutor, "submitit": SubmititExecutor}
