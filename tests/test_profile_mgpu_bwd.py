"""experiments/profile_mgpu_bwd.py reads kernel times off the GPU stream lines of a trace only."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from profile_mgpu_bwd import device_kernels, timeline  # noqa: E402


def test_device_kernels_take_stream_lines_only():
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #13"}},
    ]
    events = [
        {"ph": "X", "pid": 1, "tid": 7, "name": "dkv", "ts": 10.0, "dur": 5.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "dq", "ts": 16.0, "dur": 2.0},
        {"ph": "X", "pid": 1, "tid": 8, "name": "dkv", "ts": 10.0, "dur": 5.0},  # derived line: same time again
        {"ph": "X", "pid": 2, "tid": 7, "name": "host", "ts": 0.0, "dur": 30.0},  # host process
        {"ph": "i", "pid": 1, "tid": 7, "name": "marker", "ts": 12.0},
    ]
    assert device_kernels({"traceEvents": meta + events}) == [("dkv", 10.0, 5.0), ("dq", 16.0, 2.0)]


def test_timeline_is_the_last_call_in_order_with_gaps():
    # two calls of two kernels each, listed out of order
    kernels = [("dq", 16.0, 2.0), ("dkv", 10.0, 5.0), ("dq", 1016.0, 3.0), ("dkv", 1000.0, 10.0)]
    rows = timeline(kernels, calls=2)
    assert [r["name"] for r in rows] == ["dkv", "dq"]
    assert [r["start_ms"] for r in rows] == [0.0, 0.016]
    assert [r["ms"] for r in rows] == [0.010, 0.003]
    assert [r["gap_us"] for r in rows] == [0.0, 6.0]
