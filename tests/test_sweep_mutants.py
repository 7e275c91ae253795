"""Sweep runner and executors: tests written against mutants the first tests let through,
and against what a user meets (an interrupted sweep re-run, failed points, bad specs and
flags, a dry run that must match the run).

No JAX training here: the runner's children are a fake `python -m scaling train` (a
`scaling/__main__.py` in a folder the runner is started from: `python -m` looks in the
working directory first) that writes metrics.jsonl the way train.py does, fails, or stops
and checkpoints on SIGTERM, as told per point. The whole file takes a few seconds.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import fake_trainer
import pytest

import scaling
from scaling import accounting
from scaling import executors as ex_mod
from scaling.executors import (
    STDERR_TAIL_CHARS,
    LocalExecutor,
    PointTask,
    SubmititExecutor,
    collect_outcome,
    read_metrics,
    train_command,
    visible_gpus,
)
from scaling.sweep import (
    FamilySpec,
    PowerRule,
    ResultStore,
    SpecError,
    SweepError,
    _fmt,
    _hms,
    _wait_for_orphans,
    dry_run_table,
    generate_points,
    load_spec,
    main,
    prepare_data,
    run_sweep,
    spec_from_dict,
    throughput,
    trained_with_another_config,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "sweeps" / "tiny_cpu.yaml"
SYNTHETIC = "--base.overrides.data.source=synthetic"  # no corpus to tokenize before the points
IDS = ["C1.5e9-L1-s0", "C1.5e9-L2-s0", "C3e9-L1-s0", "C3e9-L2-s0"]


def _spec(**delta):
    data = {"base": {"config": str(ROOT / "configs" / "tiny_corpus.yaml")}, "depths": [1, 2], "isoflop": {"budgets": [1e9]}}
    data.update(delta)
    return data


def _quiet(_msg):
    pass


# ------------------------------------------------------------------------ the fake trainer

FAKE_TRAIN = r'''
"""A stand-in for `python -m scaling train --config C --run_dir R` (tests/test_sweep_mutants.py).
The plan (JSON, $FAKE_PLAN) says per point id: done | fail | short | hang."""
import json, os, signal, sys, time
from pathlib import Path
import yaml

args = sys.argv[1:]
cfg = yaml.safe_load(open(args[args.index("--config") + 1]))
run_dir = Path(args[args.index("--run_dir") + 1])
steps, pid = cfg["train"]["steps"], run_dir.name
mode = json.loads(Path(os.environ["FAKE_PLAN"]).read_text()).get(pid, "done")
metrics = run_dir / "metrics.jsonl"
start = 0  # resume where the metrics stop, as train.py resumes from its checkpoint
if metrics.exists():
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            start = rec["step"]
with open(run_dir / "attempts.log", "a") as f:
    f.write(f"{mode} from {start}\n")
print(f"run directory: {run_dir}", flush=True)

def train(upto):
    with open(metrics, "a") as f:
        for s in range(start + 1, upto + 1):
            f.write(json.dumps({"step": s, "loss": 6.0 - s / steps}) + "\n")
        if upto == steps:
            f.write(json.dumps({"step": steps, "eval_loss": 5.5}) + "\n")

if mode == "fail":
    print(f"boom in {pid}", file=sys.stderr)
    sys.exit(3)
if mode == "hang":  # trains until SIGTERM, then checkpoints half-way and exits 0 (as train.py)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    (run_dir / "started").touch()
    while not stop:
        time.sleep(0.02)
    train(steps // 2)
    sys.exit(0)
train(steps // 2 if mode == "short" else steps)
'''


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    """Run from a folder whose scaling/__main__.py is the fake trainer (tests/fake_trainer.py)."""
    return fake_trainer.install(tmp_path, monkeypatch, FAKE_TRAIN)


def _launches(out: Path, pid: str) -> list[str]:
    p = out / "points" / pid / "attempts.log"
    return p.read_text().splitlines() if p.exists() else []


def _rows(out: Path) -> dict[str, dict]:
    db = sqlite3.connect(out / "results.sqlite")
    db.row_factory = sqlite3.Row
    try:
        return {r["id"]: dict(r) for r in db.execute("SELECT * FROM points")}
    finally:
        db.close()


# ------------------------------------------------------------------------ the runner, end to end


def test_rerun_skips_finished_points_and_retries_failed(tmp_path, fake_train, capsys):
    """Finished points are not launched again and keep their results; a failed point is
    recorded with its stderr and exit status, reported, and retried on the next run."""
    out = tmp_path / "out"
    fake_train({"C3e9-L1-s0": "fail"})
    args = ["--config", str(TINY), "--out", str(out), "--workers", "2", SYNTHETIC]
    assert main(args) == 1  # not all done
    text = capsys.readouterr().out
    assert "3 done, 1 failed" in text
    rows = _rows(out)
    bad = rows["C3e9-L1-s0"]
    assert bad["status"] == "failed" and bad["error"].startswith("exit status 3: ") and "boom in C3e9-L1-s0" in bad["error"]
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    points = {p.id: p for p in generate_points(spec, spec_dir)[0]}
    for pid in IDS:
        if pid == "C3e9-L1-s0":
            continue
        r = rows[pid]
        steps = points[pid].steps
        assert r["status"] == "done" and r["attempts"] == 1 and r["last_step"] == steps
        assert r["final_loss"] == pytest.approx(6.0 - 1.0) and r["eval_loss"] == 5.5  # the last record of each kind
        assert _launches(out, pid) == ["done from 0"]

    fake_train({})  # the failure is gone
    assert main(args) == 0
    after = _rows(out)
    for pid in IDS:
        assert after[pid]["status"] == "done"
        if pid != "C3e9-L1-s0":  # not launched again, results untouched
            assert _launches(out, pid) == ["done from 0"]
            assert after[pid]["attempts"] == 1 and after[pid]["final_loss"] == rows[pid]["final_loss"]
    assert _launches(out, "C3e9-L1-s0") == ["fail from 0", "done from 0"]
    assert after["C3e9-L1-s0"]["attempts"] == 2 and after["C3e9-L1-s0"]["error"] is None
    assert after["C3e9-L1-s0"]["wall_time"] > bad["wall_time"] > 0  # summed over attempts


def test_no_retry_failed_dry_run_matches_the_run(tmp_path, fake_train, capsys):
    """--no-retry-failed leaves failed points alone; the dry run counted them among the
    points left (was: "predicted time for the 1 points left" while the run trained none)."""
    out = tmp_path / "out"
    fake_train({"C1.5e9-L2-s0": "fail"})
    base = ["--config", str(TINY), "--out", str(out), SYNTHETIC]
    assert main(base) == 1
    capsys.readouterr()
    fake_train({})
    assert main([*base, "--dry-run", "--no-retry-failed"]) == 0
    text = capsys.readouterr().out
    assert "predicted time for the 0 points left" in text
    line = next(x for x in text.splitlines() if x.startswith("C1.5e9-L2-s0"))
    assert line.endswith("failed; left alone (--no-retry-failed)")
    assert main([*base, "--no-retry-failed"]) == 1
    assert _launches(out, "C1.5e9-L2-s0") == ["fail from 0"]  # ... and the run trains none
    capsys.readouterr()
    assert main([*base, "--dry-run"]) == 0
    assert "predicted time for the 1 points left" in capsys.readouterr().out
    assert main(base) == 0
    assert _launches(out, "C1.5e9-L2-s0") == ["fail from 0", "done from 0"]  # ... and the run trains one


def test_ctrl_c_checkpoints_then_a_rerun_resumes(tmp_path, fake_train):
    """SIGINT to the runner: the running point gets SIGTERM, checkpoints, is recorded as
    interrupted (resumable, not failed); the re-run resumes it and skips the finished ones."""
    out = tmp_path / "out"
    hang = "C3e9-L2-s0"
    fake_train({hang: "hang"})
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    steps = {p.id: p.steps for p in generate_points(spec, spec_dir)[0]}
    started = out / "points" / hang / "started"

    def interrupt():
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if started.exists():
            os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, out, workers=2, log=_quiet)}
    t.join()
    r = rows[hang]
    assert r["status"] == "interrupted" and r["last_step"] == steps[hang] // 2
    assert r["error"] == f"stopped at step {steps[hang] // 2} of {steps[hang]}"
    finished = {pid for pid, row in rows.items() if row["status"] == "done"}
    fake_train({})
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, out, workers=2, log=_quiet)}
    assert all(r["status"] == "done" for r in rows.values())
    assert _launches(out, hang) == ["hang from 0", f"done from {steps[hang] // 2}"]
    assert rows[hang]["attempts"] == 2 and rows[hang]["last_step"] == steps[hang]
    for pid in finished:
        assert len(_launches(out, pid)) == 1 and rows[pid]["attempts"] == 1


def test_rerun_waits_for_a_killed_runners_point(tmp_path, fake_train):
    """A point still running from a killed runner (SIGTERMed, checkpointing) is waited for
    before the point trains again in the same run dir."""
    out = tmp_path / "out"
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    pid = "C1.5e9-L1-s0"
    run_dir = out / "points" / pid
    run_dir.mkdir(parents=True)
    p = next(q for q in generate_points(spec, spec_dir)[0] if q.id == pid)
    orphan = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(1.0); open(sys.argv[1], 'a').write('orphan\\n')",
                               str(run_dir / "attempts.log")])  # fmt: skip
    store = ResultStore(out / "results.sqlite")
    store.add(spec.name, p, str(run_dir))
    store.start(pid, str(orphan.pid))
    store.close()
    time.sleep(0.3)  # (its cmdline is the argv above once python started)
    run_sweep(spec, spec_dir, out, only=[pid], log=_quiet)
    orphan.wait()
    assert _launches(out, pid) == ["orphan", "done from 0"]


def test_invalid_point_is_failed_without_a_launch(tmp_path, fake_train):
    out = tmp_path / "out"
    spec, spec_dir = load_spec(TINY, [SYNTHETIC, '--point_overrides={"C3e9-L2-*": {train: {grad_accum: 3}}}'])
    rows = {r["id"]: r for r in run_sweep(spec, spec_dir, out, log=_quiet)}
    assert rows["C3e9-L2-s0"]["status"] == "failed" and "grad_accum" in rows["C3e9-L2-s0"]["error"]
    assert _launches(out, "C3e9-L2-s0") == [] and rows["C3e9-L2-s0"]["attempts"] == 0
    assert all(rows[pid]["status"] == "done" for pid in IDS[:3])


def test_new_config_replaces_a_never_trained_row(tmp_path, fake_train):
    """A point that never trained takes the spec's new config (and its numbers in the store)."""
    out = tmp_path / "out"
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    store = ResultStore(out / "results.sqlite")
    for p in generate_points(spec, spec_dir)[0]:
        store.add(spec.name, p, str(out / "points" / p.id))  # pending, old learning rate
    store.close()
    spec2, _ = load_spec(TINY, [SYNTHETIC, "--hparams.learning_rate.base=1e-3"])
    new = {p.id: p for p in generate_points(spec2, spec_dir)[0]}
    rows = {r["id"]: r for r in run_sweep(spec2, spec_dir, out, only=["C1.5e9-L1-s0"], log=_quiet)}
    r = rows["C1.5e9-L1-s0"]
    n = new["C1.5e9-L1-s0"].n_params
    assert r["status"] == "done" and r["config_hash"] == new["C1.5e9-L1-s0"].config_hash
    assert r["learning_rate"] == pytest.approx(1e-3 * (n / 1e5) ** -0.25)


