"""Checkpoint retention, restore order, damaged steps and exact data resume, against references
written from the documented behaviour (scaling/checkpoint.py's docstrings, CheckpointConfig's
comments: keep the `keep` most recent saves, plus every step that is a multiple of
`keep_period`; restore the newest complete step that reads, else the one before it).

Small pytrees of numpy arrays, no model: the whole file runs in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from scaling import checkpoint as C
from scaling import data as D
from scaling.config import load_config, to_dict

TINY = str(Path(__file__).resolve().parents[1] / "configs/models/tiny.yaml")
BIG = 8192  # elements: an array this size is stored in the OCDBT data files, not inline
TARGET = {"w": jax.ShapeDtypeStruct((3,), np.float32), "big": jax.ShapeDtypeStruct((BIG,), np.float32)}


def _state(step: int) -> dict:
    return {"w": np.array([step, step + 0.5, -step], np.float32), "big": np.arange(BIG, dtype=np.float32) * step}


def _ckpt_cfg(*overrides):
    return load_config(None, list(overrides)).checkpoint


def _save_steps(run_dir: Path, cfg, steps, meta=lambda s: {"loader": {"next_index": s}}) -> None:
    ck = C.Checkpointer(run_dir, cfg)
    for s in steps:
        ck.save(s, _state(s), meta(s))
    ck.close()


def _expected_kept(saved: list[int], keep: int, keep_period: int) -> list[int]:
    """The documented retention: the `keep` most recent saves, and every multiple of keep_period."""
    recent = set(saved[-keep:])
    periodic = {s for s in saved if keep_period and s % keep_period == 0}
    return sorted(recent | periodic)


def _damage(step_dir: Path, what: str) -> None:
    """'all': every file of the state item emptied; 'data': only its array chunks (the metadata
    still reads, so the failure comes in the restore itself: TensorStore's bare errors)."""
    if what == "all":
        files = [f for f in (step_dir / "state").rglob("*") if f.is_file()]
    else:
        files = [f for f in (step_dir / "state").glob("ocdbt.process_*/d/*") if f.is_file()]
    assert files
    for f in files:
        f.write_bytes(b"")


# ------------------------------------------------------------------ retention


@pytest.mark.parametrize("keep,keep_period,every,last", [(3, 5, 2, 22), (1, 0, 1, 6), (4, 3, 1, 9)])
def test_retention_keeps_the_documented_steps(tmp_path, keep, keep_period, every, last):
    cfg = _ckpt_cfg(f"--checkpoint.keep={keep}", f"--checkpoint.keep_period={keep_period}", f"--checkpoint.every={every}")
    ck = C.Checkpointer(tmp_path, cfg)
    saved = []
    for s in range(1, last + 1):
        if ck.should_save(s):
            assert ck.save(s, _state(s), {"loader": {"next_index": s}})
            saved.append(s)
    ck.close()
    assert saved == list(range(every, last + 1, every))
    assert C.complete_steps(tmp_path / "checkpoints") == _expected_kept(saved, keep, keep_period)


def test_retention_holds_across_a_resumed_run(tmp_path):
    """A restarted run's manager counts the steps already on disk: they do not pile up."""
    cfg = _ckpt_cfg("--checkpoint.keep=1", "--checkpoint.keep_period=4", "--checkpoint.every=1")
    _save_steps(tmp_path, cfg, range(1, 6))
    assert C.complete_steps(tmp_path / "checkpoints") == [4, 5]
    _save_steps(tmp_path, cfg, range(6, 10))
    assert C.complete_steps(tmp_path / "checkpoints") == _expected_kept(list(range(1, 10)), 1, 4) == [4, 8, 9]


def test_should_save_every_nth_step_and_never_when_off(tmp_path):
    def save_points(every: int) -> list[int]:
        ck = C.Checkpointer(tmp_path / str(every), _ckpt_cfg(f"--checkpoint.every={every}"))
        points = [s for s in range(1, 11) if ck.should_save(s)]
        ck.close()
        return points

    assert save_points(3) == [3, 6, 9] and save_points(1) == list(range(1, 11)) and save_points(0) == []


def test_a_step_already_on_disk_is_not_saved_again(tmp_path):
    """Both ways a step can be there already: this run just saved it (a preemption at a periodic
    save), or a previous run did (a fresh manager). No error, and the saved values stay."""
    cfg = _ckpt_cfg("--checkpoint.every=1", "--checkpoint.keep=5")
    ck = C.Checkpointer(tmp_path, cfg)
    assert ck.save(3, _state(3), {"loader": {"next_index": 3}})
    assert not ck.save(3, _state(99), {"loader": {"next_index": 99}}, force=True)
    ck.close()
    ck = C.Checkpointer(tmp_path, cfg)
    assert not ck.save(3, _state(77), {"loader": {"next_index": 77}}, force=True)
    restored = ck.restore(TARGET)
    ck.close()
    np.testing.assert_array_equal(restored.state["w"], _state(3)["w"])
    assert restored.meta["loader"] == {"next_index": 3}


def test_a_synchronous_save_is_on_disk_when_save_returns(tmp_path):
    """checkpoint.async_save=false: save() returns after the commit (no background write)."""
    ck = C.Checkpointer(tmp_path, _ckpt_cfg("--checkpoint.async_save=false", "--checkpoint.every=1"))
    for s in (1, 2, 3):
        ck.save(s, _state(s), {"loader": {"next_index": s}})
        assert not ck.is_saving() and C.complete_steps(tmp_path / "checkpoints")[-1] == s
    ck.close()

# ------------------------------------------------------------------ restore order


def test_restore_and_latest_step_pick_the_newest_step_numerically(tmp_path):
    """Steps 2, 9 and 10: as strings "9" sorts after "10"."""
    cfg = _ckpt_cfg("--checkpoint.every=1", "--checkpoint.keep=5")
    _save_steps(tmp_path, cfg, [2, 9, 10])
    ck = C.Checkpointer(tmp_path, cfg)
    assert ck.latest_step() == 10
    restored = ck.restore(TARGET)
    ck.close()
    assert restored.step == 10 and restored.meta["loader"] == {"next_index": 10}
    np.testing.assert_array_equal(restored.state["w"], _state(10)["w"])


def test_no_checkpoint_restores_nothing(tmp_path):
    ck = C.Checkpointer(tmp_path, _ckpt_cfg())
    assert ck.latest_step() is None and ck.restore(TARGET) is None
    ck.close()


@pytest.mark.parametrize("damage", ["all", "data"])
def test_every_step_unreadable_is_an_error_not_a_fresh_start(tmp_path, damage):
    """Returning None here would make a resumed run start again from step 0 in silence."""
    cfg = _ckpt_cfg("--checkpoint.every=1", "--checkpoint.keep=5")
    _save_steps(tmp_path, cfg, [1, 2])
    for s in (1, 2):
        _damage(tmp_path / "checkpoints" / str(s), damage)
    lines: list[str] = []
    ck = C.Checkpointer(tmp_path, cfg)
    with pytest.raises(C.CheckpointError, match=r"no readable checkpoint in .*: steps \[2, 1\] failed to restore"):
        ck.restore(TARGET, log=lines.append)
    ck.close()
    assert [line.split(" is unreadable")[0] for line in lines] == ["checkpoint: step 2", "checkpoint: step 1"]


@pytest.mark.parametrize("damage", ["all", "data"])
def test_an_unreadable_explicit_step_is_named_and_not_replaced(tmp_path, damage):
    """Asked for step 2 by number: an error naming it and the steps there are (was the raw
    JSONDecodeError / TensorStore Exception); neither another step nor a move aside."""
    cfg = _ckpt_cfg("--checkpoint.every=1", "--checkpoint.keep=5")
    _save_steps(tmp_path, cfg, [1, 2])
    _damage(tmp_path / "checkpoints/2", damage)
    ck = C.Checkpointer(tmp_path, cfg)
    with pytest.raises(C.CheckpointError, match=r"^step 2: the checkpoint .*checkpoints/2 is unreadable \(.*\); complete steps: \[1, 2\]$"):
        ck.restore(TARGET, step=2, log=lambda m: pytest.fail(f"fell back: {m}"))
    assert ck.restore(TARGET, step=1).step == 1
    ck.close()
    assert C.complete_steps(tmp_path / "checkpoints") == [1, 2] and not (tmp_path / C.BROKEN_DIR).exists()


# ------------------------------------------------------------ data resume


def test_loader_position_through_a_checkpoint_resumes_the_batches_exactly(tmp_path):
    """A run saves every 2 steps (keep 2) and stops after step 7 without a final save: the
    resumed loader continues from the newest kept step (6), and its batches 6.. are those of
    the definition (window w = tokens[w*S : w*S + S + 1], order = concatenated per-epoch
    permutations seeded by (seed, epoch)), rebuilt here without the loader."""
    from test_data_mutants import reference_batch

    tokens = np.random.default_rng(1).integers(0, 500, 5 * 8 + 3).astype(np.uint16)  # 5 windows of 9
    seq_len, batch, seed = 8, 2, 7
    cfg = _ckpt_cfg("--checkpoint.every=2", "--checkpoint.keep=2")
    ck = C.Checkpointer(tmp_path, cfg)
    loader = D.Batches(tokens, seq_len, batch, seed)
    for step in range(1, 8):
        next(loader)
        if ck.should_save(step):
            ck.save(step, _state(step), {"loader": loader.state()})
    ck.close()
    assert C.complete_steps(tmp_path / "checkpoints") == [4, 6]

    ck = C.Checkpointer(tmp_path, cfg)
    restored = ck.restore(TARGET)
    ck.close()
    resumed = D.Batches(tokens, seq_len, batch, seed)
    resumed.restore(json.loads(json.dumps(restored.meta["loader"])))
    assert restored.step == 6
    for i in range(6, 15):  # into the fourth epoch
        np.testing.assert_array_equal(next(resumed), reference_batch(tokens, seq_len, batch, seed, i), err_msg=f"batch {i}")


# ------------------------------------------------------------ shapes and meta


def test_shape_mismatches_lists_each_kind_once():
    """Hand-written trees: a shape that differs, a leaf only in the config's model, one only in
    the checkpoint; optimizer moments are left out while params differ."""
    leaf = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)  # noqa: E731
    target = {"params": {"a": leaf(2, 3), "b": leaf(4), "new": leaf(1)}, "opt_state": {"mu": {"a": leaf(2, 3)}}}
    saved = {"params": {"a": leaf(2, 4), "b": leaf(4), "old": leaf(5)}, "opt_state": {"mu": {"a": leaf(2, 4)}}}
    assert C.shape_mismatches(target, saved) == [
        "params.a: config shape (2, 3), checkpoint shape (2, 4)",
        "params.new: in the config's model but not in the checkpoint",
        "params.old: in the checkpoint but not in the config's model",
    ]
    only_opt = {"params": {"a": leaf(2, 3)}, "opt_state": {"mu": {"a": leaf(2, 4)}}}
    assert C.shape_mismatches({"params": {"a": leaf(2, 3)}, "opt_state": {"mu": {"a": leaf(2, 3)}}}, only_opt) == [
        "opt_state.mu.a: config shape (2, 3), checkpoint shape (2, 4)"
    ]
    assert C.shape_mismatches(target, target) == []


