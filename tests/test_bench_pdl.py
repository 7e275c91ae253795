"""experiments/bench_pdl.py (PDL for a chain of Mosaic GPU decode kernels): on the CPU its chain
runs in Pallas' GPU interpret mode (which leaves out the griddepcontrol instructions; the PDL
variant's lowering is tested in test_decode_tma.py) and must equal the XLA chain; the table
renders; a bad --settings value is refused by name."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_pdl as b  # noqa: E402


def test_chain_matches_xla_and_the_table_renders():
    row = b.measure(d=256, layers=2, passes=1, reps=1, warmup=0)
    assert row["pdl_equals_no_pdl"]  # here the same program twice (interpret mode drops PDL): the field's plumbing
    assert row["rel_err_vs_xla_first_layer"] < 1e-2  # bf16 outputs, f32 products on both sides
    row.update(setting="default", pct_bw_pdl_False=50.0, pct_bw_pdl_True=60.0)
    md = b.table([row])
    assert "| default | 256 |" in md and md.count("\n") == 2


def test_unknown_setting_is_refused():
    with pytest.raises(SystemExit, match="unknown 'fast'.*'default', 'xla_pdl'"):
        b.main(["--settings", "fast"])