class _FakeHandle:
    def __init__(self, ex, task):
        self.point_id, self.job_id, self.ex, self.task, self.polls = task.point_id, "fake", ex, task, 0

    def poll(self):
        if self.ex.poll_error:
            raise RuntimeError("the store went away")
        self.polls += 1
        if self.polls < 3:
            return None
        if self in self.ex.live:
            self.ex.live.remove(self)
        return ex_mod.Outcome("done", 1.0, 1.0, self.task.steps, 0.1, 0)

    def cancel(self):
        pass


class _FakeExecutor:
    """Counts how many points it has at once; never starts a process."""

    last = None

    def __init__(self, workers=1, poll_error=False, **_):
        self.slots, self.live, self.most, self.shut, self.poll_error = workers, [], 0, False, poll_error
        _FakeExecutor.last = self

    def submit(self, task):
        h = _FakeHandle(self, task)
        self.live.append(h)
        self.most = max(self.most, len(self.live))
        return h

    def shutdown(self):
        self.shut = True


def test_runner_keeps_at_most_workers_points_running(tmp_path, monkeypatch):
    monkeypatch.setitem(ex_mod.EXECUTORS, "fake", _FakeExecutor)
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    rows = run_sweep(spec, spec_dir, tmp_path / "out", workers=3, executor="fake", log=_quiet)
    assert all(r["status"] == "done" for r in rows)
    assert _FakeExecutor.last.most == 3


