"""Checkpoint loading and export against damaged run directories and bad destinations, and the
hardware table against the device strings JAX reports.

One tiny run directory (two complete steps written from random values on one device) is
made once; each test damages a copy of it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from scaling import checkpoint as C
from scaling import hardware as H
from scaling.config import load_config, to_dict
from scaling.train import abstract_state, make_setup
from test_checkpoint import _leaves_equal

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/models/tiny.yaml")


def _make_run(run_dir: Path, overrides: list[str], steps=(1, 2)) -> tuple:
    cfg = load_config(TINY, ["--model.num_kv_heads=4", "--mesh.fsdp=1", "--data.source=synthetic", *overrides])
    setup = make_setup(cfg, devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    saved = {}
    ck = C.Checkpointer(run_dir, cfg.checkpoint)
    for s in steps:
        state = jax.tree.map(lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding),
                             abstract_state(setup))
        ck.save(s, state, {"loader": {"next_index": s}, "config": to_dict(cfg)})
        ck.wait()
        saved[s] = jax.device_get(state["params"])
    ck.close()
    (run_dir / "config.yaml").write_text("# the run's own config\n")
    return cfg, saved


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """(cfg, run_dir, {step: params}) for steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("run2")
    cfg, saved = _make_run(run_dir, [])
    return cfg, run_dir, saved


@pytest.fixture
def run(run2, tmp_path):
    """A private copy of the module's run, to damage."""
    cfg, src, saved = run2
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return cfg, dst, saved


