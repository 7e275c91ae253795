"""Checkpoint audit: multi-host fallback and shared-directory checks, and a failed first save.

The multi-host tests start two processes of this file (`python tests/test_checkpoint_audit.py
...`, one CPU device each, jax.distributed over 127.0.0.1 with gloo) that save and restore a
small array sharded over both; a healthy pair takes a few seconds. Each pair is killed (SIGKILL:
JAX's preemption notifier keeps SIGTERM) at a deadline, so a hang fails instead of blocking.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from two_processes import N, check_step_1_and_train_on, join, run_pair, save_steps_1_and_2, value

DEADLINE_S = 90


# ------------------------------------------------------------------ a failed first save


class _DiskFull:  # a write future failing as TensorStore's does on a full disk
    def result(self, timeout=None):
        raise OSError(28, "No space left on device")


def _fail_saves_from(monkeypatch, first: int) -> None:
    """Every save of a step >= `first` fails in the background write of its state item."""
    import orbax.checkpoint as ocp

    original = ocp.StandardCheckpointHandler.async_save

    async def failing(self, directory, *args, **kwargs):
        futures = (await original(self, directory, *args, **kwargs)) or []
        step = int(Path(directory).parent.name.split(".")[0])  # <checkpoints>/<step>[.orbax-checkpoint-tmp]/state
        return [*futures, _DiskFull()] if step >= first else futures

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)


def _save_and_wait(ck, step: int) -> str | None:
    from scaling import checkpoint as C

    ck.save(step, {"w": value(step)}, {"loader": {"next_index": step}})
    try:
        ck.wait()
    except C.CheckpointError as e:
        return str(e)
    return None


def test_a_failed_save_without_any_complete_checkpoint_does_not_promise_a_resume(tmp_path, monkeypatch):
    """The message said "no checkpoint is complete, and a restart resumes from it"."""
    from scaling import checkpoint as C
    from scaling.config import load_config

    _fail_saves_from(monkeypatch, 1)
    ck = C.Checkpointer(tmp_path, load_config(None, []).checkpoint)
    msg = _save_and_wait(ck, 1)
    ck.close()
    assert msg is not None and "step 1" in msg and "No space left on device" in msg
    assert msg.endswith("no checkpoint is complete, and a restart trains from step 0"), msg
    assert C.complete_steps(tmp_path / "checkpoints") == []


def test_a_failed_save_keeps_the_checkpoint_that_keep_would_replace(tmp_path, monkeypatch):
    """keep=1: the old step goes only once a newer one is committed (docs/checkpoints.md), so the
    run that stops on a full disk still resumes from it, with its values."""
    from scaling import checkpoint as C
    from scaling.config import load_config

    _fail_saves_from(monkeypatch, 2)
    ck = C.Checkpointer(tmp_path, load_config(None, ["--checkpoint.keep=1"]).checkpoint)
    assert _save_and_wait(ck, 1) is None
    msg = _save_and_wait(ck, 2)
    ck.close()
    assert msg is not None and msg.endswith("the newest complete checkpoint is step 1, and a restart resumes from it")
    restored = _restore_here(tmp_path)
    assert restored.step == 1 and restored.meta["loader"] == {"next_index": 1}
    np.testing.assert_array_equal(np.asarray(restored.state["w"]), value(1))


# ------------------------------------------------------------------ two processes


def _pair(tmp_path: Path, tag: str, run_dirs: list[Path], phase: str, env_extra: dict | None = None):
    """Run two child processes to the end (or the deadline); (exit codes, logs)."""
    return run_pair(__file__, tmp_path, tag, run_dirs, phase, DEADLINE_S, env_extra)


def _restore_here(run_dir: Path, step: int | None = None):
    import jax

    from scaling import checkpoint as C
    from scaling.config import load_config

    ck = C.Checkpointer(run_dir, load_config(None, []).checkpoint)
    target = {"w": jax.ShapeDtypeStruct((N,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    restored = ck.restore(target, step)
    ck.close()
    return restored


def test_multihost_fallback_from_an_unreadable_step_leaves_every_process_agreeing(tmp_path):
    """Process 0 moves an unreadable step aside; the others reloaded their step list without
    waiting for that, still listed the step, skipped the collective save when training reached
    it again, and process 0 hung in it (then crashed). The move is slowed down here as on a
    filesystem whose directory move is a copy (a FUSE-mounted bucket); on a local disk the race
    is rarely lost."""
    from scaling import checkpoint as C

    run = tmp_path / "run"
    rcs, logs = _pair(tmp_path, "save", [run, run], "save")
    assert rcs == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert C.complete_steps(run / "checkpoints") == [1, 2]
    for f in (run / "checkpoints/2/state").rglob("*"):  # committed, but its files are gone
        if f.is_file() and f.name != C.COMMIT_SUCCESS_FILE:
            f.write_bytes(b"")

    rcs, logs = _pair(tmp_path, "restore", [run, run], "restore", {"AUDIT_SLOW_MOVE_S": "3"})
    assert rcs == [0, 0], "\n".join(log[-2000:] for log in logs)
    for pid in range(2):
        assert f"[{pid}] restored step 1, steps [1]" in logs[pid], logs[pid][-2000:]
    assert C.complete_steps(run / "checkpoints") == [1, 2]  # step 2 saved again, by both
    np.testing.assert_array_equal(np.asarray(_restore_here(run, 2).state["w"]), value(2))
    assert len(list((tmp_path / "run" / C.BROKEN_DIR).iterdir())) == 1


def test_multihost_run_directory_not_shared_is_named_at_once(tmp_path):
    """Each process with its own copy of the run directory (a --run_dir on each host's local
    disk): Orbax's first save hung for 10 minutes, then failed with "Timed out waiting for
    array_metadatas base directory creation". Now every process stops at once, naming it."""
    rcs, logs = _pair(tmp_path, "unshared", [tmp_path / "host0", tmp_path / "host1"], "save")
    assert all(rc not in (0, None, -9) for rc in rcs), (rcs, [log[-2000:] for log in logs])
    for pid in range(2):
        assert "do not see the files process 0 writes there" in logs[pid], logs[pid][-2000:]
        assert str(tmp_path / f"host{pid}" / "checkpoints") in logs[pid]
    assert not (tmp_path / "host1" / "checkpoints").exists() or not any((tmp_path / "host1" / "checkpoints").iterdir())


def _child(port: str, pid: int, run_dir: str, phase: str) -> None:
    import shutil

    import jax

    sharding, state = join(port, pid)
    from scaling import checkpoint as C
    from scaling.config import load_config

    cfg = load_config(None, ["--checkpoint.keep=5", "--checkpoint.async_save=false"]).checkpoint
    ck = C.Checkpointer(run_dir, cfg)
    if phase == "save":
        save_steps_1_and_2(ck, state)
    else:
        slow = float(os.environ.get("AUDIT_SLOW_MOVE_S", 0))
        if slow and pid == 0:
            move = shutil.move
            shutil.move = lambda *a, **k: (time.sleep(slow), move(*a, **k))[1]
        restored = ck.restore({"w": jax.ShapeDtypeStruct((N,), np.float32, sharding=sharding)})
        check_step_1_and_train_on(ck, restored, state, pid)
    ck.close()


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
