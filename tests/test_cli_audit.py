"""`python -m scaling` as a user types it: flags, overrides, --config, wrong commands, Ctrl-C."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scaling.__main__ import _config_args, main
from scaling.config import Config, ConfigError, RematConfig, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/models/tiny.yaml")


def test_a_bare_boolean_override_means_true():
    """`--train.show_shardings` alone was refused ("must look like --section.key=value")."""
    assert parse_overrides(["--train.show_shardings"], Config) == {"train": {"show_shardings": True}}
    _, cfg = _config_args(["--config", TINY, "--train.show_shardings", "--logging.progress", "false",
                           "--model.num_layers=3"], "plan")
    assert cfg.train.show_shardings is True and cfg.logging.progress is False and cfg.model.num_layers == 3
    for bare in ("--train.steps", "--mesh.num_processes", "--model"):  # not booleans: a value is needed
        with pytest.raises(ConfigError, match=f"override '{bare}' has no value"):
            load_config(None, [bare])


def test_a_section_then_its_key_the_last_wins():
    """`--model=null --model.num_layers=3` "conflicted with an earlier one"; the README says the
    last one wins. A section override is also accepted on the command line, as documented."""
    cfg = load_config(TINY, ["--model=null", "--model.num_layers=3"])
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == load_config(TINY).model.hidden_size
    with pytest.raises(ConfigError, match="model must be a mapping"):  # the other order: null is last
        load_config(TINY, ["--model.num_layers=3", "--model=null"])
    _, cfg = _config_args(["--config", TINY, "--model={num_layers: 5}"], "plan")  # (was "unrecognised")
    assert cfg.model.num_layers == 5


def test_a_config_built_in_python_gets_no_yaml_hint():
    for build in (lambda: Config(run_dir=17), lambda: Config(remat=RematConfig(names=(1,)))):
        with pytest.raises(ConfigError) as e:
            build()
        assert "got int" in str(e.value) and "YAML" not in str(e.value), e.value
    with pytest.raises(ConfigError, match=r"remat.names\[0\]: got int 1 \(YAML read it as a number"):
        load_config(None, ["--remat.names=[1]"])  # (read from text: the hint stays)


def test_an_empty_section_in_a_file_changes_nothing(tmp_path):
    """`model:` with its keys commented out was "model must be a mapping of its fields, got None";
    in a file that inherits, it must not wipe the inherited section either."""
    (tmp_path / "alone.yaml").write_text("model:\n  # num_layers: 4\ntrain:\n  steps: 7\n")
    assert load_config(tmp_path / "alone.yaml") == load_config(None, ["--train.steps=7"])
    (tmp_path / "child.yaml").write_text(f"inherit: {TINY}\nmodel:\n  # hidden_size: 64\n")
    assert load_config(tmp_path / "child.yaml") == load_config(TINY)
    (tmp_path / "runs.yaml").write_text("run_dir:\n")  # not a section: null stays null
    assert load_config(tmp_path / "runs.yaml").run_dir is None


def _main(argv, capsys):
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_directory_as_config_is_called_one(tmp_path, capsys):
    rc, out, err = _main(["plan", "--config", tmp_path], capsys)
    assert rc == 2 and not out and err == f"config error: config file {tmp_path} is a directory; name a YAML file in it\n"


def test_config_given_twice_is_refused(capsys):
    """The second --config replaced the first silently (a user layering two files got one)."""
    with pytest.raises(SystemExit) as e:
        _config_args(["--config", TINY, "--config=other.yaml"], "plan")
    assert e.value.code == 2
    assert f"--config given twice ({TINY}, other.yaml)" in capsys.readouterr().err


def test_wrong_command_lines_say_what_to_type(capsys):
    rc, _, err = _main(["trian", "--config", TINY], capsys)
    assert rc == 2 and err.startswith("error: unknown command 'trian'; allowed: train, ") and "did you mean 'train'?" in err
    rc, _, err = _main(["--config", TINY, "--train.steps=5", "train"], capsys)  # options before the command
    assert rc == 2 and err.startswith(f"error: the command comes first: python -m scaling train --config {TINY} --train.steps=5\n")
    rc, _, err = _main(["--train.steps=5"], capsys)
    assert rc == 2 and err.startswith("error: no command before --train.steps=5; allowed: train, ")


def test_help_of_train_and_shardings_imports_no_jax():
    """`train --help` and `shardings --help` imported JAX first (over a second)."""
    code = ("import sys\nfrom scaling.__main__ import main\nfor c in ('train', 'shardings'):\n"
            "    try:\n        main([c, '--help'])\n    except SystemExit as e:\n        assert e.code == 0\n"
            "print(sorted(m for m in ('jax', 'scaling.train') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m scaling shardings" in out.stdout and out.stdout.splitlines()[-1] == "[]", out.stdout


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    from scaling import __main__ as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "plan", interrupted)
    monkeypatch.setattr(sys, "argv", ["scaling", "plan"])
    try:
        rc = cli._run()
    except KeyboardInterrupt:  # (not raised on: pytest would stop the whole session)
        pytest.fail("KeyboardInterrupt escaped _run: a traceback for Ctrl-C")
    assert rc == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_sweep_refuses_a_second_config(tmp_path, capsys):
    """As train does: a second --config had replaced the first silently."""
    from scaling.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["sweep", "--config", "configs/sweeps/tiny_cpu.yaml", "--config", "configs/sweeps/other.yaml",
              "--dry-run"])
    assert e.value.code == 2 and "--config given twice" in capsys.readouterr().err


def test_help_as_a_command(capsys):
    """`python -m scaling help` prints the usage (exit 0); `help train` is `train --help`."""
    from scaling.__main__ import main

    assert main(["help"]) == 0
    assert "train" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["help", "train"])
    assert e.value.code == 0 and "--run_dir" in capsys.readouterr().out


def test_sweep_takes_space_separated_overrides_as_the_other_commands_do():
    """`--isoflop.budgets [1e12]` had been refused as an unrecognised argument by sweep only."""
    from scaling.sweep import parse_args

    _, rest = parse_args(["--config", "configs/sweeps/tiny_cpu.yaml", "--isoflop.budgets", "[1e12]",
                          "--train.steps=3"])
    assert rest == ["--isoflop.budgets=[1e12]", "--train.steps=3"]