def test_runner_error_stops_the_running_points(tmp_path, monkeypatch):
    """An exception in the runner loop (here: a poll) used to leave the points running,
    orphaned in a process that goes on (a notebook, a test)."""
    monkeypatch.setitem(ex_mod.EXECUTORS, "fake", lambda **kw: _FakeExecutor(poll_error=True, **kw))
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    with pytest.raises(RuntimeError, match="the store went away"):
        run_sweep(spec, spec_dir, tmp_path / "out", executor="fake", log=_quiet)
    assert _FakeExecutor.last.shut


# ------------------------------------------------------------------------ executors


def _task(tmp_path, steps=10) -> PointTask:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return PointTask("P", str(tmp_path / "p.yaml"), str(run_dir), steps)


def _write_metrics(task: PointTask, lines: list[str]) -> None:
    (Path(task.run_dir) / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def test_read_metrics_takes_the_last_record_of_each_kind(tmp_path):
    task = _task(tmp_path)
    assert read_metrics(task.run_dir) == (0, None, None)
    _write_metrics(task, ['{"step": 5, "loss": 3.0}', '{"step": 5, "eval_loss": 3.5}', '{"step": 10, "loss": 2.0}',
                          '{"step": 10, "eval_loss": 2.5}', '{"step": 11, "lo'])  # the last line cut by a crash
    assert read_metrics(task.run_dir) == (10, 2.0, 2.5)


@pytest.mark.parametrize(
    "rc, last, status",
    [
        (0, 10, "done"),
        (0, 12, "done"),  # (a run that went past its target)
        (0, 9, "interrupted"),  # exited cleanly short of the target: resumable
        (-signal.SIGTERM, 4, "interrupted"),
        (-signal.SIGINT, 4, "interrupted"),
        (-signal.SIGKILL, 10, "failed"),  # killed: no exit status 0, whatever the metrics say
        (1, 10, "failed"),
        (None, 10, "failed"),  # no exit status at all (a cluster job that died)
    ],
)
def test_collect_outcome_status(tmp_path, rc, last, status):
    task = _task(tmp_path, steps=10)
    _write_metrics(task, [json.dumps({"step": last, "loss": 2.0})])
    out = collect_outcome(task, rc, 1.5)
    assert (out.status, out.last_step, out.final_loss, out.returncode, out.wall_time) == (status, last, 2.0, rc, 1.5)
    if status == "interrupted":
        assert out.error == f"stopped at step {last} of 10"
    if status == "done":
        assert out.error is None


def test_failed_outcome_keeps_this_attempts_stderr_tail(tmp_path):
    task = _task(tmp_path)
    err = Path(task.run_dir) / "stderr.log"
    old = "old attempt's error\n"
    new = "x" * (STDERR_TAIL_CHARS + 100) + "\nValueError: the real cause"
    err.write_text(old + new)
    out = collect_outcome(task, 2, 1.0, stderr_offset=len(old))
    assert out.status == "failed" and out.error.startswith("exit status 2: ")
    assert "old attempt" not in out.error and out.error.endswith("ValueError: the real cause")
    assert len(out.error) == len("exit status 2: ") + STDERR_TAIL_CHARS
    assert collect_outcome(task, 2, 1.0, stderr_offset=len(old + new)).error == "exit status 2"


def test_train_command_is_the_train_cli(tmp_path):
    task = _task(tmp_path)
    assert train_command(task) == [sys.executable, "-m", "scaling", "train", "--config", task.config_path, "--run_dir", task.run_dir]


def test_visible_gpus_from_the_environment(monkeypatch):
    for env, want in [("0,1", ["0", "1"]), ("1, 3", ["1", "3"]), ("", []), ("-1", []), ("2,", ["2"])]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        assert visible_gpus() == want, env


class _FakeProc:
    def __init__(self, pid):
        self.pid, self.rc = pid, None

    def poll(self):
        return self.rc


def _fake_spawns(monkeypatch):
    envs, procs = [], []

    def spawn(task, env_extra, follow_parent):
        envs.append(dict(env_extra))
        procs.append(_FakeProc(1000 + len(procs)))
        return procs[-1], 0

    monkeypatch.setattr(ex_mod, "_spawn", spawn)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    return envs, procs


def test_local_executor_spreads_points_over_gpus(tmp_path, monkeypatch):
    """Each point on the least busy GPU; points sharing a GPU get 0.9 / (points per GPU) of
    its memory (XLA takes 75% per process otherwise)."""
    envs, procs = _fake_spawns(monkeypatch)
    ex = LocalExecutor(workers=3, gpus=["0", "1"])  # ceil(3 / 2) = 2 points per GPU
    for _ in range(3):
        ex.submit(_task(tmp_path))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0"]
    assert all(e["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.450" for e in envs)
    procs[0].rc = procs[2].rc = 0  # both of GPU 0's points finished: it is the free one now
    ex.submit(_task(tmp_path))
    assert envs[-1]["CUDA_VISIBLE_DEVICES"] == "0"
    procs[1].rc = 0  # GPU 1 free, GPU 0 has one point
    ex.submit(_task(tmp_path))
    assert envs[-1]["CUDA_VISIBLE_DEVICES"] == "1"

    envs.clear()
    LocalExecutor(workers=2, gpus=["0", "1"]).submit(_task(tmp_path))  # one point per GPU: the whole GPU
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0"}]
    envs.clear()
    LocalExecutor(workers=4, gpus=[]).submit(_task(tmp_path))  # CPU: nothing to pin
    assert envs == [{}]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.2")  # the user's own setting wins
    envs.clear()
    LocalExecutor(workers=8, gpus=["0"]).submit(_task(tmp_path))
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0"}]


def test_spawn_environment_order_and_logs(tmp_path, monkeypatch):
    """os.environ < the task's env < the executor's (the GPU pin); the task's working dir
    (relative paths in its config); stdout and stderr append."""
    monkeypatch.setenv("SWEEP_T_A", "environ")
    monkeypatch.setenv("SWEEP_T_B", "environ")
    script = ("import os, sys; print(os.environ['SWEEP_T_A'], os.environ['SWEEP_T_B'], os.environ['PYTHONUNBUFFERED'], "
              "os.path.basename(os.getcwd())); print('e', file=sys.stderr)")
    monkeypatch.setattr(ex_mod, "train_command", lambda task: [sys.executable, "-c", script])
    (tmp_path / "wd").mkdir()
    task = PointTask("P", "c.yaml", str(tmp_path / "run"), 1, env={"SWEEP_T_A": "task", "SWEEP_T_B": "task"}, cwd=str(tmp_path / "wd"))
    for _ in range(2):
        proc, offset = ex_mod._spawn(task, {"SWEEP_T_B": "executor"}, follow_parent=False)
        proc.wait()
    assert offset == 2  # the second attempt's stderr starts after the first's "e\n"
    assert (tmp_path / "run" / "stdout.log").read_text() == "task executor 1 wd\n" * 2


class _FakeJob:
    job_id = "4242"

    def __init__(self, done, result):
        self._done, self._result = done, result

    def done(self):
        return self._done

    def result(self):
        assert self._done, "result() blocks until the job ends: the runner would wait on one point"
        if isinstance(self._result, Exception):
            raise self._result
        return self._result


def test_submitit_handle_outcomes(tmp_path):
    """A job's own Outcome is the point's; a job that died (node failure, time limit) is a
    failed point with the cluster's message, whatever its metrics reached."""
    task = _task(tmp_path, steps=10)
    _write_metrics(task, ['{"step": 10, "loss": 2.0}'])
    assert ex_mod.SubmititHandle(task, _FakeJob(False, None)).poll() is None
    mine = ex_mod.Outcome("done", 2.0, None, 10, 3.0, 0)
    assert ex_mod.SubmititHandle(task, _FakeJob(True, mine)).poll() is mine
    out = ex_mod.SubmititHandle(task, _FakeJob(True, RuntimeError("DUE TO TIME LIMIT"))).poll()
    assert out.status == "failed" and out.error == "submitit job 4242: DUE TO TIME LIMIT" and out.last_step == 10


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


RUNNER = """
import sys, time
from scaling.executors import LocalExecutor, PointTask
h = LocalExecutor(workers=1, gpus=[]).submit(PointTask("P", sys.argv[1], sys.argv[2], 10))
print(h.job_id, flush=True)
time.sleep(60)
"""


def test_local_point_dies_with_its_runner(tmp_path, fake_train):
    """A runner killed outright (SIGKILL) leaves no point training on: the point gets SIGTERM
    and checkpoints (PR_SET_PDEATHSIG); and it has its own process group, so a Ctrl-C at the
    terminal reaches only the runner."""
    cfg, run_dir = tmp_path / "p.yaml", tmp_path / "runs" / "P"
    cfg.write_text("train: {steps: 10}\n")
    run_dir.mkdir(parents=True)
    fake_train({"P": "hang"})
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(cfg), str(run_dir)], stdout=subprocess.PIPE, text=True)
    child = int(runner.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.getpgid(child) == child != os.getpgid(runner.pid)
        runner.kill()
        runner.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the point outlived its runner"
        assert read_metrics(run_dir)[0] == 5  # it checkpointed half-way, on the SIGTERM
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        runner.stdout.close()


def test_submitit_errors_name_the_flag_or_key(tmp_path):
    pytest.importorskip("submitit")
    with pytest.raises(ex_mod.ExecutorError, match="spec key `submitit`.*bogus"):
        SubmititExecutor(folder=tmp_path, cluster="local", options={"bogus": 1})
    with pytest.raises(ex_mod.ExecutorError, match="--cluster: unknown cluster 'nosuch'; allowed: slurm, local, debug"):
        SubmititExecutor(folder=tmp_path, cluster="nosuch")
    ex = SubmititExecutor(folder=tmp_path, cluster="local", options={"timeout_min": 7})
    assert ex.executor.parameters["timeout_min"] == 7  # the spec's options win over the default 60
    assert SubmititExecutor(folder=tmp_path, cluster="local").executor.parameters["timeout_min"] == 60


def test_submitit_bad_option_stops_the_runner_before_any_write(tmp_path, capsys):
    pytest.importorskip("submitit")
    out = tmp_path / "out"
    rc = main(["--config", str(TINY), "--out", str(out), "--executor", "submitit", "--cluster", "local", SYNTHETIC, "--submitit.bogus=1"])
    assert rc == 2 and "spec key `submitit`" in capsys.readouterr().err  # (was a NameError traceback)
    assert not (out / "results.sqlite").exists()


def test_submitit_local_job_leaves_no_literal_percent_j_folder(tmp_path, fake_train):
    """submitit's local controller made `submitit/%j/` (it does not expand %j; SLURM does)."""
    pytest.importorskip("submitit")
    out = tmp_path / "out"
    rc = main(["--config", str(TINY), "--out", str(out), "--executor", "submitit", "--cluster", "local",
               "--only", "C1.5e9-L1-s0", SYNTHETIC])  # fmt: skip
    assert rc == 0 and _rows(out)["C1.5e9-L1-s0"]["status"] == "done"
    names = [p.name for p in (out / "submitit").iterdir()]
    assert names and "%j" not in names and any(n.endswith("_log.out") for n in names)


def test_cli_cluster_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(TINY), "--dry-run", "--cluster", "pbs"])
    assert exc.value.code == 2 and "invalid choice: 'pbs'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # was ignored, silently
        main(["--config", str(TINY), "--dry-run", "--cluster", "slurm"])
    assert exc.value.code == 2 and "--cluster slurm applies to --executor submitit only" in capsys.readouterr().err


