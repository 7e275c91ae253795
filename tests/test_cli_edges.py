"""Edges of `shardings`, `export` and `python -m scaling.profile_summary` as a user meets them:
a refused input exits 2 with one line naming it, and a failed export leaves nothing behind."""

from __future__ import annotations

import errno
import gzip
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from scaling import checkpoint as C
from scaling.config import MeshConfig, load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/models/tiny.yaml")
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _main(argv, capsys):
    from scaling.__main__ import main

    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------------- shardings


def test_shardings_over_absent_devices_refuses_explicit_axes_as_the_real_mesh_does(capsys, monkeypatch):
    """`--devices N` printed a layout for mesh.axis_type=explicit (exit 0), which the real mesh
    and training refuse: the abstract layout applies the same rules and errors."""
    for v in ENV:
        monkeypatch.delenv(v, raising=False)
    base = ["shardings", "--config", TINY, "--mesh.fsdp=8", "--mesh.axis_type=explicit"]
    rc, _, real = _main(base, capsys)
    assert rc == 2 and "mesh.axis_type=explicit is not supported" in real
    rc, out, err = _main([*base, "--devices", "8"], capsys)
    assert rc == 2 and not out and err == real


@pytest.mark.parametrize("how", ["flag", "env"])
def test_shardings_of_a_one_process_job_is_not_called_multi_host(capsys, monkeypatch, how):
    """mesh.num_processes=1 (or JAX_NUM_PROCESSES=1) is a single-process job: no note that the
    layout covers only this machine, no hint to pass the whole job's devices."""
    for v in ENV:
        monkeypatch.delenv(v, raising=False)
    extra = ["--mesh.num_processes=1"] if how == "flag" else []
    if how == "env":
        monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    rc, out, _ = _main(["shardings", "--config", TINY, "--mesh.fsdp=-1", *extra], capsys)
    assert rc == 0 and out.startswith("mesh {")
    rc, _, err = _main(["shardings", "--config", TINY, "--mesh.fsdp=16", *extra], capsys)
    assert rc == 2 and "has 16 devices but 8 are available" in err and "--devices N" not in err
    # two processes still get both
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    rc, out, _ = _main(["shardings", "--config", TINY, "--mesh.fsdp=-1"], capsys)
    assert rc == 0 and out.startswith("(over this machine's 8 devices")


def test_mesh_size_message_counts_in_words():
    from scaling.sharding.mesh import MeshError, resolve_mesh_shape

    with pytest.raises(MeshError, match=r"has 2 devices but 1 is available; make the product .* equal 1"):
        resolve_mesh_shape(MeshConfig(fsdp=2), 1)
    with pytest.raises(MeshError, match=r"has 1 device but 8 are available"):
        resolve_mesh_shape(MeshConfig(data=1, fsdp=1, tensor=1), 8)


# ----------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def run1(tmp_path_factory):
    """(run_dir, params) of a tiny run with one complete checkpoint (step 1, random values)."""
    from scaling.train import abstract_state, make_setup

    run_dir = tmp_path_factory.mktemp("run1")
    cfg = load_config(TINY, ["--mesh.fsdp=1", "--data.source=synthetic"])
    setup = make_setup(cfg, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding),
                         abstract_state(setup))
    ck = C.Checkpointer(run_dir, cfg.checkpoint)
    ck.save(1, state, {"loader": {"next_index": 1}, "config": to_dict(cfg)})
    ck.close()
    (run_dir / "tokenizer.json").write_text('{"kind": "byte"}')
    return run_dir, jax.device_get(state["params"])


def _no_read(monkeypatch):
    monkeypatch.setattr(C, "_read_params", lambda *a, **k: pytest.fail("read the params for a refused export"))


