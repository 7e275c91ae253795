"""experiments/bench_train_loop.py: one real (tiny) comparison of a tree with itself on the CPU,
read back from the runs' metrics.jsonl; bad arguments refused by name."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import bench_train_loop as b  # noqa: E402


def test_a_tree_against_itself(tmp_path, monkeypatch):
    monkeypatch.setitem(b.DEFAULT_CONFIGS, "tiny b16 s128", (
        "configs/models/tiny.yaml", ["--train.batch_size=8", "--train.seq_len=16", "--train.steps=6",
                                     "--train.log_every=2", "--model.num_layers=1"]))
    assert b.main(["--trees", f"a={ROOT},b={ROOT}", "--configs", "tiny b16 s128", "--rounds", "1",
                   "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_train_loop.json").read_text())["tiny b16 s128"]
    for tree in ("a", "b"):
        (run,) = results[tree]
        assert "error" not in run, run.get("error")
        assert run["records"] == 2 and run["tokens_per_sec"] > 0  # the log records after the first (steps 4, 6)
    assert "| tiny b16 s128 |" in (tmp_path / "bench_train_loop.md").read_text()


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(SystemExit):
        b.main(["--trees", "a=.", "--configs", "huge"])
    with pytest.raises(SystemExit):
        b.main(["--trees", "a=.", "--rounds", "0"])


def _stub_runs(monkeypatch, rates):
    """run_once answering the given tokens/s in call order (no training)."""
    it = iter(rates)
    monkeypatch.setattr(b, "run_once", lambda tree, config, overrides, timeout: {"tokens_per_sec": next(it)})


@pytest.mark.parametrize("argv, message", [
    (["--trees", "a"], "--trees: 'a' is not name=path"),
    (["--trees", f"a={ROOT},a={ROOT}"], "--trees: the name 'a' is given twice"),  # (one would vanish from the dict)
    (["--trees", "a=/nonexistent"], "--trees: a=/nonexistent is not a source tree"),
    (["--trees", f"a={ROOT}", "--timeout", "0"], "--timeout must be >= 1, got 0"),
    (["--trees", f"a={ROOT}", "--configs", "tiny b16 s128, huge"], "--configs: unknown ['huge']; allowed"),
])
def test_bad_arguments_exit_2_with_the_flag_named(argv, message, capsys, monkeypatch, tmp_path):
    _stub_runs(monkeypatch, [1.0] * 8)
    with pytest.raises(SystemExit) as e:
        b.main(["--configs", "tiny b16 s128", "--rounds", "1", "--out", str(tmp_path)] + argv)  # (argv's flags win)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_out_must_be_a_folder_before_any_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(b, "run_once", lambda *a: pytest.fail("ran"))
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        b.main(["--trees", f"a={ROOT}", "--configs", "tiny b16 s128", "--out", str(tmp_path / "file")])
    assert e.value.code == 2 and "is not a folder" in capsys.readouterr().err


def test_table_columns_and_ratio(tmp_path, monkeypatch):
    """The ratio is each tree's median tokens/s over the first tree's; one tree is a table of
    its own column (no ratio column, the separator as wide as the header)."""
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]
    # round 0 runs a then b, round 1 b then a: a 100, 300 (median 200); b 250, 260 (median 255)
    _stub_runs(monkeypatch, [100.0, 250.0, 260.0, 300.0])
    assert b.main(["--trees", f"a={ROOT}, b={ROOT}", "--configs", "tiny b16 s128", "--rounds", "2",
                   "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "bench_train_loop.md").read_text().splitlines()
    assert [len(cells(l)) for l in lines] == [4, 4, 4]
    assert cells(lines[0]) == ["config", "a tokens/s", "b tokens/s", "b / a"]
    assert cells(lines[2]) == ["tiny b16 s128", "100, 300", "250, 260", f"{255 / 200:.3f}"]
    _stub_runs(monkeypatch, [120.0])
    assert b.main(["--trees", f"a={ROOT}", "--configs", "tiny b16 s128", "--rounds", "1", "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "bench_train_loop.md").read_text().splitlines()
    assert [cells(l) for l in lines] == [["config", "a tokens/s"], ["---"] * 2, ["tiny b16 s128", "120"]]


def test_a_run_that_times_out_or_logs_too_little_is_a_row_not_a_crash(monkeypatch, tmp_path):
    import subprocess

    def timeout(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(b.subprocess, "run", timeout)
    r = b.run_once(ROOT, "configs/models/tiny.yaml", [], 7)
    assert r["error"] == "timed out after 7 s"

    def one_record(cmd, **kw):  # a run whose only log record is the first (compile included)
        run_dir = Path(next(a for a in cmd if a.startswith("--run_dir=")).split("=", 1)[1])
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "tokens_per_sec": 5.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(b.subprocess, "run", one_record)
    r = b.run_once(ROOT, "configs/models/tiny.yaml", [], 7)
    assert r["error"].startswith("1 log records: no rate after the first")