# ------------------------------------------------------------------------ spec and points


def test_power_rule_against_hand_values():
    lr = PowerRule(base=1e-3, ref=1e6, exponent=-0.5)
    assert lr.value(4e6) == pytest.approx(5e-4) and lr.value(1e4) == pytest.approx(1e-2)
    assert PowerRule(base=1e-3, ref=1e6, exponent=-0.5, min=6e-4).value(4e6) == pytest.approx(6e-4)
    assert PowerRule(base=1e-3, ref=1e6, exponent=-0.5, min=6e-4).value(1e4) == pytest.approx(1e-2)
    assert PowerRule(base=1e-3, ref=1e6, exponent=-0.5, max=3e-3).value(1e4) == pytest.approx(3e-3)
    assert PowerRule(base=1e-3, ref=1e6, exponent=-0.5, max=3e-3).value(4e6) == pytest.approx(5e-4)
    # integers: the nearest multiple (11 -> 12, not 8), never below one multiple
    assert PowerRule(base=11, multiple_of=4).integer(1) == 12
    assert PowerRule(base=1, multiple_of=4).integer(1) == 4
    assert PowerRule(base=8, ref=2, exponent=1, multiple_of=8, max=40).integer(100) == 40


def test_family_shape_by_hand():
    # d = 64 * 4 = 256; 256 / 64 = 4 heads, 2 KV heads; F = 8/3 * 256 = 682.7 -> 704 (11 x 64)
    assert FamilySpec(kv_ratio=2).model(4) == {
        "num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "mlp_dim": 704,
    }  # fmt: skip


