"""experiments/scan_only_kernels.py on the CPU: the three scan-only groups of a trace, the scanned
step's less the unrolled step's, and the accounting's two scan terms beside them."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import scan_only_kernels as S  # noqa: E402


def _trace(path: Path, kernels: list[tuple[str, float]]) -> None:
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 7, "name": "memcpy128", "dur": 1e6}]  # a host event: not counted
    events += [{"ph": "X", "pid": 1, "name": n, "dur": us} for n, us in kernels]
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))


def test_groups_are_summed_per_step_and_the_unrolled_steps_subtracted(tmp_path, capsys):
    scan = tmp_path / "profile_tiny-64-2_xla-none-scan.perfetto.json.gz"
    _trace(scan, [("loop_broadcast_fusion_17", 3000.0), ("loop_dynamic_update_slice_fusion_4", 1500.0),
                  ("memcpy128", 600.0), ("loop_add_fusion", 9000.0), ("nvjet_gemm", 5000.0)])
    _trace(tmp_path / "profile_tiny-64-2_xla-none-unrolled.perfetto.json.gz",
           [("loop_broadcast_fusion", 300.0), ("loop_add_fusion", 9000.0)])
    assert S.scan_group_ms(scan, steps=3) == pytest.approx(
        {"broadcast": 1.0, "dynamic-update-slice": 0.5, "memcpy": 0.2})
    assert S.main([str(tmp_path), "--steps", "3"]) == 0
    two_s, full = S.predicted_ms("tiny", 64, 2, "none", "h200")
    assert 0 < two_s < full
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith(f"| tiny 2x64 none | {1.7 - 0.1:.2f} | {two_s:.2f} | {full:.2f} |"), row


def test_a_scan_trace_without_its_unrolled_pair_exits_2(tmp_path):
    _trace(tmp_path / "profile_tiny-64-2_xla-none-scan.perfetto.json.gz", [])
    assert S.main([str(tmp_path)]) == 2
    assert S.main([str(tmp_path / "empty")]) == 2
