"""experiments/train.py and experiments/sweep.py: thin wrappers of `python -m scaling train|sweep`
that run the `scaling` package of their own tree, whatever else is installed or on the path."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, command", [("train.py", "train"), ("sweep.py", "sweep")])
def test_wrapper_runs_its_own_trees_package(tmp_path, script, command):
    """A copy of the script in another tree runs that tree's scaling.__main__ (here a stand-in
    that echoes its arguments), not the `scaling` this environment installs (ROOT's, editable)."""
    (tmp_path / "experiments").mkdir()
    shutil.copy(ROOT / "experiments" / script, tmp_path / "experiments" / script)
    (tmp_path / "scaling").mkdir()
    (tmp_path / "scaling" / "__init__.py").write_text("")
    (tmp_path / "scaling" / "__main__.py").write_text("def main(argv):\n    print('stand-in', argv)\n    return 3\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(tmp_path / "experiments" / script), "--workers", "2"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path / "experiments", env=env)
    assert (proc.returncode, proc.stdout.strip()) == (3, f"stand-in ['{command}', '--workers', '2']"), proc.stderr[-2000:]
