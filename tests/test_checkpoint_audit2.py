"""Checkpoint audit 2: processes that agree on one step, training on from an older step, and
steps without commit_success.txt.

The two-process test starts two processes of this file (`python tests/test_checkpoint_audit2.py
...`, one CPU device each, jax.distributed over 127.0.0.1 with gloo) that save and restore a
small array sharded over both, as tests/test_checkpoint_audit.py does; a healthy pair takes a few
seconds, and each pair is killed (SIGKILL: JAX's preemption notifier keeps SIGTERM) at a deadline.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from two_processes import N, check_step_1_and_train_on, join, run_pair, save_steps_1_and_2, value
import pytest

DEADLINE_S = 60


def _checkpointer(run_dir: Path, *flags: str):
    from scaling import checkpoint as C
    from scaling.config import load_config

    return C.Checkpointer(run_dir, load_config(None, ["--checkpoint.keep=10", *flags]).checkpoint)


def _target():
    import jax

    return {"w": jax.ShapeDtypeStruct((N,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}


def _saved(run_dir: Path, steps, scale: float = 1.0) -> None:
    ck = _checkpointer(run_dir)
    for s in steps:
        assert ck.save(s, {"w": value(s) * scale}, {"loader": {"next_index": s}})
    ck.close()


def _restore_latest(run_dir: Path, lines: list | None = None):
    ck = _checkpointer(run_dir)
    try:
        return ck.restore(_target(), log=(lines.append if lines is not None else lambda _: None))
    finally:
        ck.close()


# ------------------------------------------------- training on from an explicitly restored older step


def test_training_on_from_an_older_restored_step_saves_for_real_and_resumes_from_it(tmp_path):
    """restore(step=2) with steps 3 and 4 on disk, then training on: the save of step 3 was a
    no-op (the step existed; Orbax also skips any step older than its newest), so nothing of the
    new trajectory was saved and a restart resumed from the old step 4. Now the first save moves
    the newer steps to checkpoints.superseded/ (saying so) and saves; a restart resumes from it."""
    from scaling import checkpoint as C

    _saved(tmp_path, [1, 2, 3, 4])
    ck = _checkpointer(tmp_path)
    lines: list[str] = []
    assert ck.restore(_target(), step=2, log=lines.append).step == 2
    assert C.complete_steps(tmp_path / "checkpoints") == [1, 2, 3, 4]  # a restore alone changes nothing on disk
    assert ck.save(3, {"w": value(3) * -1}, {"loader": {"next_index": 30}})
    ck.close()
    assert C.complete_steps(tmp_path / "checkpoints") == [1, 2, 3]
    moved = [line for line in lines if "moved steps [3, 4]" in line]
    assert len(moved) == 1 and str(tmp_path / C.SUPERSEDED_DIR) in moved[0], lines
    (kept,) = (tmp_path / C.SUPERSEDED_DIR).iterdir()
    assert sorted(p.name for p in kept.iterdir()) == ["3", "4"]  # kept, not deleted

    restored = _restore_latest(tmp_path)
    assert restored.step == 3 and restored.meta["loader"] == {"next_index": 30}
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), value(3) * -1)


def test_saving_a_step_older_than_one_on_disk_without_restoring_it_says_what_to_do(tmp_path):
    """Without a restore of the older step, Orbax skipped the save and `save` returned False."""
    from scaling import checkpoint as C

    _saved(tmp_path, [1, 3])
    ck = _checkpointer(tmp_path)
    try:
        with pytest.raises(C.CheckpointError, match=r"^step 2: not saved: .* holds newer step\(s\) \[3\].*"
                                                    r"restore\(step=\.\.\.\)"):
            ck.save(2, {"w": value(2)}, {"loader": {"next_index": 2}})
    finally:
        ck.close()
    assert C.complete_steps(tmp_path / "checkpoints") == [1, 3]


# ------------------------------------------------- steps without commit_success.txt


def test_a_finished_step_without_commit_success_is_kept_and_restored(tmp_path):
    """Orbax 0.12.4 on a local disk finishes a save by renaming `S.orbax-checkpoint-tmp` to `S` and
    counts any such `S` as finished without reading commit_success.txt; Orbax versions before it
    wrote none there. Such a step was removed at the next start as a partial save (rmtree), and
    the run resumed from an older step. Only an empty step directory is a leftover to remove; a
    step that turns out unreadable is moved aside, never deleted."""
    from scaling import checkpoint as C

    _saved(tmp_path, [1, 2])
    ckpts = tmp_path / "checkpoints"
    for f in (ckpts / "2").rglob(C.COMMIT_SUCCESS_FILE):  # as an older Orbax wrote it (nor the step's
        f.unlink()  # _CHECKPOINT_METADATA, which Orbax added later still: not needed to restore either)
    (ckpts / "2" / "_CHECKPOINT_METADATA").unlink()
    (ckpts / "7").mkdir()  # nothing of a save
    (ckpts / "9").mkdir()
    (ckpts / "9" / "stray").write_text("x")  # not readable as a checkpoint, but not ours to delete
    assert [p.name for p in C.partial_checkpoints(ckpts)] == ["7"]
    assert C.complete_steps(ckpts) == [1, 2, 9]

    lines: list[str] = []
    restored = _restore_latest(tmp_path, lines)
    assert restored.step == 2
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), value(2))
    assert C.complete_steps(ckpts) == [1, 2] and not (ckpts / "7").exists()
    assert len(lines) == 1 and lines[0].startswith("checkpoint: step 9 is unreadable"), lines
    (aside,) = (tmp_path / C.BROKEN_DIR).iterdir()
    assert (aside / "stray").read_text() == "x"


# ------------------------------------------------- two processes, damage in one process's shards


def _pair(tmp_path: Path, tag: str, run_dir: Path, phase: str):
    """Run two child processes to the end (or the deadline); (exit codes, logs)."""
    return run_pair(__file__, tmp_path, tag, [run_dir, run_dir], phase, DEADLINE_S)


def test_multihost_damage_in_one_process_shards_makes_every_process_take_the_same_step(tmp_path):
    """Step 2's data files of process 1 only are damaged. Process 1 failed to read it and fell back
    while process 0 had read it: their barriers no longer matched (process 0 even moved the good
    step aside), and both hung until JAX's 5-minute barrier timeout. Now every process learns that
    process 1 cannot read step 2: an explicit restore(step=2) fails on both naming process 1, and
    restore() takes step 1 on both."""
    from scaling import checkpoint as C

    run = tmp_path / "run"
    rcs, logs = _pair(tmp_path, "save", run, "save")
    assert rcs == [0, 0], "\n".join(log[-2000:] for log in logs)
    files = list((run / "checkpoints/2/state/ocdbt.process_1").rglob("*"))  # Orbax 0.12.4's per-process OCDBT
    data = [f for f in files if f.is_file() and f.parent.name == "d"]
    assert data, files
    for f in data:
        f.write_bytes(b"")

    rcs, logs = _pair(tmp_path, "restore", run, "restore")
    assert rcs == [0, 0], "\n".join(log[-3000:] for log in logs)
    for pid in range(2):
        refused = f"[{pid}] restore(step=2): step 2: the checkpoint {run / 'checkpoints/2'} is unreadable on process(es) [1]"
        assert refused in logs[pid], logs[pid][-3000:]
        assert f"[{pid}] restored step 1, steps [1]" in logs[pid], logs[pid][-3000:]
    assert "checkpoint: step 2 is unreadable on process(es) [1] (see their stderr for the reason); moved it" in logs[0]
    assert "[process 1] checkpoint: step 2 in" in logs[1] and "is unreadable here (" in logs[1]
    assert C.complete_steps(run / "checkpoints") == [1, 2]  # step 2 saved again, by both
    np.testing.assert_array_equal(np.asarray(_restore_latest(run).state["w"]), value(2))
    assert len(list((run / C.BROKEN_DIR).iterdir())) == 1


def _child(port: str, pid: int, run_dir: str, phase: str) -> None:
    import jax

    sharding, state = join(port, pid)
    from scaling import checkpoint as C

    ck = _checkpointer(Path(run_dir), "--checkpoint.async_save=false")
    if phase == "save":
        save_steps_1_and_2(ck, state)
    else:
        target = {"w": jax.ShapeDtypeStruct((N,), np.float32, sharding=sharding)}
        try:
            ck.restore(target, step=2)
        except C.CheckpointError as e:
            print(f"[{pid}] restore(step=2): {e}", flush=True)
        restored = ck.restore(target, log=lambda msg: print(msg, flush=True) if pid == 0 else None)
        check_step_1_and_train_on(ck, restored, state, pid)
    ck.close()


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