def test_param_counts_by_hand():
    """tiny_cpu's L1 and L2 models, Llama counted by hand (V = 272, untied head, no biases):
    L1: d 32, 2 heads of 16, 1 KV head, F 96: q 1024 + k 512 + v 512 + o 1024 + MLP 3*32*96
    + norms 64 = 12,352 a layer; + embedding 8,704 + final norm 32 + head 8,704 = 29,792.
    L2: d 64, 4 heads, 2 KV, F 192: 4096 + 2048 + 2048 + 4096 + 36,864 + 128 = 49,280 a layer;
    2 layers + 17,408 + 64 + 17,408 = 133,440. Non-embedding (Kaplan's N): less the V x d input
    table and the V x d head (Kaplan's were one tied matrix, excluded; the head had been kept)."""
    spec, spec_dir = load_spec(TINY)
    by_depth = {p.depth: p for p in generate_points(spec, spec_dir)[0]}
    assert (by_depth[1].n_params, by_depth[1].n_params_nonembedding) == (29_792, 29_792 - 2 * 8_704)
    assert (by_depth[2].n_params, by_depth[2].n_params_nonembedding) == (133_440, 133_440 - 2 * 17_408)
    # Tied: one V x d matrix, counted once and left out once.
    spec, spec_dir = load_spec(TINY, ['--point_overrides={"*": {model: {tie_embeddings: true}}}'])
    tied = {p.depth: p for p in generate_points(spec, spec_dir)[0]}
    assert (tied[1].n_params, tied[1].n_params_nonembedding) == (29_792 - 8_704, 29_792 - 2 * 8_704)
    assert by_depth[1].cfg.logging.progress is False  # the child's stdout is a log file


def test_a_row_with_the_old_nonembedding_count_is_brought_up_to_date(tmp_path):
    """A results row written when n_params_nonembedding still held the untied head gets the
    current count when the point is added again (a resumed sweep); its status and loss stay."""
    import dataclasses

    from scaling.sweep import ResultStore

    spec, spec_dir = load_spec(TINY)
    p = generate_points(spec, spec_dir)[0][0]
    old = dataclasses.replace(p, n_params_nonembedding=p.n_params_nonembedding + 8_704)
    store = ResultStore(tmp_path / "r.sqlite")
    store.add("s", old, "x")
    store.update(p.id, status="done", final_loss=1.25)
    store.add("s", p, "x")
    row = store.row(p.id)
    store.close()
    assert (row["n_params_nonembedding"], row["status"], row["final_loss"]) == (p.n_params_nonembedding, "done", 1.25)


