"""What a new user meets first, checked as the README shows it: `./scripts/run`'s set-up from
nothing (with fake uv / pip / Python, so no network and no real install), `--profile`'s window,
and the commands' help."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import jax
import pytest

from scaling import profile_summary
from scaling.__main__ import main
from scaling.config import load_config
from scaling.train import train

ROOT = Path(__file__).resolve().parents[1]


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/bash\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def sandbox(tmp_path):
    """A copy of scripts/run in a tree of its own, a PATH of the few real tools it needs, fakes
    of `uv` (records its calls), a Python 3.12 whose pip installs the fake uv into its user base,
    a distribution `python3` whose pip refuses (PEP 668), and a `.venv/bin/python` that echoes."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "run", repo / "scripts" / "run")
    _exe(repo / ".venv" / "bin" / "python", 'echo "venv python $*"\n')
    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("bash", "env", "dirname", "grep", "sort", "mkdir", "cat", "chmod"):
        found = shutil.which(name)
        assert found, name
        (tools / name).symlink_to(found)
    log = tmp_path / "uv.log"
    uv = f'echo "uv $*" >> {log}\n'
    user_base = tmp_path / "home" / ".local"
    py312 = _exe(tmp_path / "py312" / "python3.12", f"""
if [ "$1 $2" = "-m site" ]; then echo {user_base}; exit 0; fi
if [ "$1 $2" = "-m pip" ] && [ -z "${{FAKE_PIP_REFUSES:-}}" ]; then
  mkdir -p {user_base}/bin; printf '#!/bin/bash\\n%s' '{uv}' > {user_base}/bin/uv; chmod +x {user_base}/bin/uv; exit 0
fi
echo "error: externally-managed-environment" >&2; exit 1
""")
    _exe(tools / "python3", 'echo "error: externally-managed-environment" >&2; exit 1\n')
    env = {"PATH": str(tools), "HOME": str(tmp_path / "home"), "UV_PYTHON": str(py312)}

    def run(*args, extra_env=None, drop=()):
        e = {k: v for k, v in {**env, **(extra_env or {})}.items() if k not in drop}
        return subprocess.run([str(tools / "bash"), str(repo / "scripts" / "run"), *args], env=e,
                              capture_output=True, text=True, timeout=60)

    def uv_calls():
        return log.read_text().splitlines() if log.exists() else []

    return run, uv_calls, user_base, uv, tools


def test_run_finds_uv_an_earlier_pip_install_put_off_the_path(sandbox):
    """uv in ~/.local/bin (where `pip install --user` put it), not on the PATH, and every pip
    refusing to install: the old script went to pip only and stopped with pip's error."""
    run, uv_calls, user_base, uv, _ = sandbox
    _exe(user_base / "bin" / "uv", uv)
    r = run("python", "-c", "pass", extra_env={"FAKE_PIP_REFUSES": "1"})
    assert r.returncode == 0, r.stderr
    assert "venv python -c pass" in r.stdout
    assert uv_calls() == ["uv sync --locked --quiet --compile-bytecode"]


def test_run_installs_uv_with_the_python_312_pip_when_python3_refuses(sandbox):
    """No uv anywhere and a Debian/Ubuntu `python3` (externally managed): the chosen Python
    3.12's pip installs it (the old script asked python3's pip alone, and failed)."""
    run, uv_calls, user_base, _, _ = sandbox
    r = run("python", "-c", "pass")
    assert r.returncode == 0, r.stderr
    assert (user_base / "bin" / "uv").exists()
    assert uv_calls() == ["uv sync --locked --quiet --compile-bytecode"]


def test_run_without_uv_or_a_working_pip_says_how_to_get_uv(sandbox):
    run, uv_calls, _, _, _ = sandbox
    r = run("python", "-c", "pass", extra_env={"FAKE_PIP_REFUSES": "1"})
    assert r.returncode == 1
    assert "uv is missing and pip could not install it" in r.stderr and "docs.astral.sh/uv" in r.stderr
    assert uv_calls() == []


def test_run_without_python_312_stops_before_uv(sandbox):
    """No UV_PYTHON, no pyenv, no python3.12: the message, exit 1, and uv is not run (the old
    `export UV_PYTHON="$(find_python)"` hid the failure and went on to `uv sync`)."""
    run, uv_calls, _, uv, tools = sandbox
    _exe(tools / "uv", uv)
    r = run("python", "-c", "pass", drop=("UV_PYTHON",))
    assert r.returncode == 1
    assert "error: Python 3.12 is required" in r.stderr
    assert uv_calls() == [] and "venv python" not in r.stdout


def test_profile_traces_only_its_window(tmp_path):
    """`--profile.steps=[A,B]` traces B - A steps. The step before A was still running when the
    trace started (the loop keeps one step in flight), so the trace and its summary held part of
    a third step here (2.9 "steps" for [2, 4))."""
    cfg = load_config("configs/models/tiny.yaml", [
        "--data.source=synthetic", "--train.steps=5", "--train.batch_size=2", "--train.seq_len=16",
        "--train.log_every=100", "--train.eval_every=0", "--checkpoint.enabled=false",
        "--logging.progress=false", "--logging.tensorboard=false", "--profile.steps=[2,4]"])
    train(cfg, str(tmp_path / "run"), log=lambda m: None, devices=jax.devices()[:1])
    s, _ = profile_summary.summarize_path(tmp_path / "run" / "profile")
    assert s["steps"] == 2, (s["steps"], s["steps_source"])


def test_train_help_names_overrides_and_run_dir_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--section.key=value" in out and "sections: model, mesh, train, optimizer" in out
    assert "default: runs/<config name>-<timestamp>" in out and "resumes" in out


def test_generate_help_names_dir_and_exports(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--checkpoint DIR" in out  # the description's "DIR is ..." names the flag's value
    assert "python -m scaling export" in out