def _export(args: list[str], capsys) -> tuple[int, str, str]:
    from scaling.__main__ import main

    rc = main(["export", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------- damaged run directories


def test_unreadable_latest_checkpoint_falls_back_to_the_one_before_and_says_so(run, capsys):
    """A committed step whose state metadata is gone (disk trouble after the commit): export and
    load_params use the step before it and name the one skipped; asked for by --step, it is an
    error naming the step and the steps there are. (Was an AttributeError traceback.)"""
    cfg, run_dir, saved = run
    for f in (run_dir / "checkpoints/2/state").rglob("*"):
        if f.is_file() and f.name != C.COMMIT_SUCCESS_FILE:
            f.write_bytes(b"")
    rc, out, err = _export(["--run_dir", str(run_dir), "--out", str(run_dir.parent / "e")], capsys)
    assert rc == 0, err
    assert "exported params of step 1" in out
    assert "checkpoint: step 2 in" in err and "is unreadable" in err
    _leaves_equal(saved[1], C.load_params(run_dir.parent / "e"))
    lines = []
    _leaves_equal(saved[1], C.load_params(run_dir, log=lines.append))
    assert len(lines) == 1 and lines[0].startswith("checkpoint: step 2 in")
    rc, out, err = _export(["--run_dir", str(run_dir), "--out", str(run_dir.parent / "e2"), "--step", "2"], capsys)
    assert rc == 2 and err.startswith("error: --step 2: the checkpoint") and "complete steps: [1, 2]" in err
    assert "Traceback" not in err and not (run_dir.parent / "e2").exists()
    with pytest.raises(C.CheckpointError, match=r"^step 2: the checkpoint .* is unreadable"):
        C.load_params(run_dir, step=2)
    assert C.complete_steps(run_dir / "checkpoints") == [1, 2]  # reading never moves or deletes anything


def test_unreadable_data_of_the_latest_checkpoint_falls_back(run, capsys):
    """Metadata intact, the array data truncated: TensorStore raises a bare Exception."""
    _, run_dir, saved = run
    data = [f for f in (run_dir / "checkpoints/2/state").glob("ocdbt.process_*/d/*") if f.is_file()]
    assert data
    for f in data:
        f.write_bytes(b"")
    _leaves_equal(saved[1], C.load_params(run_dir))  # (was TensorStore's bare Exception)
    err = capsys.readouterr().err  # told on stderr by default
    assert "checkpoint: step 2 in" in err and "is unreadable (Exception: " in err


def test_missing_or_broken_meta_is_named(run, capsys):
    """A step without its meta (config + loader position): loading it with the config from the
    step says which file is missing; the default step falls back. (Was FileNotFoundError /
    JSONDecodeError tracebacks.)"""
    cfg, run_dir, saved = run
    shutil.rmtree(run_dir / "checkpoints/2/meta")
    with pytest.raises(C.CheckpointError, match=r"^step 2: .*checkpoints/2/meta/metadata is missing"):
        C.load_params(run_dir, step=2)
    _leaves_equal(saved[2], C.load_params(run_dir, cfg.model, step=2))  # the params need no meta
    lines = []
    _leaves_equal(saved[1], C.load_params(run_dir, log=lines.append))
    assert "meta/metadata is missing" in lines[0]
    (run_dir / "checkpoints/1/meta/metadata").write_text("{")
    rc, out, err = _export(["--run_dir", str(run_dir), "--out", str(run_dir.parent / "e")], capsys)
    assert rc == 2 and "Traceback" not in err
    assert "error: no readable checkpoint in" in err and "step 2:" in err and "step 1:" in err
    assert "checkpoints/1/meta/metadata is unreadable (JSONDecodeError" in err


def test_partial_latest_save_is_named_and_skipped(run, capsys):
    """A kill -9 mid-save leaves `2.orbax-checkpoint-tmp-*`: step 1 is used and the user is told;
    with only partial saves, the error names them."""
    _, run_dir, saved = run
    ckpts = run_dir / "checkpoints"
    (ckpts / "2").rename(ckpts / f"2{C.TMP_DIR_SUFFIX}-1234")
    rc, out, err = _export(["--run_dir", str(run_dir), "--out", str(run_dir.parent / "e")], capsys)
    assert rc == 0 and "exported params of step 1" in out
    assert f"checkpoint: ignoring partial save {ckpts}/2{C.TMP_DIR_SUFFIX}-1234" in err
    lines = []
    _leaves_equal(saved[1], C.load_params(run_dir, log=lines.append))
    assert len(lines) == 1 and "ignoring partial save" in lines[0]
    # Without commit_success.txt (Orbax before it wrote one on a local disk) a step is still complete:
    # Orbax 0.12.4 itself counts any renamed step directory as finished.
    (ckpts / "1" / C.COMMIT_SUCCESS_FILE).unlink()
    rc, out, err = _export(["--run_dir", str(run_dir), "--out", str(run_dir.parent / "e2")], capsys)
    assert rc == 0 and "exported params of step 1" in out
    (ckpts / "1").rename(ckpts / f"1{C.TMP_DIR_SUFFIX}-99")
    (ckpts / "3").mkdir()  # an empty step directory: nothing of a save
    rc, out, err = _export(["--run_dir", str(run_dir), "--out", str(run_dir.parent / "e3")], capsys)
    tmp = C.TMP_DIR_SUFFIX
    assert rc == 2 and f"partial saves, never committed: 1{tmp}-99, 2{tmp}-1234, 3" in err
    with pytest.raises(C.CheckpointError, match=r"partial saves, never committed: 1.*, 2.*, 3"):
        C.load_params(run_dir)


def test_load_params_names_what_the_path_is(run2, tmp_path):
    _, run_dir, _ = run2
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(C.CheckpointError, match=r"a_file is a file; expected an export directory"):
        C.load_params(tmp_path / "a_file")
    with pytest.raises(C.CheckpointError, match=r"no_such_dir does not exist$"):
        C.load_params(tmp_path / "no_such_dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(C.CheckpointError, match=r"empty is neither an export .* nor a run"):
        C.load_params(tmp_path / "empty")


def test_checkpointer_restore_of_a_missing_step_lists_the_steps(run2):
    cfg, run_dir, _ = run2
    ck = C.Checkpointer(run_dir, cfg.checkpoint)
    try:
        with pytest.raises(C.CheckpointError, match=r"^step 5: no complete checkpoint of that step .* have \[1, 2\]"):
            ck.restore(abstract_state(make_setup(cfg, devices=jax.devices()[:1])), step=5)
    finally:
        ck.close()


# ------------------------------------------------------------------ export destinations


def test_export_refuses_the_run_directory_by_any_path(run, capsys):
    """`--out run/../run` and a symlink to the run are the run directory: its config.yaml
    was overwritten (exit 0)."""
    _, run_dir, _ = run
    link = run_dir.parent / "link"
    link.symlink_to(run_dir)
    for out in (f"{run_dir}/../{run_dir.name}", str(link)):
        for fmt in ("orbax", "hf"):
            rc, _, err = _export(["--run_dir", str(run_dir), "--out", out, "--format", fmt], capsys)
            assert rc == 2 and "is the run directory itself" in err, (out, fmt, err)
    assert (run_dir / "config.yaml").read_text() == "# the run's own config\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.yaml"]


def test_export_refuses_a_non_empty_directory_and_the_checkpoints_directory(run, capsys):
    """Another run's directory (config.yaml, no params/) had its config.yaml overwritten."""
    _, run_dir, saved = run
    other = run_dir.parent / "other_run"
    other.mkdir()
    (other / "config.yaml").write_text("mine\n")
    for fmt in ("orbax", "hf"):
        rc, _, err = _export(["--run_dir", str(run_dir), "--out", str(other), "--format", fmt], capsys)
        assert rc == 2 and f"error: --out {other} is not empty (holds config.yaml)" in err
    assert (other / "config.yaml").read_text() == "mine\n" and len(list(other.iterdir())) == 1
    rc, _, err = _export(["--run_dir", str(run_dir), "--out", str(run_dir / "checkpoints/7")], capsys)
    assert rc == 2 and "is inside the run's checkpoints directory" in err
    assert C.complete_steps(run_dir / "checkpoints") == [1, 2] and not (run_dir / "checkpoints/7").exists()
    empty = run_dir.parent / "empty"
    empty.mkdir()
    rc, out, err = _export(["--run_dir", str(run_dir), "--out", str(empty)], capsys)  # an empty one is fine
    assert rc == 0 and "exported params of step 2" in out
    _leaves_equal(saved[2], C.load_params(empty))


def test_hf_export_with_a_tokenizer_larger_than_the_vocabulary_exits_2(tmp_path, capsys):
    """The byte tokenizer (257 ids) on a 200-token model: hf.save_params' ValueError was a traceback."""
    run_dir = tmp_path / "run"
    _make_run(run_dir, ["--model.vocab_size=200"], steps=(1,))
    (run_dir / "tokenizer.json").write_text('{"kind": "byte"}')
    rc, _, err = _export(["--run_dir", str(run_dir), "--out", str(tmp_path / "hf"), "--format", "hf"], capsys)
    assert rc == 2 and "Traceback" not in err
    assert "error: --format hf: the tokenizer has 257 tokens, more than the model's vocab_size 200" in err


# --------------------------------------------------------------------- shardings


def test_load_params_onto_another_mesh_and_a_sharding_that_does_not_fit(run2, devices):
    """Saved from one device, loaded straight into an 8-device fsdp x tensor layout, bit for bit;
    one sharding that cannot divide some parameter is refused naming that parameter."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    cfg, run_dir, saved = run2
    setup = make_setup(load_config(TINY, ["--model.num_kv_heads=4", "--mesh.fsdp=2", "--mesh.tensor=4",
                                          "--data.source=synthetic"]), devices=devices)
    want = jax.tree.map(lambda a: a.sharding, abstract_state(setup)["params"])
    got = C.load_params(run_dir, sharding=want)
    _leaves_equal(saved[2], got)
    assert all(g.sharding == w for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert got["blocks"]["attn"]["q_dnh"].sharding.spec[2] == "tensor"
    over8 = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    with pytest.raises(ValueError, match=r"^sharding: params\.blocks\.\w+\.\w+ of shape \(4, "):
        C.load_params(run_dir, sharding=over8)


# ----------------------------------------------------------------------- hardware


@pytest.mark.parametrize("kind,key", [
    ("NVIDIA H100 80GB HBM3", "h100"),  # the SXM5 board's CUDA name
    ("NVIDIA H100 PCIe", "h100_pcie"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100_40gb"),
    ("TPU v5 lite", "tpu_v5e"),
    ("TPU v5", "tpu_v5p"),  # JAX's name for v5p (jax's Pallas TPU tests: "TPU v5" -> TPU_V5P)
    ("TPU v5p", "tpu_v5p"),
    ("cpu", None),
    ("TPU v4", None),
    ("TPU v6 lite", None),
    ("NVIDIA GH200 480GB", None),  # Grace Hopper: 96 GB HBM3 at 4 TB/s, not the H200's 141 GB at 4.8
    ("NVIDIA H100 NVL", None),  # 835 dense bf16 TFLOP/s, 94 GB, 3.9 TB/s
    ("NVIDIA H200 NVL", None),
    ("NVIDIA A100 80GB PCIe", None),  # 1,935 GB/s
    ("NVIDIA H800", None),
])
def test_by_device_kind_maps_jax_s_strings_to_their_own_entry(kind, key):
    assert H.by_device_kind(kind) is (H.HARDWARE[key] if key else None)


def test_datasheet_numbers():
    h100, h100p, h200, a40 = (H.HARDWARE[k] for k in ("h100", "h100_pcie", "h200", "a100_40gb"))
    assert (h100.bf16_flops, h100.hbm_bandwidth, h100.hbm_bytes) == (989e12, 3.35e12, 80 * 2**30)
    assert (h100p.bf16_flops, h100p.hbm_bandwidth, h100p.hbm_bytes) == (756e12, 2.0e12, 80 * 2**30)
    assert (h200.bf16_flops, h200.hbm_bandwidth) == (989e12, 4.8e12)
    # "141 GB" is GiB-scale like the H100's 80: nvidia-smi reports 143,771 MiB on an H200, and a
    # measured H200 step peaked at 128.5 GiB (docs/benchmarks.md), which 141e9 B x 0.92 did not hold.
    assert 140 * 2**30 < h200.hbm_bytes <= 141 * 2**30 and h200.usable_bytes > 128.5 * 2**30
    assert (a40.bf16_flops, a40.hbm_bandwidth, a40.hbm_bytes) == (312e12, 1.555e12, 40 * 2**30)
    for hw in H.HARDWARE.values():
        assert "datasheet" in hw.source or "cloud.google.com" in hw.source


def test_get_hardware_spellings_and_the_error_lists_every_entry():
    assert H.get_hardware("H100") is H.HARDWARE["h100"]
    assert H.get_hardware(" tpu v5e ") is H.HARDWARE["tpu_v5e"]
    assert H.get_hardware("TPU-v5p") is H.HARDWARE["tpu_v5p"]
    assert H.get_hardware("V5P") is H.HARDWARE["tpu_v5p"]
    assert H.get_hardware("h100-pcie") is H.HARDWARE["h100_pcie"]
    with pytest.raises(ValueError) as e:
        H.get_hardware("h300")
    assert str(e.value) == f"unknown hardware 'h300'; allowed: {', '.join(H.HARDWARE)}"
