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
