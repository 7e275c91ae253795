"""Sweep specs, point generation, the results store, and the runner end to end.

The end-to-end tests start real training processes (each pays JAX start-up and a compile,
~10-30 s on a laptop), so there are few of them: one runner killed mid-sweep and resumed
(which is also the end-to-end run, with one point made to fail), and one point through
submitit's local executor.
"""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaling import accounting
from scaling.sweep import (
    COLUMNS,
    PowerRule,
    ResultStore,
    SpecError,
    _fmt,
    generate_points,
    load_spec,
    main,
    schedule_seconds,
    spec_from_dict,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "sweeps" / "tiny_cpu.yaml"
GPU = ROOT / "configs" / "sweeps" / "isoflop_gpu.yaml"
FAILING = "C3e9-L2-s0"


def _spec(**delta):
    data = {"base": {"config": str(ROOT / "configs" / "tiny_corpus.yaml")}, "depths": [1, 2], "isoflop": {"budgets": [1e9]}}
    data.update(delta)
    return data


# ------------------------------------------------------------------------ spec


def test_tiny_spec_loads():
    spec, spec_dir = load_spec(TINY)
    assert spec.name == "tiny_cpu" and spec.depths == (1, 2) and spec.isoflop.budgets == (1.5e9, 3e9)
    assert spec_dir == TINY.parent


def test_gpu_spec_is_three_budgets_by_five_sizes():
    spec, spec_dir = load_spec(GPU)
    points, _ = generate_points(spec, spec_dir)
    assert len(spec.isoflop.budgets) >= 3 and len(spec.depths) >= 5
    assert len(points) == len(spec.isoflop.budgets) * len(spec.depths)
    assert all(p.error is None for p in points)
    cfg = points[0].cfg
    assert cfg.data.source.value == "text" and cfg.data.tokenizer.value == "bpe" and cfg.model.compute_dtype.value == "auto"


@pytest.mark.parametrize(
    "delta, match",
    [
        ({"depth": [1]}, "unknown sweep spec key 'depth'"),
        ({"family": {"aspct": 3}}, "unknown sweep spec key 'family.aspct'.*aspect"),
        ({"isoflop": {"budgets": ["lots"]}}, "isoflop.budgets.0"),
        ({"grid": {"tokens": [1e6]}}, "exactly one of `grid`"),
        ({"isoflop": None}, "exactly one of `grid`"),
        ({"depths": []}, "depths"),
        ({"hparams": {"learning_rate": {"base": -1.0}}}, "hparams.learning_rate"),
        ({"hparams": {"batch_size": {"base": 8, "of": "width"}}}, "hparams.batch_size.of"),
        ({"hparams": {"warmup_fraction": 1.5}}, "hparams.warmup_fraction"),
        ({"estimate": {"hardware": "h300"}}, "estimate.hardware: unknown hardware 'h300'; allowed: h100, h200"),
        # An enum value: the message lists the allowed ones (draccus said "KeyError: 'width'").
        ({"hparams": {"batch_size": {"base": 8, "of": "width"}}}, "hparams.batch_size.of: unknown value 'width'; allowed: params, tokens, flops"),
        # Two points with one id would train in one run dir at once (and share a store row).
        ({"seeds": [0, 0]}, "seeds: has duplicates"),
        ({"isoflop": {"budgets": [1e9, 1e9]}}, "isoflop.budgets: .*same point id prefix C1e9"),
        ({"isoflop": {"budgets": [1e9, 1.001e9]}}, "isoflop.budgets: .*same point id prefix C1e9"),
        ({"isoflop": None, "grid": {"tokens": [4096, 4100]}}, "grid.tokens: .*same point id prefix D4.1e3"),
        # Clamps that cannot hold: a batch of max -5 used to become 1 sequence, silently.
        ({"hparams": {"batch_size": {"base": 8, "max": -5}}}, "hparams.batch_size.max: must be positive"),
        ({"hparams": {"learning_rate": {"base": 1e-3, "min": 1e-2, "max": 1e-3}}}, "hparams.learning_rate: min must be <= max"),
        # Batches are whole multiples of multiple_of: a max below it gave batches above max.
        ({"hparams": {"batch_size": {"base": 8, "multiple_of": 8, "max": 4}}},
         "hparams.batch_size: batches are whole multiples of multiple_of=8 \\(at least one\\), and none lies within max=4$"),
        ({"hparams": {"batch_size": {"base": 8, "multiple_of": 8, "min": 9, "max": 15}}},
         "hparams.batch_size: .*multiple_of=8 .*none lies within min=9, max=15$"),
        ({"estimate": {"mfu": 2.0}}, "estimate.mfu: must be a fraction of peak in \\(0, 1\\]"),
        ({"estimate": {"startup_s": -5.0}}, "estimate.startup_s: must be >= 0"),  # negative predicted times
        ({"estimate": {"step_overhead_s": -0.1}}, "estimate.step_overhead_s: must be >= 0"),
        ({"name": "a/b"}, "name: 'a/b' must be letters, digits"),  # made nested output folders
        ({"name": ".."}, "name: '..' must be letters, digits"),
    ],
)
def test_spec_errors_name_the_key(delta, match):
    with pytest.raises(SpecError, match=match):
        spec_from_dict(_spec(**delta))


def test_family_errors_name_the_key(tmp_path):
    spec = spec_from_dict(_spec(family={"aspect": 24, "head_dim": 16}))
    with pytest.raises(SpecError, match="family.head_dim"):
        generate_points(spec, tmp_path)
    spec = spec_from_dict(_spec(family={"aspect": 32, "head_dim": 16, "kv_ratio": 3}))
    with pytest.raises(SpecError, match="family.kv_ratio"):
        generate_points(spec, tmp_path)


def test_cli_errors(capsys):
    from scaling.__main__ import main as cli

    assert cli(["sweep", "--config", str(TINY), "--dry-run", "--famly.aspect=3"]) == 2
    assert "famly" in capsys.readouterr().err
    assert cli(["sweep", "--config", "nope.yaml", "--dry-run"]) == 2


def test_cli_flag_errors(capsys):
    # --workers 0 used to be accepted (and run one point at a time while the dry run said 0).
    for workers in ("0", "-2"):
        with pytest.raises(SystemExit) as exc:
            main(["--config", str(TINY), "--dry-run", "--workers", workers])
        assert exc.value.code == 2 and "--workers must be >= 1" in capsys.readouterr().err
    # A glob that matches no point used to run nothing and exit 0; the message lists the ids.
    assert main(["--config", str(TINY), "--dry-run", "--only", "C3e9-L1-s0", "--only", "C3e9-L9-*"]) == 2
    err = capsys.readouterr().err
    assert "--only C3e9-L9-* matches no point" in err and "C1.5e9-L1-s0, C1.5e9-L2-s0, C3e9-L1-s0, C3e9-L2-s0" in err
    assert main(["--config", str(TINY), "--dry-run", "--only", "C3e9-*"]) == 0
    out = capsys.readouterr().out
    assert "C3e9-L1-s0" in out and "C1.5e9-L1-s0" not in out and "2 points" in out


# ------------------------------------------------------------------------ points


def test_isoflop_tokens_match_budget():
    spec, spec_dir = load_spec(TINY)
    points, dropped = generate_points(spec, spec_dir)
    assert [p.id for p in points] == ["C1.5e9-L1-s0", "C1.5e9-L2-s0", "C3e9-L1-s0", "C3e9-L2-s0"] and not dropped
    for p in points:
        m, t = p.cfg.model, p.cfg.train
        fpt = accounting.flops_per_token(m, t.seq_len).total
        assert p.n_params == accounting.param_count(m)
        assert p.flops_per_token == fpt
        assert p.tokens == t.steps * t.batch_size * t.seq_len
        assert t.steps == round(p.target / fpt / (t.batch_size * t.seq_len))
        assert p.flops == p.tokens * fpt  # the C actually used ...
        assert abs(p.flops - p.target) <= fpt * t.batch_size * t.seq_len / 2  # ... within half a step of the budget
        assert m.hidden_size == 32 * m.num_layers and m.resolved_head_dim == 16 and m.num_heads == 2 * m.num_kv_heads
        assert m.mlp_dim % 32 == 0 and m.mlp_dim >= 8 / 3 * m.hidden_size
        assert p.cfg.optimizer.learning_rate == pytest.approx(3e-3 * (p.n_params / 1e5) ** -0.25)
        assert p.cfg.optimizer.warmup_steps == round(0.2 * t.steps)


def test_grid_rules_seeds_and_point_overrides(tmp_path):
    spec = spec_from_dict(
        _spec(
            isoflop=None,
            grid={"tokens": [4096, 8192]},
            seeds=[0, 1],
            hparams={"batch_size": {"base": 4, "ref": 4096, "exponent": 1.0, "of": "tokens", "multiple_of": 4, "max": 8}},
            point_overrides={"D8.19e3-L2-*": {"optimizer": {"learning_rate": 1e-4}}, "D4.1e3-L1-s1": {"model": {"num_kv_heads": 3}}},
        )
    )
    points, _ = generate_points(spec, tmp_path)
    by_id = {p.id: p for p in points}
    assert len(points) == 8 and set(by_id) >= {"D4.1e3-L1-s0", "D8.19e3-L2-s1"}
    assert by_id["D4.1e3-L1-s0"].cfg.train.batch_size == 4 and by_id["D8.19e3-L1-s0"].cfg.train.batch_size == 8
    assert by_id["D8.19e3-L2-s1"].cfg.optimizer.learning_rate == 1e-4 and by_id["D8.19e3-L2-s1"].cfg.train.seed == 1
    assert by_id["D8.19e3-L1-s1"].cfg.optimizer.learning_rate != 1e-4
    bad = by_id["D4.1e3-L1-s1"]  # an impossible override fails that point only
    assert bad.error is not None and "num_kv_heads" in bad.error
    assert all(p.error is None for p in points if p is not bad)


def test_isoflop_min_steps_drops_points():
    spec, spec_dir = load_spec(TINY, ["--isoflop.min_steps=10"])
    points, dropped = generate_points(spec, spec_dir)
    assert "C1.5e9-L2-s0" not in {p.id for p in points} and any(d.startswith("C1.5e9-L2-s0") for d in dropped)


def test_run_with_every_point_dropped_is_an_error(tmp_path, capsys):
    # It ran nothing, wrote an empty store and exited 0, as if the sweep had finished.
    out = tmp_path / "o"
    assert main(["--config", str(TINY), "--out", str(out), "--isoflop.min_steps=1000"]) == 2
    err = capsys.readouterr().err
    assert "every point of the sweep was dropped for too few steps (4, e.g. C1.5e9-L1-s0" in err and "min_steps=1000" in err
    assert not (out / "results.sqlite").exists()


def test_helpers():
    assert [_fmt(x) for x in (1e15, 3e14, 2.5e9, 4096)] == ["1e15", "3e14", "2.5e9", "4.1e3"]
    rule = PowerRule(base=8, ref=2, exponent=1, multiple_of=8)
    assert (rule.integer(6), rule.integer(1)) == (24, 8)  # 24; 4 rounds up to one multiple
    # Rounding to a multiple stays within the clamps: 12 rounded up to 16 past max=12, and
    # 10 down to 8 below min=10.
    assert PowerRule(base=12, multiple_of=8, max=12).integer(1) == 8
    assert PowerRule(base=10, multiple_of=8, min=10).integer(1) == 16
    assert schedule_seconds([3, 1, 1, 1], 2) == 3 and schedule_seconds([1, 1], 1) == 2


def test_dry_run(capsys):
    assert main(["--config", str(TINY), "--dry-run", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "C3e9-L2-s0" in out and "--tokens-per-sec 20,000 (given)" in out and "with --workers 2" in out
    assert main(["--config", str(GPU), "--dry-run", "--mfu", "0.05"]) == 0
    assert "MFU 5% of NVIDIA H100 SXM" in capsys.readouterr().out


def test_store_is_wal_and_keeps_rows(tmp_path):
    spec, spec_dir = load_spec(TINY)
    points, _ = generate_points(spec, spec_dir)
    store = ResultStore(tmp_path / "results.sqlite")
    store.add("s", points[0], "x")
    store.add("s", points[0], "x")  # idempotent
    store.update(points[0].id, status="done", final_loss=1.5)
    store.close()
    db = sqlite3.connect(tmp_path / "results.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    rows = db.execute("SELECT n_params, tokens, flops, final_loss, eval_loss, status FROM points").fetchall()
    assert rows == [(points[0].n_params, points[0].tokens, points[0].flops, 1.5, None, "done")]


# ------------------------------------------------------------------------ end to end


def _env():
    """The children see one CPU device (conftest simulates 8 for this process)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _rows(out: Path) -> dict[str, dict]:
    db = sqlite3.connect(out / "results.sqlite", timeout=30)
    db.row_factory = sqlite3.Row
    try:
        return {r["id"]: dict(r) for r in db.execute("SELECT * FROM points")}
    except sqlite3.OperationalError:  # not created yet
        return {}
    finally:
        db.close()


def _has_checkpoint(run_dir: Path) -> bool:
    d = run_dir / "checkpoints"
    return d.exists() and any(p.name.isdigit() for p in d.iterdir())


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, corpus_cache):
    """Run tiny_cpu (one point made to fail) with 2 workers; SIGKILL the runner once a
    point has finished and the other has a checkpoint; then run it again to completion."""
    out = tmp_path_factory.mktemp("sweep")
    args = [
        "--config", str(TINY), "--out", str(out), "--workers", "2",
        f"--base.overrides.data.cache_dir={corpus_cache}",
        f"--point_overrides.{FAILING}.data.source=tokens",
        f"--point_overrides.{FAILING}.data.path={out}/no-such-tokens.npy",
    ]  # fmt: skip
    log = open(out / "runner.log", "wb")  # a file, not a pipe nobody drains
    runner = subprocess.Popen([sys.executable, "-m", "scaling", "sweep", *args], env=_env(), cwd=ROOT, stdout=log, stderr=log)
    deadline = time.monotonic() + 900  # generous: the machine may be shared
    checkpointed: set[str] = set()
    while time.monotonic() < deadline and runner.poll() is None:
        rows = _rows(out)
        done = [r for r in rows.values() if r["status"] == "done"]
        running = [r for r in rows.values() if r["status"] == "running"]
        checkpointed = {r["id"] for r in running if _has_checkpoint(Path(r["run_dir"]))}
        if done and (checkpointed or len(done) >= 2):
            break
        time.sleep(0.05)
    assert runner.poll() is None, f"the runner ended early: {(out / 'runner.log').read_text()[-2000:]}"
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    before = _rows(out)
    t0 = time.monotonic()
    env = _env()
    old = os.environ.copy()
    os.environ.update(env)
    try:
        rc = main(args)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return out, before, checkpointed, rc, time.monotonic() - t0


def test_resume_skips_finished_points(killed_and_resumed):
    out, before, checkpointed, rc, _ = killed_and_resumed
    after = _rows(out)
    finished = [pid for pid, r in before.items() if r["status"] == "done"]
    assert finished
    for pid in finished:  # not run again
        assert after[pid]["attempts"] == 1 and after[pid]["final_loss"] == before[pid]["final_loss"]
        assert (out / "points" / pid / "stdout.log").read_text().count("run directory:") == 1
    for pid in checkpointed:  # interrupted mid-run: resumed from its checkpoint
        assert after[pid]["attempts"] == 2 and after[pid]["status"] == "done"
        assert "resuming from checkpoint" in (out / "points" / pid / "stdout.log").read_text()


def test_sweep_end_to_end_results(killed_and_resumed):
    out, _, _, rc, _ = killed_and_resumed
    assert rc == 1  # one point failed on purpose
    rows = _rows(out)
    spec, spec_dir = load_spec(TINY)
    points, _ = generate_points(spec, spec_dir)
    assert set(rows) == {p.id for p in points}
    for p in points:
        if p.id == FAILING:
            continue
        r = rows[p.id]
        assert r["status"] == "done", r["error"]
        assert (r["n_params"], r["tokens"]) == (p.n_params, p.tokens) and r["flops"] == pytest.approx(p.flops)
        assert math.isfinite(r["final_loss"]) and math.isfinite(r["eval_loss"]) and r["wall_time"] > 0
        assert r["last_step"] == p.steps and r["error"] is None


def test_failing_point_recorded_with_its_error(killed_and_resumed):
    out, *_ = killed_and_resumed
    r = _rows(out)[FAILING]
    assert r["status"] == "failed" and "no-such-tokens.npy" in r["error"] and "exit status 2" in r["error"]


def test_submitit_local_executor_runs_a_point(tmp_path, corpus_cache, monkeypatch):
    for k, v in _env().items():
        monkeypatch.setenv(k, v)
    pid = "C1.5e9-L2-s0"
    rc = main([
        "--config", str(TINY), "--out", str(tmp_path), "--executor", "submitit", "--cluster", "local",
        "--only", pid, f"--base.overrides.data.cache_dir={corpus_cache}",
    ])  # fmt: skip
    r = _rows(tmp_path)[pid]
    assert rc == 0 and r["status"] == "done", r["error"]
    assert math.isfinite(r["eval_loss"]) and (tmp_path / "submitit").is_dir()
    assert not r["job_id"].isdigit() or int(r["job_id"]) > 0


def test_base_overrides_errors_name_the_spec_file(tmp_path, capsys):
    """A bad key in base.overrides was reported without the spec file's path."""
    from scaling.__main__ import main as cli

    spec = tmp_path / "bad.yaml"
    spec.write_text(f"base: {{config: {ROOT / 'configs' / 'tiny_corpus.yaml'}, overrides: {{train: {{bogus: 1}}}}}}\n"
                    "depths: [1]\nisoflop: {budgets: [1.0e+9]}\n")
    assert cli(["sweep", "--config", str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{spec}: base (base.config + base.overrides): unknown config key 'train.bogus'" in err
    # The same through a command-line override, and for a real run (which stops before writing).
    out = tmp_path / "out"
    assert cli(["sweep", "--config", str(TINY), "--out", str(out), "--base.overrides.train.stepz=3"]) == 2
    assert f"{TINY}: base (base.config + base.overrides): unknown config key 'train.stepz'" in capsys.readouterr().err
    assert not out.exists()


def test_dry_run_leaves_an_existing_store_untouched(tmp_path, capsys):
    """--dry-run opened the store as the runner does: it switched the journal mode and added
    the columns an older runner's store lacks. A dry run writes nothing."""
    out = tmp_path / "sweep"
    out.mkdir()
    spec, spec_dir = load_spec(TINY)
    points, _ = generate_points(spec, spec_dir)
    older = [c for c in COLUMNS if c not in ("n_params_nonembedding", "target")]  # before they existed
    db = sqlite3.connect(out / "results.sqlite")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"CREATE TABLE points ({', '.join(f'{c} {COLUMNS[c]}' for c in older)})")
    p = points[0]
    db.execute("INSERT INTO points (id, n_params, tokens, flops, status, last_step, run_dir, config_hash) VALUES (?,?,?,?,?,?,?,?)",
               (p.id, p.n_params, p.tokens, p.flops, "done", p.steps, str(out / "points" / p.id), p.config_hash))
    db.commit()
    db.close()
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert main(["--config", str(TINY), "--dry-run", "--out", str(out)]) == 0
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # same files, same bytes
    text = capsys.readouterr().out
    assert next(line for line in text.splitlines() if line.startswith(p.id)).endswith("  done")
    assert f"predicted time for the {len(points) - 1} points left" in text


def test_spec_yaml_errors_are_named(tmp_path):
    """A key repeated in a spec (the last one won silently) and a YAML syntax error (a traceback)."""
    (tmp_path / "dup.yaml").write_text("name: a\nseeds: [0]\nname: b\n")
    with pytest.raises(SpecError, match="key 'name' repeated \\(first at line 1\\)"):
        load_spec(tmp_path / "dup.yaml")
    (tmp_path / "bad.yaml").write_text("name: [a\n")
    with pytest.raises(SpecError, match="bad.yaml: not valid YAML"):
        load_spec(tmp_path / "bad.yaml")


def test_dry_run_counts_only_points_a_run_would_train(tmp_path, capsys):
    """An invalid point (its point_overrides break its config) never runs, so it is not among
    the points left in the predicted time (was: counted, 4 of 4)."""
    bad = '--point_overrides={"C3e9-L2-*": {train: {grad_accum: 3}}}'  # batch 8 is not divisible by 3
    assert main(["--config", str(TINY), "--dry-run", "--out", str(tmp_path / "none"), bad]) == 0
    out = capsys.readouterr().out
    assert "invalid: point_overrides make an invalid config" in out
    assert "predicted time for the 3 points left" in out


def test_dry_run_flags_points_the_runner_would_refuse(tmp_path, capsys):
    """A point that trained with another config: the runner refuses to start (use a new --out);
    the dry run said `done` and nothing else, so it promised a run that would not happen."""
    from scaling.sweep import SweepError, run_sweep

    out = tmp_path / "sweep"
    spec, spec_dir = load_spec(TINY)
    points, _ = generate_points(spec, spec_dir)
    store = ResultStore(out / "results.sqlite")
    for p in points:
        store.add(spec.name, p, str(out / "points" / p.id))
    store.update(points[0].id, status="done", last_step=points[0].steps, final_loss=3.0)
    store.close()
    moved = f"--base.overrides.data.cache_dir={tmp_path / 'cache'}"  # changes every point's config
    assert main(["--config", str(TINY), "--dry-run", "--out", str(out), moved]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith(points[0].id))
    assert row.endswith("done; trained with another config: the run refuses it")
    assert f"1 point(s) already trained with another config ({points[0].id}): the run will refuse" in text
    assert f"predicted time for the {len(points) - 1} points left" in text
    # ... which is what the runner does, before any point starts.
    spec2, _ = load_spec(TINY, [moved])
    with pytest.raises(SweepError, match=f"changed the config of points that already ran: {points[0].id};"):
        run_sweep(spec2, spec_dir, out, log=lambda msg: None)
    # Unchanged config: the same store is fine, the done point is simply done.
    assert main(["--config", str(TINY), "--dry-run", "--out", str(out)]) == 0
    assert "another config" not in capsys.readouterr().out
