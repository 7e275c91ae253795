"""experiments/bench_train.py: configurations, variants, the plan's order, the budget, and a CPU
smoke run of the whole script (a variant, a chunked-loss variant and a profile)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_train", ROOT / "experiments" / "bench_train.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_train"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_parse_configs_and_variants():
    cfgs = bench.parse_configs("1b:2048:8, 350m:4096:8")
    assert [c.key for c in cfgs] == ["1b:2048:8", "350m:4096:8"]
    for bad in ("1b:2048", "1b:x:8", "nosuchmodel:128:2", ""):
        with pytest.raises(ValueError):
            bench.parse_configs(bad)
    allv = bench.parse_variants("all")
    assert len(allv) == 30 and len(set(allv)) == 30
    assert bench.parse_variants("") == []
    with pytest.raises(ValueError, match="remat"):
        bench.parse_variants("cudnn/sometimes/scan")
    with pytest.raises(ValueError, match="section.key=value"):
        bench.parse_variants("cudnn/none/scan/loss_chunk")
    ov = bench.variant_overrides("pallas/names/unrolled/train.loss_chunk=256", ["query_proj", "out_proj"])
    assert ov == ["--attention.impl=pallas", "--remat.policy=names", "--model.scan_layers=false",
                  "--remat.names=[query_proj, out_proj]", "--train.loss_chunk=256"]
    assert bench.safe_name("1b:2048:8") == "1b-2048-8" and bench.safe_name("a/b=c.d") == "a-b-c.d"


def test_plan_puts_headlines_first():
    a, b = bench.parse_configs("1b:2048:8,350m:4096:8")
    plan = bench.make_plan([a, b], ["v1/x", "v2/x", "v3/x"], ["w1/x", "w2/x"], torch=True, matmul=True,
                           profile_variants=["v1/x"])
    got = [(p.spec, p.config.key if p.config else None) for p in plan]
    assert got == [
        ("matmul", None),
        ("v1/x", a.key), ("torch-compiled", a.key), ("w1/x", b.key), ("torch-compiled", b.key),
        ("profile:v1/x", a.key),
        ("torch-eager", a.key), ("v2/x", a.key), ("v3/x", a.key), ("torch-eager", b.key),
        ("w2/x", b.key),
    ]
    assert [p.kind for p in plan[:2]] == ["matmul", "jax"] and plan[5].kind == "profile"


def test_budget_skips_what_does_not_fit(capsys):
    """Pieces whose estimate exceeds what is left are reported as skipped; later cheap ones still run."""
    (c,) = bench.parse_configs("1b:2048:8")
    plan = bench.make_plan([c], ["v1/a/scan", "v2/a/scan", "v3/a/scan"], [], torch=True, matmul=True)
    durations = {"matmul": 10, "v1/a/scan": 30, "torch-compiled": 70, "torch-eager": 20, "v2/a/scan": 30, "v3/a/scan": 30}
    now = [0.0]
    ran = []

    def runner(args, piece, timeout):
        ran.append((piece.spec, timeout))
        now[0] += durations[piece.spec]
        return {"tokens_per_sec": 1.0, "step_time_ms": 1.0, "tflops": 1.0, "peak_mem_gib": 1.0, "compile_s": 1.0, "loss0": 1.0}

    args = SimpleNamespace(budget_s=150, steps=8, warmup=2, profile_steps=3, timeout=240, keep_trace=True)
    res = bench.run_plan(plan, args, t_start=0.0, runner=runner, clock=lambda: now[0])
    by = {r["variant"]: r for r in res}
    # matmul 10 + v1 30 + compiled 70 = 110; eager's prior fits in 40 s left, then v2 (est 30 s, from
    # v1) does not fit in 20 s, and v3 neither.
    assert [s for s, _ in ran] == ["matmul", "v1/a/scan", "torch-compiled", "torch-eager"]
    assert "skipped" in by["v2/a/scan"] and "skipped" in by["v3/a/scan"]
    assert by["v2/a/scan"]["estimate_s"] == 30
    assert by["v1/a/scan"]["wall_s"] == 30
    assert ran[-1][1] == 40  # each piece is cut at what is left of the budget
    report = bench.format_report(res, [c], {"date": "d", "steps": 8, "warmup": 2, "accum": 1, "budget_s": 150, "elapsed_s": 130})
    assert "| v2/a/scan | skipped: budget" in report


def test_cpu_smoke(tmp_path):
    """One piece (subprocesses compile on CPU slowly): a profiled chunked-loss variant."""
    out = tmp_path / "out"
    variant = "xla/none/scan/train.loss_chunk=8"
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_train.py"), "--configs", "tiny:32:4", "--variants", "",
           "--profile-variant", variant, "--steps", "2", "--warmup", "1", "--profile-steps", "2", "--out", str(out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "bench_train.json").read_text())
    (r,) = data["results"]  # no torch, no matmul on CPU
    assert r["variant"] == f"profile:{variant}" and "error" not in r and "skipped" not in r, r
    assert r["tokens_per_sec"] > 0 and r["wall_s"] > 0 and r["loss0"] == pytest.approx(6.93, abs=0.05)  # ~ln(1024)
    stem = "profile_tiny-32-4_xla-none-scan-train.loss_chunk-8"
    assert sorted(os.listdir(out)) == sorted(["bench_train.md", "bench_train.json", f"{stem}.md", f"{stem}.json",
                                              f"{stem}.perfetto.json.gz", f"{stem}.hlo.txt.gz"])
    summary = json.loads((out / f"{stem}.json").read_text())
    assert summary["steps"] == 2 and summary["categories"]["matmul"]["us"] > 0
    assert "| matmul |" in (out / f"{stem}.md").read_text()
    assert "| tiny:32:4 | xla/none/scan/train.loss_chunk=8 |" in (out / "bench_train.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--seq", "0"], "configuration '1b:0:8': seq and batch must be >= 1"),  # (0 was taken for "not given")
    (["--batch", "0"], "configuration '1b:2048:0': seq and batch must be >= 1"),
    (["--configs", "1b:2048:8", "--model", "350m"], "give --configs or --model/--seq/--batch, not both"),
    (["--configs", "tiny:32:4, tiny:32:4"], "configuration 'tiny:32:4' given twice"),
    (["--configs", "nosuch:32:4"], "no preset configs/models/nosuch.yaml; allowed: 125m, 1b, 25m"),
    (["--warmup", "0"], "--warmup must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--profile-steps", "0"], "--profile-steps must be >= 1, got 0"),
    (["--accum", "0"], "--accum must be >= 1, got 0"),
    (["--timeout", "0"], "--timeout must be >= 1, got 0"),
    (["--configs", "tiny:32:4", "--accum", "3"], "--accum 3 does not divide the batch of configuration tiny:32:4"),
    (["--budget-s", "0"], "--budget-s must be a finite number > 0, got 0.0"),
    (["--budget-s", "nan"], "--budget-s must be a finite number > 0, got nan"),
    (["--profile-config", "tiny:32:4"], "--profile-config names the configuration of --profile-variant"),
    (["--variants", "cudnn/sometimes/scan"], "remat must be one of ('none', 'full', 'dots', 'selective', 'names', "
                                             "'offload')"),
    (["--variants", "flash/none/scan"], "attention must be one of ('xla', 'cudnn', 'pallas', 'auto')"),
    (["--configs", "tiny:32:4", "--variants", "", "--no-torch", "--no-matmul"], "nothing to run"),
])
def test_cli_refuses_bad_flags_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv + ["--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_refuses_an_output_folder_it_cannot_write_before_running(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(bench, "run_plan", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--configs", "tiny:32:4", "--variants", "xla/none/scan", "--no-torch", "--out",
                    str(tmp_path / "file")])
    assert e.value.code == 2 and f"--out {str(tmp_path / 'file')!r} is not a folder" in capsys.readouterr().err


def test_results_json_is_strict_and_skipped_profiles_read_so(tmp_path, monkeypatch):
    """A diverged variant's NaN loss is null in bench_train.json (JSON has no NaN); a profile the
    budget skipped says 'skipped' and shows no wall time."""
    res = {"tokens_per_sec": 100.0, "step_time_ms": 10.0, "tflops": 1.0, "peak_mem_gib": 1.0, "compile_s": 1.0,
           "loss0": float("nan"), "loss": float("inf")}
    monkeypatch.setattr(bench, "run_piece", lambda args, piece, timeout: dict(res))
    assert bench.main(["--configs", "tiny:32:4", "--variants", "xla/none/scan", "--no-torch", "--no-matmul",
                       "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_train.json").read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    (r,) = data["results"]
    assert r["loss0"] is None and r["loss"] is None and r["tokens_per_sec"] == 100.0
    assert "| xla/none/scan | 100 | 10.0 |" in (tmp_path / "bench_train.md").read_text()
    (c,) = bench.parse_configs("tiny:32:4")
    skipped = {"variant": "profile:xla/none/scan", "config": c.key, "kind": "profile", "skipped": "budget (needs ~60 s)"}
    report = bench.format_report([skipped], [c], {"date": "d", "steps": 8, "warmup": 2, "accum": 1, "budget_s": 1,
                                                  "elapsed_s": 1})
    assert "| tiny:32:4 | xla/none/scan | skipped: budget (needs ~60 s) | | | |  |" in report