def test_export_to_an_unwritable_place_exits_2_before_reading(run1, tmp_path, capsys, monkeypatch):
    """--out under a file: the mkdir after the read was an uncaught NotADirectoryError traceback."""
    run_dir, _ = run1
    (tmp_path / "a_file").write_text("x")
    _no_read(monkeypatch)
    for fmt in ("orbax", "hf"):
        rc, out, err = _main(["export", "--run_dir", run_dir, "--out", tmp_path / "a_file" / "sub", "--format", fmt], capsys)
        assert rc == 2 and not out, err
        assert err.startswith(f"error: --out {tmp_path / 'a_file' / 'sub'}: cannot write there (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_export_that_fails_while_writing_leaves_nothing(run1, tmp_path, capsys, monkeypatch):
    """A full disk in the middle of the write: one error line, exit 2, and neither the half-written
    export nor the directories made for it remain (they had been left, with a traceback)."""
    run_dir, _ = run1

    def full_disk(self, directory, *a, **k):
        Path(directory).mkdir(parents=True)
        (Path(directory) / "half").write_bytes(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(C.ocp.StandardCheckpointer, "save", full_disk)
    out_dir = tmp_path / "new" / "deeper" / "export"
    rc, out, err = _main(["export", "--run_dir", run_dir, "--out", out_dir], capsys)
    assert rc == 2 and not out and "Traceback" not in err
    assert f"error: --out {out_dir}: the export could not be written" in err and "No space left on device" in err
    assert list(tmp_path.iterdir()) == []


def test_export_interrupted_leaves_an_empty_out_as_it_was(run1, tmp_path, monkeypatch):
    """Ctrl-C while the hf weights are written: the empty --out held the config and tokenizer
    already, an export that looked whole to a directory listing."""
    from scaling.interop import hf

    run_dir, _ = run1
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        C.export_params(run_dir, out_dir, format="hf")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and list(out_dir.iterdir()) == []


def test_export_names_an_unreadable_run_tokenizer_before_reading(run1, tmp_path, capsys, monkeypatch):
    """It was `error: --format hf: Expecting property name ...`, naming no file, after the read."""
    src, _ = run1
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    (run_dir / "tokenizer.json").write_text("{bad")
    _no_read(monkeypatch)
    rc, _, err = _main(["export", "--run_dir", run_dir, "--out", tmp_path / "hf", "--format", "hf"], capsys)
    assert rc == 2 and f"the run's tokenizer {run_dir / 'tokenizer.json'} is unreadable (JSONDecodeError" in err
    assert not (tmp_path / "hf").exists()


def test_export_writes_whole_and_says_when_run_dir_is_an_export(run1, tmp_path, capsys):
    run_dir, params = run1
    out_dir = tmp_path / "a" / "b"
    rc, out, err = _main(["export", "--run_dir", run_dir, "--out", out_dir], capsys)
    assert rc == 0, err
    assert [p.name for p in tmp_path.iterdir()] == ["a"] and [p.name for p in (tmp_path / "a").iterdir()] == ["b"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.yaml", "export.json", "params", "tokenizer.json"]
    loaded = C.load_params(out_dir)
    jax.tree.map(np.testing.assert_array_equal, params, jax.device_get(loaded))
    rc, _, err = _main(["export", "--run_dir", out_dir, "--out", tmp_path / "again"], capsys)
    assert rc == 2 and "it is an export (params/ + config.yaml), not a training run's directory" in err


# ----------------------------------------------------------------------------- profile_summary


def _trace(path: Path) -> Path:
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    for run, t in (("1", 0.0), ("2", 22.0)):
        for name, ts, dur in (("loop_add_fusion.1", t, 10.0), ("copy.2", t + 12.0, 4.0)):
            events.append({"ph": "X", "pid": 1, "tid": 5, "ts": ts, "dur": dur, "name": name,
                           "args": {"hlo_op": name, "hlo_module": "jit_m", "run_id": run}})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def _ps_fails(argv, capsys) -> str:
    from scaling import profile_summary as ps

    with pytest.raises(SystemExit) as e:
        ps.main([str(a) for a in argv])
    out = capsys.readouterr()
    assert e.value.code == 2 and not out.out, out.err
    return out.err


def test_profile_summary_never_writes_over_its_inputs_or_one_output_over_the_other(tmp_path, capsys):
    """`--json` naming the trace replaced the trace with the summary (exit 0); --md and --json
    naming one file kept only the second."""
    trace = _trace(tmp_path / "vm.trace.json.gz")
    before = trace.read_bytes()
    err = _ps_fails([trace, "--json", trace], capsys)
    assert f"--json {trace}: is the trace being read" in err
    err = _ps_fails([tmp_path, "--md", tmp_path / "x" / ".." / trace.name], capsys)  # the trace found in a folder
    assert "is the trace being read" in err
    assert trace.read_bytes() == before
    hlo = tmp_path / "step.hlo.txt"
    hlo.write_text("ENTRY %main {\n  %copy.2 = f32[4]{0} copy(%p)\n}\n")
    err = _ps_fails([trace, "--hlo", hlo, "--md", hlo], capsys)
    assert f"--md {hlo}: is the --hlo file being read" in err and hlo.read_text().startswith("ENTRY")
    err = _ps_fails([trace, "--md", tmp_path / "s.out", "--json", tmp_path / "s.out"], capsys)
    assert "--md and --json: both name" in err and not (tmp_path / "s.out").exists()