def test_param_count_follows_point_overrides():
    """An override of the model is counted: L1 with mlp_dim 64 has 3 x 32 x 64 = 6,144 MLP
    parameters a layer instead of 9,216, so 29,792 - 3,072 = 26,720 in all."""
    spec, spec_dir = load_spec(TINY, ['--point_overrides={"C1.5e9-L1-s0": {model: {mlp_dim: 64}}}'])
    p = generate_points(spec, spec_dir)[0][0]
    assert p.id == "C1.5e9-L1-s0" and (p.n_params, p.n_params_nonembedding) == (26_720, 26_720 - 2 * 8_704)


def test_rules_of_tokens_flops_and_warmup_min(tmp_path):
    """batch by the point's C (grid: D x FLOPs per token), warmup = max(min, fraction x steps)."""
    hp = {"batch_size": {"base": 2, "ref": 1e9, "exponent": 1.0, "of": "flops", "multiple_of": 2},
          "warmup_fraction": 0.1, "warmup_min": 3}  # fmt: skip
    spec = spec_from_dict(_spec(isoflop=None, grid={"tokens": [65536]}, depths=[1], hparams=hp,
                                base={"config": str(ROOT / "configs" / "tiny_corpus.yaml"),
                                      "overrides": {"train": {"seq_len": 32}, "model": {"max_seq_len": 64}}}))  # fmt: skip
    (p,), _ = generate_points(spec, tmp_path)
    m = p.cfg.model
    c = 65536 * accounting.flops_per_token(m, 32).total
    batch = max(2, round(2 * c / 1e9 / 2) * 2)
    assert p.cfg.train.batch_size == batch and p.cfg.train.steps == round(65536 / (batch * 32))
    assert p.cfg.optimizer.warmup_steps == max(3, round(0.1 * p.cfg.train.steps))
    assert p.cfg.optimizer.warmup_steps == 3  # (the minimum binds here)


def test_min_steps_keeps_a_point_with_exactly_that_many(tmp_path):
    spec, spec_dir = load_spec(TINY)
    p = next(p for p in generate_points(spec, spec_dir)[0] if p.id == "C1.5e9-L2-s0")
    fpt = accounting.flops_per_token(p.cfg.model, 32).total
    steps = round(1.5e9 / fpt / (8 * 32))
    assert p.steps == steps
    kept = {q.id for q in generate_points(load_spec(TINY, [f"--isoflop.min_steps={steps}"])[0], spec_dir)[0]}
    assert "C1.5e9-L2-s0" in kept
    kept = {q.id for q in generate_points(load_spec(TINY, [f"--isoflop.min_steps={steps + 1}"])[0], spec_dir)[0]}
    assert "C1.5e9-L2-s0" not in kept


def test_overrides_win_over_the_file():
    spec, _ = load_spec(TINY, ["--depths=[3]", "--estimate.startup_s=1"])
    assert spec.depths == (3,) and spec.estimate.startup_s == 1.0
    spec, _ = load_spec(TINY, ["--name=017"])  # a string field takes the text (was YAML 1.1's octal: '15')
    assert spec.name == "017"


def test_point_ids_keep_three_digits():
    assert [_fmt(x) for x in (1.25e9, 9.99e20, 1.005e3, 7e-3)] == ["1.25e9", "9.99e20", "1e3", "7e-3"]


@pytest.mark.parametrize(
    "delta, match",
    [
        ({"isoflop": {"budgets": [1e9], "min_steps": 0}}, "isoflop.min_steps: must be >= 1"),
        ({"hparams": {"warmup_fraction": 1.0}}, "hparams.warmup_fraction: must be in \\[0, 1\\)"),
        ({"estimate": {"mfu": 1.5}}, "estimate.mfu"),
        ({"estimate": {"mfu": 0.0}}, "estimate.mfu"),
        ({"estimate": {"tokens_per_sec": -1.0}}, "estimate.tokens_per_sec: must be positive"),
        ({"family": {"kv_ratio": 0}}, "family.kv_ratio: must be positive"),
        ({"family": {"mlp_ratio": 0.0}}, "family.mlp_ratio: must be positive"),
        ({"hparams": {"batch_size": {"base": 8, "multiple_of": 0}}}, "hparams.batch_size.multiple_of: must be >= 1"),
        ({"depths": [2, 2]}, "depths: has duplicates"),
        ({"depths": [0, 2]}, "depths: must be a non-empty list of positive"),
        ({"point_overrides": {"C1e9-*": 3}}, "point_overrides.C1e9-\\*: must be a mapping"),
        ({"seeds": []}, "seeds: must name at least one seed"),
        # Non-finite numbers: tracebacks from the point ids (inf), the MLP width, the batch rule.
        ({"isoflop": {"budgets": [float("inf")]}}, "isoflop.budgets: must be positive finite"),
        ({"isoflop": None, "grid": {"tokens": [float("inf")]}}, "grid.tokens: must be positive finite"),
        ({"family": {"mlp_ratio": float("inf")}}, "family.mlp_ratio: must be positive and finite"),
        ({"hparams": {"batch_size": {"base": float("inf")}}}, "hparams.batch_size: base and ref must be positive and finite"),
        ({"hparams": {"learning_rate": {"base": 1e-3, "exponent": float("nan")}}}, "hparams.learning_rate.exponent: must be finite"),
        ({"hparams": {"learning_rate": {"base": 1e-3, "max": float("inf")}}}, "hparams.learning_rate.max: must be positive and finite"),
        ({"estimate": {"startup_s": float("inf")}}, "estimate.startup_s: must be >= 0 seconds \\(and finite\\)"),
        ({"estimate": {"tokens_per_sec": float("inf")}}, "estimate.tokens_per_sec: must be positive and finite"),
        # A scalar for a list: `budgets: 1e9` (a string to YAML 1.1) said "budgets.1: Couldn't parse 'e'".
        ({"isoflop": {"budgets": "1e9"}}, "isoflop.budgets: must be a list, e.g. \\[1e9\\], got str '1e9'"),
        ({"depths": 2}, "depths: must be a list, e.g. \\[2\\], got int 2"),
        # A warmup minimum that did nothing (no fraction), or a negative one.
        ({"hparams": {"warmup_min": 10}}, "hparams.warmup_min: only applies with hparams.warmup_fraction"),
        ({"hparams": {"warmup_fraction": 0.1, "warmup_min": -1}}, "hparams.warmup_min: must be >= 0"),
        ({"seeds": [-1]}, "seeds: must be >= 0"),
    ],
)
def test_more_spec_errors_name_the_key(delta, match):
    with pytest.raises(SpecError, match=match):
        spec_from_dict(_spec(**delta))


