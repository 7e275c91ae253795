"""experiments/check_cudnn_limits.py on the CPU: the comparison marks disagreements both ways, and
the command line names a bad flag before touching a GPU."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import check_cudnn_limits as C  # noqa: E402


def test_compare_flags_both_kinds_of_disagreement():
    ran = {("bfloat16", 64): None, ("bfloat16", 100): "NotImplementedError: head dim", ("float32", 64): None,
           ("bfloat16", 264): None}
    said = {("bfloat16", 64): None, ("bfloat16", 100): "not a multiple of 8", ("float32", 64): "f32",
            ("bfloat16", 264): None}
    rows = C.compare(["bfloat16", "float32"], [64, 100, 264], lambda dt, d: ran.get((dt, d), "refused"),
                     lambda dt, d: said.get((dt, d), "refused"))
    agree = {(r["dtype"], r["head_dim"]): r["agree"] for r in rows}
    assert agree == {("bfloat16", 64): True, ("bfloat16", 100): True, ("bfloat16", 264): True,
                     ("float32", 64): False,  # predicted refused, but cuDNN ran
                     ("float32", 100): True, ("float32", 264): True}
    # and the other way: predicted to run, but cuDNN failed
    rows = C.compare(["bfloat16"], [64], lambda dt, d: "RuntimeError", lambda dt, d: None)
    assert rows[0]["agree"] is False and rows[0]["runs"] is False and rows[0]["predicted_runs"] is True


def test_the_h200_record_agrees_with_cudnn_unsupported(monkeypatch):
    """The recorded H200 run, re-checked against today's cudnn_unsupported with Hopper's limits."""
    import json

    import jax.numpy as jnp

    from scaling import attention

    rec = json.loads((Path(__file__).resolve().parents[1] / "docs/results/scan_session49/cudnn_limits_h200.json")
                     .read_text())
    assert len(rec["rows"]) == 54
    monkeypatch.setattr(attention, "_hopper_or_later", lambda: True)
    for r in rec["rows"]:
        assert (attention.cudnn_unsupported(jnp.dtype(r["dtype"]), r["head_dim"]) is None) == r["runs"], r


@pytest.mark.parametrize("argv, message", [
    (["--head-dims", "64,x"], "--head-dims '64,x': comma-separated integers"),
    (["--head-dims", "0"], "--head-dims '0': integers >= 1"),
    (["--dtypes", "bfloat16,int8"], "--dtypes: ['int8'] not among"),
])
def test_bad_flags_exit_2_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        C.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys):
    assert C.main(["--head-dims", "64"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
