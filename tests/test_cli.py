"""`python -m scaling` itself: the command list, and an unknown command."""

from pathlib import Path

import pytest

from scaling.__main__ import COMMANDS, main


def test_help_lists_every_command_with_a_summary(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "shardings", "plan", "generate", "sweep", "fit", "export"):
        line = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 20, line  # a real description after the name
    assert set(COMMANDS) == {"train", "shardings", "plan", "generate", "sweep", "fit", "export"}


def test_unknown_or_missing_command_exits_2_naming_the_commands(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'; allowed: train, shardings, plan, generate, sweep, fit, export" in err
    assert main([]) == 2
    assert "usage: python -m scaling COMMAND" in capsys.readouterr().err


def test_space_separated_overrides(capsys):
    """`--section.key value` is the same override as `--section.key=value` (the value alone was
    refused as an unrecognised argument, so the README's form did not work)."""
    from scaling.__main__ import _config_args

    _, a = _config_args(["--config", "configs/models/tiny.yaml", "--model.num_layers", "3", "--mesh.data", "-1",
                         "--mesh.fsdp=1"], "plan")
    _, b = _config_args(["--config", "configs/models/tiny.yaml", "--model.num_layers=3", "--mesh.data=-1",
                         "--mesh.fsdp=1"], "plan")
    assert a == b and a.model.num_layers == 3 and a.mesh.data == -1
    with pytest.raises(SystemExit):  # a value with no key before it is still refused
        _config_args(["--config", "configs/models/tiny.yaml", "stray"], "plan")
    assert "unrecognised arguments ['stray']" in capsys.readouterr().err


def test_output_into_a_closed_pipe_ends_quietly():
    """`python -m scaling fit ... | head` ended in a BrokenPipeError traceback once head had
    exited. Now it stops quietly with 141 (128 + SIGPIPE), as Unix tools do."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "scaling", "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_strict_json_turns_non_finite_floats_into_null():
    import json
    import math

    from scaling import strict_json

    obj = {"a": [1.0, math.nan, (math.inf, -math.inf)], "b": {"c": 2, "d": "x"}, "e": None}
    text = strict_json.dumps(obj)
    assert json.loads(text) == {"a": [1.0, None, [None, None]], "b": {"c": 2, "d": "x"}, "e": None}
