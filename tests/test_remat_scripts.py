"""The remat experiments' command lines and tables: experiments/bench_remat.py's flags (refused
before any child starts), experiments/remat_report.py's formatting, experiments/mesh_memory.py's
flags and per-device bytes (8 simulated CPU devices, nothing allocated)."""

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
import bench_remat as br  # noqa: E402
import mesh_memory as mm  # noqa: E402
import remat_report as rr  # noqa: E402

MiB, GiB = 2**20, 2**30


# ----------------------------------------------------------------- bench_remat's flags


@pytest.mark.parametrize("flags,says", [
    (["--model", "nope"], ["--model: 'nope'", "tiny", "1b"]),
    (["--policies", "none,bogus"], ["--policies: unknown 'bogus'", "none, full, dots, names, offload, selective"]),
    (["--policies", "none,none"], ["--policies: repeated none"]),
    (["--batch", "0"], ["--batch: must be a positive integer, got 0"]),
    (["--seq", "-4"], ["--seq: must be a positive integer, got -4"]),
    (["--steps", "0"], ["--steps: must be a positive integer, got 0"]),  # was a ZeroDivisionError per policy
    (["--max-batch", "1"], ["--max-batch: 1 is below --batch 2"]),
    (["--budget-s", "0"], ["--budget-s: must be a positive number of seconds"]),
    (["--capacity-gib", "-1"], ["--capacity-gib: must be a positive number of GiB"]),
    (["--mem-fraction", "2"], ["--mem-fraction: must be a number in (0, 1]"]),
])
def test_bench_remat_bad_flags_exit_2_before_any_child(monkeypatch, capsys, flags, says):
    monkeypatch.setattr(sys, "argv", ["bench_remat.py", "--model", "tiny", "--seq", "64", "--batch", "2", *flags])
    monkeypatch.setattr(br, "spawn", lambda *a, **k: pytest.fail("a child was started for bad flags"))
    with pytest.raises(SystemExit) as e:
        br.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(s in err for s in says), err
    assert "Traceback" not in err


def test_bench_remat_good_flags_pass_the_checks():
    p = SimpleNamespace(error=lambda msg: pytest.fail(msg))
    args = br.argparse.Namespace(model="tiny", seq=64, batch=2, steps=2, max_batch=256, no_search=False, budget_s=400.0,
                                 capacity_gib=0.05, mem_fraction="0.92", policies="none, offload", child=None,
                                 policy="none")
    br.check_args(p, args)
    assert args.policies == "none,offload"  # what the children and the table get


# ------------------------------------------------------------------------ the report


@pytest.mark.parametrize("x,text", [
    (0, "0 B/s"), (5, "5 B/s"), (12_345, "12.3 kB/s"), (55.24e9, "55.2 GB/s"), (999.7e9, "1 TB/s"),
    (3.35e12, "3.35 TB/s"), (989e12, "989 TB/s"), (999.9e12, "1 PB/s"), (1.2e18, "1,200 PB/s"),
])
def test_rate_has_three_digits_and_no_exponent(x, text):
    assert rr.rate(x, "B/s") == text


def _rows(error="XlaRuntimeError: RESOURCE_EXHAUSTED: a | b"):
    """A CPU smoke run: one measured row (MiB sizes), one that failed (no bytes at all)."""
    xla = 30 * MiB + MiB // 2
    return [{"policy": "none", "seq": 64, "xla": xla, "peak": None, "seconds": 0.1, "pred": {"memory": 31 * MiB}},
            {"policy": "offload", "error": error, "pred": {}}]


def test_report_of_a_cpu_run_with_a_failed_row_stays_in_mib():
    args = SimpleNamespace(model="tiny", seq=64, batch=2)
    table = rr.report(args, None, _rows(), [], 1.0)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert "| peak MiB | XLA MiB | predicted MiB |" in rows[0]
    cells = [c.strip() for c in rows[1].split(" | ")]
    assert cells[2:5] == ["30.50", "31.00", f"{31 / 30.5 - 1:+.0%}"]  # 30.5 MiB measured, 31 predicted


def test_report_error_with_a_pipe_stays_in_its_cell():
    args = SimpleNamespace(model="tiny", seq=64, batch=2)
    table = rr.report(args, None, _rows(), [], 1.0)
    header, _, good, bad = [line for line in table.splitlines() if line.startswith("|")][:4]

    def ncells(line):  # cells between unescaped pipes
        return len(line.replace("\\|", "").strip("|").split("|"))

    assert ncells(header) == ncells(good) == ncells(bad) == 15
    assert "a \\| b" in bad


# ----------------------------------------------------------------------- mesh_memory


@pytest.mark.parametrize("flags,says", [
    (["--models", "tiny,nope"], ["--models: unknown 'nope'", "tiny", "llama3_8b"]),
    (["--hardware", "nope"], ["--hardware:", "h200"]),
    (["--batch", "0"], ["--batch: must be a positive integer, got 0"]),
    (["--seq", "-1"], ["--seq: must be a positive integer"]),
    (["--seq", "4096"], ["--seq: 4096 exceeds tiny's model.max_seq_len=512"]),
    # (8, 1, 1) and (1, 8, 1) split the batch 8 ways, (2, 2, 2) and (1, 4, 2) 4 ways: 12 is refused
    # by training (train.check_runnable); the table used to predict it anyway.
    (["--batch", "12"], ["--batch: 12 sequences cannot be split over the 8 devices", "(8, 1, 1)", "multiple of 8"]),
])
def test_mesh_memory_bad_flags_exit_2(monkeypatch, capsys, flags, says):
    monkeypatch.setattr(sys, "argv", ["mesh_memory.py", "--models", "tiny", "--seq", "64", *flags])
    with pytest.raises(SystemExit) as e:
        mm.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(s in err for s in says), err


def test_mesh_memory_tiny_row_shows_the_bytes(monkeypatch, capsys):
    """Params + AdamW state on one device of the data-parallel mesh (everything replicated),
    counted by hand from configs/models/tiny.yaml (V=1024, D=128, L=4, 4 heads of 32, 2 KV
    heads, F=384, untied head): 12.6 MB, 0.0117 GiB, which the table printed as 0.01."""
    layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384 + 2 * 128
    params = 2 * 1024 * 128 + 4 * layer + 128
    assert params == 1_049_728
    per_device = params * 4 * 3 + 2 * 4  # f32 params, mu, nu; two int32 step counts
    monkeypatch.setattr(sys, "argv", ["mesh_memory.py", "--models", "tiny", "--seq", "64", "--batch", "8"])
    assert mm.main() == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny | (8, 1, 1)"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    expect = f"{per_device / GiB:.2g}"
    assert expect == "0.012" and cells[2] == cells[3] == expect, row
    assert all(float(c) > 0 for c in cells[4:6]), row  # total GiB and step ms: not rounded to 0


def test_per_device_bytes_refuses_trees_that_do_not_match():
    import jax
    import jax.numpy as jnp

    mesh = jax.make_mesh((8,), ("x",), devices=jax.devices()[:8])
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    a = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    assert mm.per_device_bytes([a, a], [sh, sh]) == 2 * math.prod((2, 4)) * 4
    with pytest.raises(ValueError):  # was 32 bytes: the second array dropped
        mm.per_device_bytes([a, a], [sh])
