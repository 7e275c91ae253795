"""Sweep runner audit: what a researcher meets when stopping, resuming and
changing a sweep, and the points a grid makes.

No JAX training: the points run a stand-in `python -m scaling train` (tests/fake_trainer.py)
that writes metrics.jsonl and committed checkpoint folders the way train.py does.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import fake_trainer
import pytest
import yaml

from scaling import executors as ex_mod
from scaling import sweep as sweep_mod
from scaling.config import Config, to_dict
from scaling.executors import LocalExecutor, LocalHandle, Outcome, PointTask, SubmititHandle, last_logged_step
from scaling.sweep import ResultStore, SpecError, SweepError, generate_points, load_spec, main, run_sweep, throughput

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "sweeps" / "tiny_cpu.yaml"
SYNTHETIC = "--base.overrides.data.source=synthetic"

FAKE_TRAIN = r'''
"""Stand-in for `python -m scaling train --config C --run_dir R`: trains every step at once."""
import json, sys
from pathlib import Path
import yaml

args = sys.argv[1:]
cfg = yaml.safe_load(open(args[args.index("--config") + 1]))
run_dir = Path(args[args.index("--run_dir") + 1])
steps = cfg["train"]["steps"]
with open(run_dir / "attempts.log", "a") as f:
    f.write("start\n")
with open(run_dir / "metrics.jsonl", "a") as f:
    for s in range(1, steps + 1):
        f.write(json.dumps({"step": s, "loss": 6.0 - s / steps}) + "\n")
    f.write(json.dumps({"step": steps, "eval_loss": 5.5}) + "\n")
(run_dir / "checkpoints" / str(steps)).mkdir(parents=True, exist_ok=True)
(run_dir / "checkpoints" / str(steps) / "commit_success.txt").touch()
'''


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    return fake_trainer.install(tmp_path, monkeypatch, FAKE_TRAIN)


def _quiet(_msg):
    pass


def _rows(out: Path) -> dict[str, dict]:
    store = ResultStore(out / "results.sqlite")
    try:
        return {r["id"]: r for r in store.rows()}
    finally:
        store.close()


def _launches(out: Path, pid: str) -> int:
    p = out / "points" / pid / "attempts.log"
    return len(p.read_text().splitlines()) if p.exists() else 0


# ------------------------------------------------------------------ stopping: interrupted, not failed


class _CancelledJob:
    """A submitit job as a cancel leaves it: done, and its result() raises."""

    job_id = "77"

    def done(self):
        return True

    def result(self):
        raise RuntimeError("Job 77 has not produced any output (state: INTERRUPTED)")

    def cancel(self, check=True):
        pass


def test_a_submitit_job_the_runner_cancelled_is_interrupted(tmp_path):
    """Ctrl-C under --executor submitit recorded every running point as failed (the cancelled
    job raises), so a re-run with --no-retry-failed never resumed them."""
    task = PointTask("P", "c.yaml", str(tmp_path), 10)
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 3.0}\n')
    cancelled = SubmititHandle(task, _CancelledJob())
    cancelled.cancel()
    out = cancelled.poll()
    assert out.status == "interrupted" and out.last_step == 5
    assert out.error == "stopped at step 5 of 10 (the runner cancelled submitit job 77)"
    died = SubmititHandle(task, _CancelledJob()).poll()  # a job that died on its own still failed
    assert died.status == "failed" and died.error.startswith("submitit job 77: ")


def test_a_point_killed_after_the_stop_wait_is_interrupted(tmp_path):
    """A point still saving when the Ctrl-C's wait ran out is SIGKILLed by the runner: it was
    recorded as failed, "killed by SIGKILL (out of memory? ...)", and left alone by a re-run
    with --no-retry-failed. A point that exits with an error after the stop stays failed."""
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    fail = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(4)); print('ready', flush=True); time.sleep(60)"
    ex = LocalExecutor(workers=2, gpus=[])
    for i, code in enumerate((ignore, fail)):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        proc.stdout.close()
        ex.handles.append(LocalHandle(PointTask(f"P{i}", "c.yaml", str(tmp_path), 10), proc, 0, None))
    ex.shutdown(timeout_s=0.5)
    killed, failed = (h.poll() for h in ex.handles)
    assert killed.status == "interrupted" and killed.returncode < 0
    assert killed.error == "stopped at step 0 of 10 (killed by SIGKILL after the runner's stop)"
    assert failed.status == "failed" and failed.error.startswith("exit status 4")


# ------------------------------------------------------------------ changing the spec between runs


def _train_one(out: Path, pid: str, overrides=()) -> tuple:
    spec, spec_dir = load_spec(TINY, [SYNTHETIC, *overrides])
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, out, only=[pid], log=_quiet)}
    assert rows[pid]["status"] == "done"
    return spec, spec_dir


def test_a_refused_run_writes_nothing(tmp_path, fake_train):
    """The runner refuses a spec that changes a trained point's config, but it had already
    written that spec to sweep.yaml and replaced the other (never trained) points' rows with
    the refused spec's; the refusal now also says what changed."""
    out, pid = tmp_path / "out", "C1.5e9-L1-s0"
    spec, spec_dir = _train_one(out, pid)
    store = ResultStore(out / "results.sqlite")
    for q in generate_points(spec, spec_dir)[0]:  # the other points: pending, never trained
        store.add(spec.name, q, str(out / "points" / q.id))
    store.close()
    spec_text = (out / "sweep.yaml").read_text()
    before = _rows(out)
    assert len(before) == 4
    spec2, _ = load_spec(TINY, [SYNTHETIC, "--hparams.learning_rate.base=1e-3"])
    with pytest.raises(SweepError, match=f"already ran: {pid};") as exc:
        run_sweep(spec2, spec_dir, out, log=_quiet)
    assert (out / "sweep.yaml").read_text() == spec_text
    assert _rows(out) == before
    assert f"{pid}: optimizer.learning_rate 0.00406" in str(exc.value) and "-> 0.00135" in str(exc.value)