def test_unmatched_point_override_glob_is_an_error(tmp_path):
    """A typo in a point_overrides glob changed nothing, silently."""
    spec = spec_from_dict(_spec(point_overrides={"C1e9-L3-*": {"optimizer": {"learning_rate": 1e-4}}}))
    with pytest.raises(SpecError, match="point_overrides.C1e9-L3-\\*: matches no point of this sweep; point ids: C1e9-L1-s0, C1e9-L2-s0"):
        generate_points(spec, tmp_path)
    # A glob for a point min_steps drops is no typo.
    spec = spec_from_dict(_spec(isoflop={"budgets": [1e9], "min_steps": 10**6}, point_overrides={"C1e9-L2-*": {}}))
    points, dropped = generate_points(spec, tmp_path)
    assert points == [] and len(dropped) == 2


def test_cli_estimate_flags_are_validated(capsys):
    from scaling.__main__ import main as cli

    assert cli(["sweep", "--config", str(TINY), "--dry-run", "--mfu", "2"]) == 2
    assert "estimate.mfu" in capsys.readouterr().err
    assert cli(["sweep", "--config", str(TINY), "--dry-run", "--tokens-per-sec", "0"]) == 2
    assert "estimate.tokens_per_sec" in capsys.readouterr().err


# ------------------------------------------------------------------------ estimates, store, helpers


def test_predicted_seconds_by_hand():
    spec, spec_dir = load_spec(TINY, ["--estimate.step_overhead_s=0.01"])
    p = generate_points(spec, spec_dir)[0][0]
    tp = throughput(spec.estimate)  # 20,000 tokens/s given, 20 s start-up
    assert tp.seconds(p) == pytest.approx(20 + 0.01 * p.steps + p.tokens / 20_000)
    # MFU: 30% of the H100 SXM's 989 dense bf16 TFLOP/s (NVIDIA H100 datasheet)
    spec, _ = load_spec(TINY, ["--estimate.tokens_per_sec=null", "--estimate.mfu=0.3", "--estimate.startup_s=0"])
    assert throughput(spec.estimate).seconds(p) == pytest.approx(p.flops / (0.3 * 989e12))


def test_hms():
    assert [_hms(x) for x in (0, 59.6, 61, 3599, 3600, 3661, 36061)] == ["0:00", "1:00", "1:01", "59:59", "1:00:00", "1:01:01", "10:01:01"]


def test_dry_run_table_counts_and_statuses():
    spec, spec_dir = load_spec(TINY)
    points = generate_points(spec, spec_dir)[0]
    tp = throughput(spec.estimate)
    rows = {points[0].id: {"status": "done", "config_hash": points[0].config_hash, "run_dir": None, "last_step": 9},
            points[1].id: {"status": "running", "config_hash": points[1].config_hash, "run_dir": None, "last_step": 3}}  # fmt: skip
    text = dry_run_table(points, tp, 2, rows)
    left = [tp.seconds(p) for p in points[1:]]
    assert f"predicted time for the 3 points left: {_hms(sum(left))} in series" in text
    assert f"{len(points)} points, {sum(p.flops for p in points):.3g} training FLOPs in all" in text
    assert "running" in next(x for x in text.splitlines() if x.startswith(points[1].id))


