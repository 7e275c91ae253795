"""experiments/bench_sample.py and check_sample_kernel.py on the CPU (interpret mode): the table's
rows hold both samplers' times and agree on every token; bad variants are refused by name."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_sample as bs  # noqa: E402


def test_variants_parse_and_refuse_bad_keys():
    assert bs.parse_variants("auto:,one:splits=1/chunk=4096") == {"auto": {}, "one": {"splits": 1, "chunk": 4096}}
    with pytest.raises(SystemExit, match="'warps=4' in 'w:warps=4' is not key=int"):
        bs.parse_variants("w:warps=4")
    with pytest.raises(SystemExit, match="'splits=x'"):
        bs.parse_variants("s:splits=x")


def test_a_small_table_agrees_token_for_token(tmp_path):
    bs.main(["--vocab", "300", "--batches", "2", "--scales", "1", "--specs", "top_k=50",
             "--variants", "one:,three:splits=3/chunk=64", "--draws", "3", "--reps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_sample.json").read_text())["rows"]
    assert [(r["spec"], r["variant"]) for r in rows] == [("top_k=50", "one"), ("top_k=50", "three")]
    assert all(r["rows_differ"] == 0 and r["rows"] == 6 and r["xla_us"] > 0 and r["pallas_us"] > 0 for r in rows)
    assert "| 2 | 1 | top_k=50 | three {'splits': 3, 'chunk': 64} |" in (tmp_path / "bench_sample.md").read_text()


def test_unknown_spec_is_refused():
    with pytest.raises(SystemExit, match="--specs: 'top_q' is not one of"):
        bs.main(["--specs", "top_q"])
