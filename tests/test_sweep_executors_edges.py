"""Sweep runs as a user meets them: failed points in the progress bar and the summary, a
second Ctrl-C, an executor that cannot start a point, a point killed by a signal, and a
re-run that says which points resume and which restart.

No JAX training: the points run a stand-in `python -m scaling train` (a scaling/__main__.py
in the folder the runner starts from, as in tests/test_sweep_mutants.py) that writes
metrics.jsonl and committed checkpoint folders the way train.py does. A few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fake_trainer
import pytest

from scaling import executors as ex_mod
from scaling.checkpoint import COMMIT_SUCCESS_FILE
from scaling.executors import LocalExecutor, LocalHandle, PointTask, collect_outcome, error_line
from scaling.sweep import ResultStore, generate_points, load_spec, main, resume_note, run_sweep, summary_table

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "sweeps" / "tiny_cpu.yaml"
SYNTHETIC = "--base.overrides.data.source=synthetic"

FAKE_TRAIN = r'''
"""Stand-in for `python -m scaling train --config C --run_dir R`; $FAKE_PLAN maps point ids
to a mode: done | fail | hang (SIGTERM: checkpoint half-way, exit 0) | slow_save (SIGTERM:
a long save; a second SIGTERM kills it, as train.py's default action does)."""
import json, os, signal, sys, time
from pathlib import Path
import yaml

args = sys.argv[1:]
cfg = yaml.safe_load(open(args[args.index("--config") + 1]))
run_dir = Path(args[args.index("--run_dir") + 1])
steps, pid = cfg["train"]["steps"], run_dir.name
mode = json.loads(Path(os.environ["FAKE_PLAN"]).read_text()).get(pid, "done")
metrics = run_dir / "metrics.jsonl"
ckpts = sorted(int(p.name) for p in (run_dir / "checkpoints").glob("[0-9]*") if (p / "commit_success.txt").exists())
start = ckpts[-1] if ckpts else 0
with open(run_dir / "attempts.log", "a") as f:
    f.write(f"{mode} from {start}\n")

def train(upto):
    with open(metrics, "a") as f:
        for s in range(start + 1, upto + 1):
            f.write(json.dumps({"step": s, "loss": 6.0 - s / steps}) + "\n")
        if upto == steps:
            f.write(json.dumps({"step": steps, "eval_loss": 5.5}) + "\n")
    (run_dir / "checkpoints" / str(upto)).mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / str(upto) / "commit_success.txt").touch()

if mode == "fail":
    print(f"Traceback (most recent call last):\n  File x\nValueError: boom in {pid}", file=sys.stderr)
    sys.exit(2)
