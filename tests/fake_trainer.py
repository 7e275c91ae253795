"""Run sweep points against a stand-in trainer: a folder whose scaling/__main__.py is the given
script, the rest of the package the real one (__path__ extended), so submitit's jobs unpickle
run_point. The script reads its plan (point id -> mode) from $FAKE_PLAN."""

from __future__ import annotations

import json
from pathlib import Path

import scaling


def install(tmp_path: Path, monkeypatch, script: str):
    """chdir into the fake root; returns set_plan(modes), which rewrites the plan file."""
    root = tmp_path / "fake-root"
    (root / "scaling").mkdir(parents=True)
    (root / "scaling" / "__main__.py").write_text(script)
    (root / "scaling" / "__init__.py").write_text(f"__path__.append({str(Path(scaling.__file__).parent)!r})\n")
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    monkeypatch.setenv("FAKE_PLAN", str(plan))
    monkeypatch.chdir(root)

    def set_plan(modes: dict[str, str]):
        plan.write_text(json.dumps(modes))

    return set_plan