def test_meta_that_is_not_an_object_or_has_no_config_is_named(tmp_path):
    step = tmp_path / "5"
    (step / "meta").mkdir(parents=True)
    (step / "meta/metadata").write_text("[1, 2]")
    with pytest.raises(C.CheckpointError, match=r"5/meta/metadata is not a JSON object$"):
        C.step_config(step)
    (step / "meta/metadata").write_text('{"loader": {"next_index": 5}}')
    with pytest.raises(C.CheckpointError, match=r"5/meta/metadata holds no `config`$"):
        C.step_config(step)


def test_load_config_of_a_run_is_its_latest_step_s(tmp_path):
    """Two steps saved with different configs (a run resumed with a new learning rate)."""
    cfgs = {s: load_config(TINY, [f"--optimizer.learning_rate={lr}"]) for s, lr in ((1, 1e-3), (2, 5e-4))}
    _save_steps(tmp_path, cfgs[1].checkpoint, [1, 2], meta=lambda s: {"config": to_dict(cfgs[s])})
    assert C.load_config_of(tmp_path).optimizer.learning_rate == 5e-4


def test_params_of_a_state_without_params_are_refused_naming_the_item(tmp_path):
    _save_steps(tmp_path, _ckpt_cfg(), [1])
    model_cfg = load_config(TINY, []).model
    with pytest.raises(C.CheckpointError, match=r"checkpoints/1/state holds no `params`"):
        C.load_params(tmp_path, model_cfg, log=lambda m: None)


def test_export_dtype_is_checked_by_the_api_too(tmp_path):
    with pytest.raises(C.CheckpointError, match=r"^--dtype 'int8': allowed float32, bfloat16, float16$"):
        C.export_params(tmp_path / "run", tmp_path / "out", format="hf", dtype="int8")
    with pytest.raises(C.CheckpointError, match=r"^--format 'npz': allowed orbax, hf$"):
        C.export_params(tmp_path / "run", tmp_path / "out", format="npz")