if mode in ("hang", "slow_save"):
    stop = []
    def on_term(*_):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # train.py: a second signal exits at once
        stop.append(1)
    signal.signal(signal.SIGTERM, on_term)
    (run_dir / "started").touch()
    while not stop:
        time.sleep(0.02)
    if mode == "slow_save":
        time.sleep(60)
    train(steps // 2)
    sys.exit(0)
train(steps)
'''


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    return fake_trainer.install(tmp_path, monkeypatch, FAKE_TRAIN)


def _quiet(_msg):
    pass


def _launches(out: Path, pid: str) -> list[str]:
    p = out / "points" / pid / "attempts.log"
    return p.read_text().splitlines() if p.exists() else []


def _interrupt_when(path: Path, times: int = 1, gap_s: float = 0.5) -> threading.Thread:
    """SIGINT this process (`times` times) once `path` exists, as Ctrl-C at the terminal would."""

    def run():
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(gap_s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# ------------------------------------------------------------------ failures, seen by a user


def test_failed_point_ends_the_bar_and_is_named_in_the_summary(tmp_path, fake_train, capsys):
    """The bar stopped at 3/4 when a point failed (it counted only done points), and the
    summary table said `failed` with no reason: the per-point line had scrolled away."""
    out = tmp_path / "out"
    fake_train({"C3e9-L1-s0": "fail"})
    assert main(["--config", str(TINY), "--out", str(out), "--workers", "2", SYNTHETIC]) == 1
    cap = capsys.readouterr()
    assert "4/4" in cap.err and "1 failed" in cap.err
    summary = cap.out[cap.out.index("point "):]
    assert "  C3e9-L1-s0 failed: exit status 2: ... ValueError: boom in C3e9-L1-s0" in summary.splitlines()


def test_summary_gives_each_unfinished_points_reason():
    rows = [
        {"id": "A", "status": "done", "n_params": 1, "tokens": 2, "flops": 3.0, "final_loss": 1.0, "eval_loss": 1.0, "wall_time": 1.0, "error": None},
        {"id": "B", "status": "interrupted", "n_params": 1, "tokens": 2, "flops": 3.0, "final_loss": None, "eval_loss": None, "wall_time": 1.0, "error": "stopped at step 4 of 8"},
        {"id": "C", "status": "failed", "n_params": 1, "tokens": 2, "flops": 3.0, "final_loss": None, "eval_loss": None, "wall_time": 1.0, "error": "killed by SIGKILL"},
    ]  # fmt: skip
    lines = summary_table(rows).splitlines()
    assert lines[-3:] == ["1 done, 1 failed, 1 interrupted", "  B interrupted: stopped at step 4 of 8", "  C failed: killed by SIGKILL"]


def test_error_line():
    assert error_line(None) == "" and error_line("exit status 3") == "exit status 3"
    assert error_line("exit status 2: Traceback (most recent call last):\n  File x\nValueError: y\n") == "exit status 2: ... ValueError: y"


def test_a_point_killed_by_a_signal_says_so(tmp_path):
    """`exit status -9` hid that the process was killed (the OOM killer's SIGKILL leaves no stderr)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    task = PointTask("P", str(tmp_path / "p.yaml"), str(run_dir), 10)
    out = collect_outcome(task, -signal.SIGKILL, 1.0)
    assert out.status == "failed" and out.error.startswith("killed by SIGKILL (out of memory?")
    assert collect_outcome(task, -signal.SIGSEGV, 1.0).error == "killed by SIGSEGV"
    assert collect_outcome(task, 1, 1.0).error == "exit status 1"


class _RefusingExecutor:
    """Like submitit when sbatch refuses one job (QOS limit): submit raises for one point."""

    def __init__(self, workers=1, **_):
        self.slots = workers

    def submit(self, task):
        if task.point_id == "C1.5e9-L2-s0":
            raise RuntimeError("sbatch: error: QOSMaxSubmitJobPerUserLimit")
        return _DoneHandle(task)

    def shutdown(self):
        pass


class _DoneHandle:
    def __init__(self, task):
        self.point_id, self.job_id, self.task = task.point_id, "42", task

    def poll(self):
        return ex_mod.Outcome("done", 1.0, 1.0, self.task.steps, 0.1, 0)

    def cancel(self):
        pass


def test_a_point_the_executor_cannot_start_fails_alone(tmp_path, monkeypatch):
    """A submit that raised stopped the whole sweep (a traceback, the point left pending)."""
    monkeypatch.setitem(ex_mod.EXECUTORS, "refusing", _RefusingExecutor)
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, tmp_path / "out", workers=2, executor="refusing", log=_quiet)}
    bad = rows.pop("C1.5e9-L2-s0")
    assert bad["status"] == "failed" and bad["attempts"] == 1
    assert bad["error"] == "could not start: RuntimeError: sbatch: error: QOSMaxSubmitJobPerUserLimit"
    assert all(r["status"] == "done" for r in rows.values())


# ------------------------------------------------------------------ stopping and resuming


def test_second_ctrl_c_stops_the_points_at_once(tmp_path, fake_train):
    """The second Ctrl-C did nothing: the runner waited for each point's checkpoint (up to
    120 s a point). Now it is passed on, and train.py exits on its second signal."""
    out = tmp_path / "out"
    slow = "C1.5e9-L1-s0"
    fake_train({slow: "slow_save"})
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    t0 = time.monotonic()
    thread = _interrupt_when(out / "points" / slow / "started", times=2)
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, out, only=[slow], log=_quiet)}
    thread.join()
    assert time.monotonic() - t0 < 30  # (the save takes 60 s)
    assert rows[slow]["status"] == "interrupted" and rows[slow]["last_step"] == 0


def test_shutdown_waits_once_for_all_points(tmp_path):
    """The wait for points to checkpoint is one deadline for all of them, not one per point."""
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    ex = LocalExecutor(workers=3, gpus=[])
    for i in range(3):
        proc = subprocess.Popen([sys.executable, "-c", ignore], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        proc.stdout.close()
        ex.handles.append(LocalHandle(PointTask(f"P{i}", "c.yaml", str(tmp_path), 10), proc, 0, None))
    t0 = time.monotonic()
    ex.shutdown(timeout_s=1.5)
    assert time.monotonic() - t0 < 3.0  # (was 1.5 s per point: 4.5 s)
    assert all(h.proc.returncode == -signal.SIGKILL for h in ex.handles)


def test_rerun_says_which_points_resume_and_which_restart(tmp_path, fake_train, capsys):
    """After a Ctrl-C, the re-run said only "running 2": now each point that ran before says
    whether it resumes from a checkpoint (and which) or trains again from step 0."""
    out = tmp_path / "out"
    hang, lost = "C3e9-L1-s0", "C1.5e9-L2-s0"
    fake_train({hang: "hang", lost: "hang"})
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    steps = {p.id: p.steps for p in generate_points(spec, spec_dir)[0]}
    thread = _interrupt_when(out / "points" / hang / "started")
    run_sweep(spec, spec_dir, out, workers=2, only=[hang, lost], log=_quiet)
    thread.join()
    for c in (out / "points" / lost / "checkpoints").iterdir():  # say its checkpoint was lost
        (c / COMMIT_SUCCESS_FILE).unlink()
    capsys.readouterr()
    fake_train({})
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, out, workers=2, only=[hang, lost], log=_quiet)}
    text = capsys.readouterr().out
    half = steps[hang] // 2
    assert f"{hang}: resuming from its checkpoint at step {half} of {steps[hang]} (attempt 2; the last one logged step {half})" in text
    assert f"{lost}: restarting from step 0: no checkpoint in its run dir (attempt 2; the last one logged step {steps[lost] // 2})" in text
    assert _launches(out, hang) == ["hang from 0", f"done from {half}"] and _launches(out, lost) == ["hang from 0", "done from 0"]
    assert rows[hang]["status"] == rows[lost]["status"] == "done"


def test_point_finished_but_not_recorded_is_collected_on_rerun(tmp_path, fake_train, capsys):
    """The known gap: a point that ran its last step (final checkpoint written) while its
    runner was killed, before the runner recorded it. Its row says `running`; the re-run
    starts it once more, `train` finds the checkpoint at the last step and trains nothing,
    and the row is `done` with the first attempt's numbers; the run says so."""
    out = tmp_path / "out"
    pid = "C1.5e9-L1-s0"
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    p = next(q for q in generate_points(spec, spec_dir)[0] if q.id == pid)
    run_dir = out / "points" / pid
    run_dir.mkdir(parents=True)
    trainer = subprocess.run([sys.executable, "-m", "scaling", "train", "--config", str(_point_yaml(p, run_dir)), "--run_dir", str(run_dir)])
    assert trainer.returncode == 0
    store = ResultStore(out / "results.sqlite")
    store.add(spec.name, p, str(run_dir))
    store.start(pid, str(2**22 + 1))  # above pid_max: no live process, the point has exited
    store.close()
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, out, only=[pid], log=_quiet)}
    assert f"{pid}: its checkpoint is at the last step, {p.steps}: collecting its result (attempt 2" in capsys.readouterr().out
    r = rows[pid]
    assert r["status"] == "done" and r["attempts"] == 2 and r["last_step"] == p.steps and r["eval_loss"] == 5.5
    assert _launches(out, pid) == ["done from 0", f"done from {p.steps}"]  # trained once


def _point_yaml(p, run_dir: Path) -> Path:
    from scaling.config import dump_yaml

    path = run_dir / "point.yaml"
    path.write_text(dump_yaml(p.cfg))
    return path


def test_resume_note_without_checkpointing(tmp_path):
    spec, spec_dir = load_spec(TINY, [SYNTHETIC, "--base.overrides.checkpoint.enabled=false"])
    p = generate_points(spec, spec_dir)[0][0]
    assert resume_note(p, {"attempts": 0}, tmp_path) is None  # a first start says nothing
    assert resume_note(p, {"attempts": 1}, tmp_path) == "restarting from step 0 (checkpoint.enabled=false) (attempt 2; the last one logged step 0)"