def test_a_config_field_added_since_does_not_refuse_the_sweep(tmp_path, fake_train, capsys):
    """The store's config hash is of the point's YAML; a config field added to the code since
    the point trained (at its default) changes that text, and the runner refused every trained
    point of an unchanged spec ("the spec changed the config of points that already ran")."""
    out, pid = tmp_path / "out", "C1.5e9-L1-s0"
    spec, spec_dir = _train_one(out, pid)
    p = next(q for q in generate_points(spec, spec_dir)[0] if q.id == pid)
    # The point.yaml the older code wrote: without a field this code has, at its default.
    old = to_dict(p.cfg)
    default = to_dict(Config())
    section, key = next((s, k) for s in old for k in old[s] if old[s][k] == default[s][k])
    del old[section][key]
    text = yaml.safe_dump(old, sort_keys=False)
    (out / "points" / pid / "point.yaml").write_text(text)
    store = ResultStore(out / "results.sqlite")
    store.update(pid, config_hash=hashlib.sha256(text.encode()).hexdigest()[:16])
    store.close()
    assert main(["--config", str(TINY), "--out", str(out), "--dry-run", SYNTHETIC]) == 0
    assert "another config" not in capsys.readouterr().out
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, out, only=[pid], log=_quiet)}
    assert rows[pid]["status"] == "done" and rows[pid]["config_hash"] == p.config_hash
    assert _launches(out, pid) == 1  # not trained again
    # A real change is still refused, and a removed key is one (this code cannot read it).
    old[section]["no_such_key"] = 1
    (out / "points" / pid / "point.yaml").write_text(yaml.safe_dump(old))
    store = ResultStore(out / "results.sqlite")
    store.update(pid, config_hash="older")
    store.close()
    with pytest.raises(SweepError, match=rf"already ran: {pid};.*{section}\.no_such_key 1 -> \(unset\)"):
        run_sweep(spec, spec_dir, out, log=_quiet)


# ------------------------------------------------------------------ the points


def test_points_that_would_train_the_same_run_are_a_spec_error():
    """Grid token budgets 1e4 and 1.01e4 have two ids but round to the same steps: the same
    run was trained twice and the fit counted one measurement twice."""
    spec, spec_dir = load_spec(TINY, ["--isoflop=null", "--grid.tokens=[1e4,1.01e4]"])
    with pytest.raises(SpecError, match=r"grid.tokens: points D1e4-L1-s0 and D1.01e4-L1-s0 would train the same run \(39 steps"):
        generate_points(spec, spec_dir)
    spec, spec_dir = load_spec(TINY, ["--isoflop.budgets=[1.5e9,1.51e9]"])  # only the 8-step L2 points coincide
    with pytest.raises(SpecError, match=r"isoflop.budgets: points C1.5e9-L2-s0 and C1.51e9-L2-s0 .* at depth 2"):
        generate_points(spec, spec_dir)
    spec, spec_dir = load_spec(TINY, ["--isoflop=null", "--grid.tokens=[1e4,1.1e4]"])
    assert len(generate_points(spec, spec_dir)[0]) == 4


# ------------------------------------------------------------------ progress


