"""`python -m scaling` itself: the command list, and an unknown command."""

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