def test_trained_with_another_config(tmp_path):
    spec, spec_dir = load_spec(TINY)
    p = generate_points(spec, spec_dir)[0][0]
    row = {"config_hash": "other", "status": "pending", "last_step": None}
    assert not trained_with_another_config(p, None, None)
    assert not trained_with_another_config(p, row, tmp_path)  # never trained: take the new config
    assert trained_with_another_config(p, {**row, "last_step": 3}, tmp_path)  # logged a step
    assert trained_with_another_config(p, {**row, "status": "done"}, tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert trained_with_another_config(p, row, tmp_path)  # left a checkpoint
    assert not trained_with_another_config(p, {**row, "config_hash": p.config_hash, "status": "done"}, tmp_path)


def test_store_attempts_wall_time_and_errors(tmp_path):
    spec, spec_dir = load_spec(TINY)
    p = generate_points(spec, spec_dir)[0][0]
    store = ResultStore(tmp_path / "r.sqlite")
    store.add("s", p, "x")
    store.start(p.id, "11")
    store.finish(p.id, ex_mod.Outcome("failed", None, None, 2, 1.5, 1, "exit status 1"))
    assert store.row(p.id)["error"] == "exit status 1"
    store.start(p.id, "12")
    r = store.row(p.id)
    assert (r["status"], r["attempts"], r["job_id"], r["error"]) == ("running", 2, "12", None)
    store.finish(p.id, ex_mod.Outcome("done", 2.0, 2.1, 9, 2.25, 0))
    r = store.row(p.id)
    assert (r["status"], r["wall_time"], r["final_loss"], r["eval_loss"], r["last_step"]) == ("done", 3.75, 2.0, 2.1, 9)
    store.close()


def test_store_from_an_older_runner_gains_columns(tmp_path):
    db = sqlite3.connect(tmp_path / "r.sqlite")
    db.execute("CREATE TABLE points (id TEXT PRIMARY KEY, n_params INTEGER, status TEXT)")
    db.execute("INSERT INTO points VALUES ('old', 5, 'done')")
    db.commit()
    db.close()
    spec, spec_dir = load_spec(TINY)
    p = generate_points(spec, spec_dir)[0][0]
    store = ResultStore(tmp_path / "r.sqlite")
    store.add("s", p, "x")
    assert store.row(p.id)["target"] == 1.5e9 and store.row("old")["status"] == "done"
    store.close()


def test_wait_for_orphans_waits_then_kills(tmp_path):
    """A killed runner's point that still runs in its run dir: waited for (it checkpoints),
    SIGKILLed past the timeout; a pid that is now another program is left alone."""
    store = ResultStore(tmp_path / "r.sqlite")
    spec, spec_dir = load_spec(TINY)
    points = generate_points(spec, spec_dir)[0]
    procs = []
    for p, sleep, in_run_dir in zip(points, (0.5, 60, 60), (True, True, False)):
        run_dir = tmp_path / p.id
        argv = [sys.executable, "-c", f"import time; time.sleep({sleep})", str(run_dir) if in_run_dir else "elsewhere"]
        procs.append(subprocess.Popen(argv))
        store.add("s", p, str(run_dir))
        store.start(p.id, str(procs[-1].pid))
    time.sleep(0.3)  # (the children exec'd python: their cmdline is the argv above)
    logs = []
    t0 = time.monotonic()
    _wait_for_orphans(store, logs.append, timeout_s=1.5)
    assert 1.4 < time.monotonic() - t0 < 20
    assert procs[0].wait(timeout=5) == 0  # finished by itself
    assert procs[1].wait(timeout=5) == -signal.SIGKILL  # past the timeout
    assert procs[2].poll() is None  # not this run dir's process
    procs[2].kill()
    procs[2].wait()
    assert len(logs) == 2 and all("from an earlier runner" in m for m in logs)
    store.close()


def test_prepare_data_tokenizes_each_corpus_once(monkeypatch):
    import scaling.data

    calls = []
    monkeypatch.setattr(scaling.data, "build_token_store", lambda cfg, log: calls.append(cfg.data.cache_dir))
    spec, spec_dir = load_spec(TINY)
    points = generate_points(spec, spec_dir)[0]
    prepare_data(points, _quiet)
    assert len(calls) == 1
    calls.clear()
    spec, _ = load_spec(TINY, [SYNTHETIC])
    prepare_data(generate_points(spec, spec_dir)[0], _quiet)
    assert calls == []


def test_runner_refuses_an_unknown_executor(tmp_path):
    spec, spec_dir = load_spec(TINY, [SYNTHETIC])
    with pytest.raises(SweepError, match="--executor: unknown executor 'pbs'; allowed: local, submitit"):
        run_sweep(spec, spec_dir, tmp_path / "out", executor="pbs", log=_quiet)


def test_math_reference_isoflop_tokens():
    """D = C / FLOPs-per-token within half a step (Hoffmann et al. 2022, IsoFLOP profiles)."""
    spec, spec_dir = load_spec(TINY)
    for p in generate_points(spec, spec_dir)[0]:
        step_tokens = p.cfg.train.batch_size * p.cfg.train.seq_len
        assert abs(p.tokens - p.target / p.flops_per_token) <= step_tokens / 2
        assert math.isclose(p.flops, p.tokens * p.flops_per_token)


@pytest.mark.parametrize(
    "override, match",
    [
        ("--base.config=nope.yaml", "base.config: config file not found: .*nope.yaml"),
        ("--base.overrides.train.stepz=3", "base \\(base.config \\+ base.overrides\\): unknown config key 'train.stepz'"),
    ],
)
def test_base_config_errors_name_the_spec_key(override, match):
    """(were "config file not found: <path>" and "unknown config key 'train.stepz'", which
    do not say that the spec's `base` is where to look)"""
    spec, spec_dir = load_spec(TINY, [override])
    with pytest.raises(SpecError, match=match):
        generate_points(spec, spec_dir)


def test_exit_status_judges_the_points_only_selects(tmp_path, fake_train, capsys):
    """A run with --only that finished its points exits 0, though other points are pending or
    failed in the store (it exited 1 because of rows it was not asked to train)."""
    out = tmp_path / "out"
    fake_train({"C3e9-L1-s0": "fail"})
    base = ["--config", str(TINY), "--out", str(out), SYNTHETIC]
    assert main([*base, "--only", "C3e9-L1-s0"]) == 1  # the point asked for failed
    assert main([*base, "--only", "C1.5e9-*"]) == 0  # its points are done; C3e9-L1-s0 failed, C3e9-L2-s0 pending
    rows = _rows(out)
    assert rows["C3e9-L1-s0"]["status"] == "failed" and rows["C1.5e9-L1-s0"]["status"] == "done"
    assert main(base) == 1  # the whole spec: one failed point
    capsys.readouterr()