class _StepHandle:
    """A point that logs half its steps at its first poll and ends at its second."""

    def __init__(self, task):
        self.point_id, self.job_id, self.task, self.polls = task.point_id, "1", task, 0

    def poll(self):
        self.polls += 1
        if self.polls == 1:
            (Path(self.task.run_dir) / "metrics.jsonl").write_text(json.dumps({"step": self.task.steps // 2, "loss": 2.0}) + "\n")
        return Outcome("done", 2.0, 2.0, self.task.steps, 0.1, 0) if self.polls >= 2 else None

    def cancel(self):
        pass


class _StepExecutor:
    slots = 1

    def __init__(self, **_):
        pass

    def submit(self, task):
        return _StepHandle(task)

    def shutdown(self):
        pass


def test_progress_is_by_predicted_work_and_shows_the_running_points_steps(tmp_path, monkeypatch, capsys):
    """The bar counted points: a sweep's budgets run smallest first, so with the two small
    points of four done it said 50% (and an ETA to match) with 9% of the work done, and a
    point hours long showed nothing until it ended. Now it fills by the dry run's predicted
    time, and lists each running point's logged steps."""
    monkeypatch.setitem(ex_mod.EXECUTORS, "steps", _StepExecutor)
    monkeypatch.setattr(sweep_mod, "PROGRESS_EVERY_S", 0.0)
    spec, spec_dir = load_spec(TINY, [SYNTHETIC, "--isoflop.budgets=[1.5e9,1.5e10]", "--estimate.startup_s=0"])
    points = generate_points(spec, spec_dir)[0]
    work = [throughput(spec.estimate).seconds(p) for p in points]
    assert max(work[2:]) > 5 * max(work[:2])  # (the large budget's points, last)
    run_sweep(spec, spec_dir, tmp_path / "out", executor="steps", log=_quiet)
    shown = capsys.readouterr().err.replace("\r", "\n").splitlines()
    two_done = next(line for line in shown if "2/4 points" in line)
    assert int(two_done.split("%")[0].split()[-1]) == round(100 * sum(work[:2]) / sum(work))
    big = points[3]
    assert any(f"3/4 points | {big.id} {big.steps // 2}/{big.steps}" in line for line in shown)
    assert "100%" in shown[-1] and "4/4 points" in shown[-1]


def test_last_logged_step_reads_the_files_end(tmp_path):
    assert last_logged_step(tmp_path) == 0  # no metrics.jsonl yet
    lines = [json.dumps({"step": s, "loss": 1.0, "pad": "x" * 50}) for s in range(1, 500)]
    lines.insert(-1, json.dumps({"step": 498, "eval_loss": 1.0}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 500, "lo')  # a line cut by a crash
    assert last_logged_step(tmp_path, tail_bytes=300) == 499


def test_a_narrowed_spec_says_the_store_keeps_the_other_points(tmp_path, fake_train):
    """A spec resumed with fewer budgets left the other budgets' finished rows in the store,
    where `fit` reads them, without a word."""
    out, logged = tmp_path / "out", []
    _train_one(out, "C3e9-L1-s0")
    spec, spec_dir = load_spec(TINY, [SYNTHETIC, "--isoflop.budgets=[1.5e9]"])
    run_sweep(spec, spec_dir, out, only=["C1.5e9-L1-s0"], log=logged.append)
    assert f"{out / 'results.sqlite'} also holds 1 finished point this spec does not make (C3e9-L1-s0); `fit --results {out}` reads them too" in logged
    logged.clear()
    run_sweep(spec, spec_dir, out, log=logged.append, only=["C1.5e9-L2-s0"])  # --only: the spec's other points are not "others"
    assert sum("also holds 1 finished point" in m for m in logged) == 1


class _Silent:
    """A cluster job that never reports an end (its scheduler lost it)."""

    def __init__(self, task):
        self.point_id, self.job_id = task.point_id, "9"

    def poll(self):
        return None

    def cancel(self):
        pass


class _SilentExecutor:
    def __init__(self, workers=1, **_):
        self.slots, self.handles = workers, []

    def submit(self, task):
        self.handles.append(_Silent(task))
        if len(self.handles) == 4:  # all started: Ctrl-C
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        return self.handles[-1]

    def shutdown(self):
        pass


def test_the_wait_after_ctrl_c_is_one_deadline_for_all_points(tmp_path, monkeypatch, capsys):
    """After a Ctrl-C the runner polled each point for up to 120 s in turn: four cluster jobs
    that never reported kept it 8 minutes instead of 2."""
    monkeypatch.setitem(ex_mod.EXECUTORS, "silent", _SilentExecutor)
    monkeypatch.setattr(sweep_mod, "STOP_WAIT_S", 0.5)
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    t0 = time.monotonic()
    rows = run_sweep(spec, spec_dir, tmp_path / "out", workers=4, executor="silent", log=_quiet)
    assert time.monotonic() - t0 < 1.5  # (4 x 0.5 s before)
    assert all(r["status"] == "running" for r in rows)
    assert "C3e9-L2-s0: no outcome 0 s after the stop; its row stays `running`" in capsys.readouterr().out
