"""`python -m scaling.profile_summary` on bad input: a message naming the flag or file and what is
allowed, exit status 2, no traceback; and on good input, its outputs."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scaling import profile_summary as ps


def _trace(path, events=None):
    """A CPU-layout trace: 2 executions (run_ids) of jit_m, each a 10 us fusion then a 4 us copy
    with a 2 us gap, and 6 us between the executions."""
    if events is None:
        events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
        for run, t in (("1", 0.0), ("2", 22.0)):
            for name, ts, dur in (("loop_add_fusion.1", t, 10.0), ("copy.2", t + 12.0, 4.0)):
                events.append({"ph": "X", "pid": 1, "tid": 5, "ts": ts, "dur": dur, "name": name,
                               "args": {"hlo_op": name, "hlo_module": "jit_m", "run_id": run}})
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def _fails(argv, capsys, *expected):
    with pytest.raises(SystemExit) as e:
        ps.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    for text in expected:
        assert text in err, (text, err)
    return err


def test_missing_path_exits_2_without_traceback(tmp_path):
    """As a process: the exit status and stderr a shell sees."""
    r = subprocess.run([sys.executable, "-m", "scaling.profile_summary", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "error: TRACE" in r.stderr and "no such file or directory" in r.stderr


def test_trace_argument_errors(tmp_path, capsys):
    _fails([tmp_path / "nope"], capsys, "TRACE", "nope: no such file or directory")
    (tmp_path / "empty").mkdir()
    _fails([tmp_path / "empty"], capsys, "TRACE", "no perfetto_trace.json.gz or *.trace.json.gz under")
    (tmp_path / "xplane_only" / "plugins").mkdir(parents=True)
    (tmp_path / "xplane_only" / "plugins" / "vm.xplane.pb").write_bytes(b"\0")
    _fails([tmp_path / "xplane_only"], capsys, "only *.xplane.pb")
    good = _trace(tmp_path / "good" / "perfetto_trace.json.gz").read_bytes()
    (tmp_path / "cut.json.gz").write_bytes(good[: len(good) // 2])
    _fails([tmp_path / "cut.json.gz"], capsys, "TRACE", "truncated or corrupt gzip")
    (tmp_path / "bad.json").write_text('{"traceEvents": [')
    _fails([tmp_path / "bad.json"], capsys, "TRACE", "not JSON, or cut short")
    (tmp_path / "other.json").write_text('{"displayTimeUnit": "ns"}')
    _fails([tmp_path / "other.json"], capsys, "not a Chrome trace", "traceEvents")
    # no device process and no HLO-op events: only the host's Python frames
    _trace(tmp_path / "python_only.json.gz", [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 5, "name": "PjitFunction(f)", "args": {}}])
    _fails([tmp_path / "python_only.json.gz"], capsys, "no kernel or HLO-op events", "processes: /host:CPU")


def test_flag_errors(tmp_path, capsys):
    trace = _trace(tmp_path / "t" / "perfetto_trace.json.gz")
    for steps in ("0", "-3"):
        _fails([trace, "--steps", steps], capsys, "--steps must be an integer >= 1", f"got {steps}")
    _fails([trace, "--steps", "two"], capsys, "--steps", "invalid int value")
    _fails([trace, "--top", "-1"], capsys, "--top must be an integer >= 0", "got -1")
    _fails([trace, "--hlo", tmp_path / "no.hlo.txt"], capsys, "--hlo", "no.hlo.txt: no such file")
    (tmp_path / "notes.txt").write_text("not HLO at all\n")
    _fails([trace, "--hlo", tmp_path / "notes.txt"], capsys, "--hlo", "no HLO instructions")
    _fails([trace, "--module", "jit_x"], capsys, "--module", "no events of module 'jit_x'", "modules seen: ['jit_m']")
    (tmp_path / "adir").mkdir()
    _fails([trace, "--json", tmp_path / "adir"], capsys, "--json", "is a directory")
    _fails([trace, "--md", tmp_path / "adir"], capsys, "--md", "is a directory")


def test_outputs_into_missing_folders(tmp_path, capsys):
    trace = _trace(tmp_path / "t" / "perfetto_trace.json.gz")
    md, js = tmp_path / "new" / "deeper" / "s.md", tmp_path / "new2" / "s.json"
    assert ps.main([str(tmp_path / "t"), "--md", str(md), "--json", str(js), "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert md.read_text() + "\n" == out  # print() adds a newline
    s = json.loads(js.read_text())
    # By hand: window 0..38, busy 2 x (10 + 4) = 28, idle 2 + 6 + 2 = 10; 2 run_ids.
    assert s["trace"] == str(trace) and s["steps"] == 2
    assert (s["window_us"], s["busy_us"], s["idle_us"]) == (38, 28, 10)
    assert s["categories"]["copy/dynamic-update-slice"] == {"us": 8, "count": 2}
    assert s["categories"]["elementwise/reduction fusions"] == {"us": 20, "count": 2}
    assert s["top_kernels"] == [] and "kernels by total time" not in out
    assert "| copy/dynamic-update-slice | 0.00 | 21.1% | 1 |" in out  # 8 / 38
