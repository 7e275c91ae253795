"""Orbax checkpoints in the run directory: save, keep, resume, reshard, export.

Layout: `<run_dir>/checkpoints/<step>/{state, meta}`. `state` holds params, optimizer
state, step, RNG key and the non-finite counters as one pytree (Orbax StandardSave,
restored straight into the target shardings, so a checkpoint written on one mesh restores
onto any other). `meta` is JSON: the data loader's position and the resolved config.

How Orbax 0.12.4 marks a complete save (orbax/checkpoint/_src/path/atomicity.py): our
directory is always a local (POSIX) path, for which Orbax uses AtomicRenameTemporaryPath: step
S is written into `S.orbax-checkpoint-tmp`, `commit_success.txt` is written into it once every
item is on disk, and the directory is then renamed to `S`. The rename is what completes a save:
Orbax 0.12.4 counts any step directory whose name has no `.orbax-checkpoint-tmp` in it as
finished (validate_atomic_rename_final_path) and never reads `commit_success.txt` there, and
older Orbax versions wrote none. So here too a step directory `S` is complete whether or not it
holds `commit_success.txt`; only `*.orbax-checkpoint-tmp*` (a save cut off before its rename)
and an empty `S` (nothing any Orbax version leaves after a save) are partial: the next start
reports them, removes them and resumes from the latest complete step. A complete-looking step
that fails to restore is moved to `checkpoints.unreadable/`, never deleted.

Multi-host: every process restores its own shards, so damage can be in one process's files
only. All processes try the same steps in the same order and agree after each try (a
collective): a step is taken only when every process read it, so they never resume from
different steps.

Saving is asynchronous: `save` returns once the arrays are copied to host memory and the
write to disk runs on a background thread while training continues.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from scaling.config import CheckpointConfig, Config, ModelConfig, config_from_dict, dump_yaml

logging.getLogger("absl").setLevel(logging.WARNING)

# Orbax 0.12.4's markers (orbax.checkpoint._src.path.atomicity_types); a test pins them.
TMP_DIR_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_SUCCESS_FILE = "commit_success.txt"
BROKEN_DIR = "checkpoints.unreadable"  # complete-looking checkpoints that failed to restore
SUPERSEDED_DIR = "checkpoints.superseded"  # steps newer than an explicitly restored one, once training goes on


class CheckpointError(RuntimeError):
    pass


class CheckpointMismatchError(ValueError):
    """The config's model does not fit the checkpoint; the message names each parameter."""


def _empty_dir(p: Path) -> bool:
    try:
        return not any(p.iterdir())
    except OSError:  # (unreadable: not known to be empty, so never removed as such)
        return False


def partial_checkpoints(directory: str | Path) -> list[Path]:
    """What an interrupted save left behind (see the module docstring): `*.orbax-checkpoint-tmp*`
    entries, and step directories with nothing in them. Removing them loses nothing."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        if TMP_DIR_SUFFIX in p.name:
            out.append(p)
        elif p.name.isdigit() and p.is_dir() and _empty_dir(p):
            out.append(p)
    return sorted(out)


def complete_steps(directory: str | Path) -> list[int]:
    """Steps whose save was completed, ascending: step directories Orbax 0.12.4 counts as
    finished (renamed from their temporary name), with or without `commit_success.txt`
    (Orbax versions before it wrote none on a local filesystem); not empty ones."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir() and not _empty_dir(p))


def read_meta(step_dir: str | Path) -> dict:
    """The JSON `meta` item of one step (Orbax JsonSave writes it as `meta/metadata`).

    Raises CheckpointError naming the file when it is missing or not a JSON object."""
    path = Path(step_dir) / "meta" / "metadata"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the step's loader position and config)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({_one_line(e)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return meta


def step_config(step_dir: str | Path) -> Config:
    """The resolved config a training step was saved with (its `meta`)."""
    meta = read_meta(step_dir)
    if "config" not in meta:
        raise CheckpointError(f"{Path(step_dir) / 'meta' / 'metadata'} holds no `config`")
    try:
        return config_from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{Path(step_dir) / 'meta' / 'metadata'}: its config is invalid ({_one_line(e)})") from None


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    meta: dict


# ------------------------------------------------------------------ shape checking


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey (namedtuples), SequenceKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flat_by_name(tree: Any) -> dict[str, Any]:
    """{'params.blocks.attn.q_dnh': leaf}. Orbax metadata turns namedtuples (optax states)
    into dicts, so paths are compared by key names, not by key types."""
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def shape_mismatches(target: Any, saved: Any) -> list[str]:
    """One line per leaf whose shape differs or that exists on one side only.

    When parameters differ, only those are listed (the optimizer's moments repeat them).
    """
    flat_t, flat_s = _flat_by_name(target), _flat_by_name(saved)
    out = []
    for name, leaf in flat_t.items():
        if name not in flat_s:
            out.append(f"{name}: in the config's model but not in the checkpoint")
            continue
        want, got = tuple(leaf.shape), tuple(flat_s[name].shape)
        if want != got:
            out.append(f"{name}: config shape {want}, checkpoint shape {got}")
    for name in sorted(flat_s.keys() - flat_t.keys()):
        out.append(f"{name}: in the checkpoint but not in the config's model")
    params_only = [m for m in out if m.startswith("params.")]
    return params_only or out


def _one_line(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first}"


def _model_diff(saved_cfg: dict | None, cfg: dict | None, section: str = "model") -> str:
    if not saved_cfg or not cfg:
        return ""
    a, b = saved_cfg.get(section, {}), cfg.get(section, {})
    diff = [f"{section}.{k}: config {b.get(k)!r}, checkpoint {a.get(k)!r}" for k in b if a.get(k) != b.get(k)]
    return (f"\n  {section} config differences:\n    " + "\n    ".join(diff)) if diff else ""


def _optimizer_hint(saved_cfg: dict | None, cfg: dict | None) -> str:
    """The optimizer's state is shaped by its config, not by the model: name what changed it."""
    diff = _model_diff(saved_cfg, cfg, "optimizer")
    clip = [(c or {}).get("optimizer", {}).get("clip_norm") for c in (saved_cfg, cfg)]
    if None not in clip and (clip[0] == 0) != (clip[1] == 0):
        diff += ("\n  optimizer.clip_norm=0 leaves the clipping stage out of the optimizer (and its state); to "
                 "resume without clipping, give a clip_norm too large to bind (e.g. 1e9) instead")
    return diff


# ---------------------------------------------------------------------- the manager


class Checkpointer:
    """Periodic asynchronous saves into `<run_dir>/checkpoints`, keep-last-K (+ every M-th)."""

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig):
        self.run_dir = Path(run_dir).absolute()
        self.directory = self.run_dir / "checkpoints"
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_period or None,
            enable_async_checkpointing=cfg.async_save,
            create=True,
            cleanup_tmp_directories=False,  # we report partial saves (below) before removing them
        )
        self._check_shared()
        # A partial save is never restorable; removing it lets the same step be saved again.
        self.partial = partial_checkpoints(self.directory)
        if jax.process_index() == 0:
            for p in self.partial:
                shutil.rmtree(p, ignore_errors=True)
        # Handlers named up front, so a fresh manager (a resumed run) can read item metadata.
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        # Restores go through the items' handlers, not the manager: its restore ends in a barrier
        # that a process whose read failed never reaches (see `restore`).
        self._readers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._last_saved: int | None = None
        self._unchecked: int | None = None  # the step of the last save whose outcome is not known yet
        self._superseded: tuple[int, list[int]] | None = None  # (k, steps newer) after `restore(step=k)`
        self._log: Callable[[str], None] = print

    def _check_shared(self) -> None:
        """Multi-host: every process must see the directory process 0 writes to (one shared
        filesystem). Otherwise Orbax's first save hung for 10 minutes and then failed with
        "Timed out waiting for array_metadatas base directory creation" on the others."""
        if jax.process_count() == 1:
            return
        import numpy as np
        from jax.experimental import multihost_utils

        token = int(multihost_utils.broadcast_one_to_all(np.int32(uuid.uuid4().int % 2**31)))
        marker = self.directory / f".shared-by-all-processes-{token}"  # (a new name: nothing stale matches)
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            marker.touch()
        ocp.multihost.sync_global_processes(f"scaling_checkpoint_shared_{token}")
        seen = multihost_utils.process_allgather(np.int32(marker.exists()))
        ocp.multihost.sync_global_processes(f"scaling_checkpoint_shared_checked_{token}")
        if jax.process_index() == 0:
            marker.unlink()
        missing = [i for i, ok in enumerate(np.asarray(seen).ravel()) if not ok]
        if missing:  # (raised on every process alike: none is left waiting in a collective)
            raise CheckpointError(f"{self.directory}: process(es) {missing} do not see the files process 0 writes "
                                  "there; every process of a multi-host run needs the run directory on one shared "
                                  "filesystem (give --run_dir a path on it)")

    def latest_step(self) -> int | None:
        steps = complete_steps(self.directory)
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Start saving `state` at `step`; returns once the arrays are on the host.

        A step saved already (a periodic save at the step a preemption arrived) is not
        saved again: Orbax would raise StepAlreadyExistsError.

        The first save after `restore(step=k)` moves the steps newer than k that were on disk
        then (another trajectory's) to `<run_dir>/checkpoints.superseded/`, saying so: Orbax
        skips saving a step older than the newest it knows, and a restart would resume from
        them. Saving a step older than one on disk otherwise raises CheckpointError.
        """
        if step == self._last_saved:
            return False
        self.wait()  # (Orbax waits for the previous save here too; this names its failure)
        if self._superseded is not None:
            self._move_superseded()
        steps = list(self.manager.all_steps())
        newer = [s for s in steps if s > step]
        if newer:
            raise CheckpointError(
                f"step {step}: not saved: {self.directory} holds newer step(s) {newer}, and Orbax skips a save "
                f"older than its newest step; to train on from an older step, restore it with "
                f"restore(step=...) first (the newer steps are then moved to {self.run_dir / SUPERSEDED_DIR} at "
                f"the first save), or move the newer steps out of {self.directory}")
        if step in steps:
            return False
        self._last_saved = self._unchecked = step
        try:
            started = self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=force,
            )
        except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise bare Exceptions (a full disk: ValueError)
            raise self._save_failed(e) from e
        if not self.cfg.async_save:
            self._unchecked = None
        return started

    def should_save(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def is_saving(self) -> bool:
        return self.manager.is_saving_in_progress()

    def check_compatible(self, abstract_state: Any, step: int, config: dict | None = None, saved: Any = None) -> None:
        """Raise CheckpointMismatchError naming each leaf whose shape differs from the config's."""
        saved = self.manager.item_metadata(step)["state"] if saved is None else saved
        mismatches = shape_mismatches(abstract_state, saved)
        if mismatches:
            try:
                saved_cfg = read_meta(self.directory / str(step)).get("config")
            except CheckpointError:
                saved_cfg = None
            if all(m.startswith("opt_state.") for m in mismatches):  # (the params fit: the optimizer changed)
                head = f"the optimizer's state differs in structure ({len(mismatches)} leaves), e.g.:\n  "
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory / str(step)} does not match the config: " + head
                    + "\n  ".join(mismatches[:3]) + _optimizer_hint(saved_cfg, config)
                )
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} does not match the config:\n  "
                + "\n  ".join(mismatches)
                + _model_diff(saved_cfg, config)
            )

    def restore(
        self,
        abstract_state: Any,
        step: int | None = None,
        *,
        config: dict | None = None,
        log: Callable[[str], None] | None = None,
    ) -> Restored | None:
        """Restore into `abstract_state`'s shapes, dtypes and shardings (any mesh).

        Without `step`, the latest complete checkpoint; one that fails to read is reported,
        moved to `<run_dir>/checkpoints.unreadable/` and the one before it is tried. An
        explicit `step` that fails to read raises CheckpointError naming it (nothing is moved).
        A shape mismatch with the config raises CheckpointMismatchError naming the leaves.

        Nothing on disk changes for an explicit `step` older than the newest one; the first
        `save` after it moves the newer steps aside (see `save`).

        Multi-host: every process reads its own shards. A step counts as readable only when
        every process read it (they agree after each try), so all restore the same step; the
        processes that failed print their reason on stderr, and the error or the `log` line
        names them.
        """
        log = log or print
        self._log = log
        have = _steps_of_process_0(self.directory)  # (one list for all: they try the same steps)
        if step is not None and step not in have:
            raise CheckpointError(f"step {step}: no complete checkpoint of that step in {self.directory}; "
                                  f"have {have}")
        failed = []
        for s in [step] if step is not None else have[::-1]:
            restored, why, where = self._read_step(abstract_state, s, config)
            if restored is not None:
                newer = [n for n in have if n > s]
                self._superseded = (s, newer) if step is not None and newer else None
                return restored
            if step is not None:
                raise CheckpointError(f"step {s}: the checkpoint {self.directory / str(s)} is unreadable{where} "
                                      f"({why}); complete steps: {have}")
            failed.append(s)
            log(f"checkpoint: step {s} is unreadable{where} ({why}); moved it to {self._move_aside(s)}")
        if failed:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory}: steps {failed} failed to restore and were "
                f"moved to {self.run_dir / BROKEN_DIR}; start again to train from scratch"
            )
        return None

    def _read_step(self, abstract_state: Any, step: int, config: dict | None) -> tuple[Restored | None, str, str]:
        """(Restored, "", "") when every process read `step`; else (None, why, where): the
        reason (this process's own, if it failed) and " on process(es) [..]" when multi-host.
        Raises CheckpointMismatchError (on every process) when the config does not fit."""
        step_dir = self.directory / str(step)
        mine: Exception | None = None  # this process's failure
        mismatch: CheckpointMismatchError | None = None
        try:
            saved = self.manager.item_metadata(step)["state"]
            if saved is None:
                raise CheckpointError("no readable metadata for the `state` item")
        except Exception as e:  # noqa: BLE001 - unreadable metadata: report, fall back
            mine = e
        else:
            try:
                self.check_compatible(abstract_state, step, config, saved)
            except CheckpointMismatchError as e:
                mismatch = e
        codes = _every_process(2 if mismatch else 1 if mine else 0)
        if 2 in codes:
            if mismatch is not None:
                raise mismatch
            which = [i for i, c in enumerate(codes) if c == 2]
            raise CheckpointMismatchError(f"checkpoint {step_dir} does not match the config on process(es) {which} "
                                          "(their errors name the leaves)")
        if not any(codes):  # the metadata fits everywhere: read the arrays, each process its shards
            try:
                restored = Restored(
                    step,
                    self._readers["state"].restore(step_dir / "state", args=ocp.args.StandardRestore(abstract_state)),
                    self._readers["meta"].restore(step_dir / "meta", args=ocp.args.JsonRestore()),
                )
            except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise bare Exceptions on bad data
                mine = e
            codes = _every_process(1 if mine else 0)
            if not any(codes):
                return restored, "", ""
        bad = [i for i, c in enumerate(codes) if c]
        where = f" on process(es) {bad}" if jax.process_count() > 1 else ""
        if mine is not None and jax.process_index() != 0:  # (only process 0 logs: say why here)
            print(f"[process {jax.process_index()}] checkpoint: step {step} in {self.directory} is unreadable here "
                  f"({_one_line(mine)})", file=sys.stderr, flush=True)
        why = _one_line(mine) if mine is not None else "see their stderr for the reason"
        return None, why, where

    def _move_aside(self, step: int) -> Path:
        dest = self.run_dir / BROKEN_DIR / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), dest)
        # Every process reloads only after the move: one that reloaded before still listed the
        # step, skipped its collective save when training reached it again, and the others hung.
        ocp.multihost.sync_global_processes(f"scaling_checkpoint_move_aside_{step}")
        self.manager.reload()
        return dest

    def _move_superseded(self) -> None:
        """The steps newer than the one `restore(step=k)` returned, out of the way of this run's
        saves (every process calls this from `save`, at the same step)."""
        (restored, steps), self._superseded = self._superseded, None
        dest = self.run_dir / SUPERSEDED_DIR / time.strftime("%Y%m%d-%H%M%S")
        if jax.process_index() == 0:
            dest.mkdir(parents=True, exist_ok=True)
            for n in steps:
                if (self.directory / str(n)).exists():
                    to = dest / str(n)
                    while to.exists():  # (the same steps superseded twice within a second)
                        to = to.with_name(to.name + "+")
                    shutil.move(str(self.directory / str(n)), to)
        ocp.multihost.sync_global_processes(f"scaling_checkpoint_superseded_{restored}_{steps[-1]}")
        self.manager.reload()
        self._log(f"checkpoint: moved steps {steps} (newer than step {restored}, restored with restore(step=...): "
                  f"another trajectory's) to {dest}; this run's saves replace them, and a restart resumes from those")

    def check(self) -> None:
        """Raise CheckpointError if the last asynchronous save has failed; never waits for one
        still being written. (Orbax itself tells only when the next save or a wait starts: a full
        disk went unnoticed for a whole `checkpoint.every` steps, that could then not be saved.)"""
        if self._unchecked is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in progress; CheckpointError naming its step if it failed."""
        step, self._unchecked = self._unchecked, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(e, step) from e

    def _save_failed(self, e: Exception, step: int | None = None) -> CheckpointError:
        step = self._unchecked if step is None else step
        latest = self.latest_step()
        kept = (f"the newest complete checkpoint is step {latest}, and a restart resumes from it" if latest is not None
                else "no checkpoint is complete, and a restart trains from step 0")
        # The whole message on one line: Orbax puts the OS's reason ("No space left on device") last.
        why = " ".join(f"{type(e).__name__}: {e}".split())
        return CheckpointError(f"saving the checkpoint of step {step} in {self.directory} failed ({why}); "
                               f"{kept}")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()
            for reader in self._readers.values():
                reader.close()


def _every_process(code: int) -> list[int]:
    """Each process's `code`, by process index (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return [code]
    import numpy as np
    from jax.experimental import multihost_utils

    return [int(c) for c in np.asarray(multihost_utils.process_allgather(np.int32(code))).ravel()]


def _steps_of_process_0(directory: Path) -> list[int]:
    """complete_steps as process 0 lists them, on every process (a collective), so that all
    try the same steps in the same order even when a shared filesystem shows them late."""
    steps = complete_steps(directory)
    if jax.process_count() == 1:
        return steps
    import numpy as np
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(steps))))
    if n == 0:
        return []
    mine = np.array(steps if jax.process_index() == 0 else [0] * n, np.int32)
    return [int(x) for x in np.asarray(multihost_utils.broadcast_one_to_all(mine))]


# -------------------------------------------------------------------- params export


def abstract_params(model_cfg: ModelConfig) -> dict:
    """The model's parameter tree (pure dict of ShapeDtypeStructs), without allocating it."""
    from flax import nnx

    from scaling.model import Transformer

    model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(params=0)))
    return nnx.to_pure_dict(nnx.state(model))  # the same tree as the train state's "params"


def _params_target(model_cfg: ModelConfig, sharding: Any) -> dict:
    """The params' ShapeDtypeStructs laid out by `sharding` (one for all, or a tree of them).

    A sharding that does not divide a parameter's shape is refused here, naming the
    parameter, before anything is read."""
    target = abstract_params(model_cfg)
    if not isinstance(sharding, dict):
        sharding = jax.tree.map(lambda _: sharding, target)

    def leaf(path, a, s):
        try:
            s.shard_shape(a.shape)
        except ValueError as e:
            name = ".".join(_key_name(k) for k in path)
            raise ValueError(f"sharding: params.{name} of shape {tuple(a.shape)}: {_one_line(e)}") from None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    return jax.tree_util.tree_map_with_path(leaf, target, sharding)


def _read_params(state_dir: Path, target: dict, *, under: str | None) -> dict:
    """Params only (no optimizer state) from an Orbax pytree directory into `target`
    (`_params_target`), with a shape check."""
    item = {under: target} if under else target
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # quiet: a training step's `state` item has no step metadata file
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            saved = ckptr.metadata(state_dir).item_metadata
            if saved is None:  # Orbax answers None where the tree's metadata cannot be read
                raise CheckpointError(f"{state_dir} holds no readable tree metadata")
            saved = saved.tree
            if under and under not in saved:
                raise CheckpointError(f"{state_dir} holds no `{under}`")
            saved = {under: saved[under]} if under else saved
            mismatches = shape_mismatches(item, saved)
            if mismatches:
                raise CheckpointMismatchError(
                    f"{state_dir} does not match the model config:\n  " + "\n  ".join(mismatches)
                )
            restore_args = ocp.checkpoint_utils.construct_restore_args(item)
            restored = ckptr.restore(
                state_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
            )
    finally:
        absl.setLevel(level)
    return restored[under] if under else restored


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _restore_run_params(run_dir: Path, step: int | None, model_cfg: ModelConfig | None, sharding: Any,
                        log: Callable[[str], None], *, need_config: bool) -> tuple[int, dict, Config | None]:
    """(step, params, the step's config) from a run directory's training checkpoints.

    `step` None: the latest complete checkpoint; partial saves (not committed) are named
    through `log` and skipped, and a complete-looking one that cannot be read is reported
    through `log` and the one before it is tried (as a resumed run does; nothing is moved).
    An explicit `step` that cannot be read raises. A model that does not fit raises
    CheckpointMismatchError at once (older steps of the run would not fit either).
    """
    ckpt_dir = run_dir / "checkpoints"
    steps = complete_steps(ckpt_dir)
    partial = partial_checkpoints(ckpt_dir)
    if not steps:
        extra = f" (partial saves, never committed: {', '.join(p.name for p in partial)})" if partial else ""
        raise CheckpointError(f"no complete checkpoint in {ckpt_dir}{extra}")
    if step is not None and step not in steps:
        raise CheckpointError(f"step {step}: no complete checkpoint of that step in {ckpt_dir}; have {steps}")
    if step is None:
        for p in partial:
            log(f"checkpoint: ignoring partial save {p} (not committed: interrupted, or still being written)")
    failed = []
    for s in [step] if step is not None else steps[::-1]:
        step_dir = ckpt_dir / str(s)
        try:
            cfg = step_config(step_dir) if need_config or model_cfg is None else None
        except CheckpointError as e:
            err = e
        else:
            target = _params_target(model_cfg or cfg.model, sharding)  # a bad sharding is the caller's: raise
            try:
                return s, _read_params(step_dir / "state", target, under="params"), cfg
            except CheckpointMismatchError:
                raise
            except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise bare Exceptions on bad data
                err = e
        if step is not None:
            raise CheckpointError(f"step {s}: the checkpoint {step_dir} is unreadable ({_one_line(err)}); "
                                  f"complete steps: {steps}") from err
        failed.append(f"step {s}: {_one_line(err)}")
        log(f"checkpoint: step {s} in {ckpt_dir} is unreadable ({_one_line(err)}); trying the one before it")
    raise CheckpointError(f"no readable checkpoint in {ckpt_dir}:\n  " + "\n  ".join(failed))


EXPORT_FORMATS = ("orbax", "hf")


def export_params(run_dir: str | Path, out_dir: str | Path, step: int | None = None, *, format: str = "orbax",
                  dtype: str | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Write the params of a training checkpoint (latest complete one by default) on their own.

    format="orbax": `out_dir/params` is an Orbax pytree of the params (no optimizer state),
    `config.yaml` the run's resolved config, `tokenizer.json` the run's tokenizer if it had one,
    and `export.json` where it came from. Load it with `load_params(out_dir)`.

    format="hf": a Hugging Face Llama directory (`scaling.interop.hf.save_params`: config.json,
    model.safetensors, and the run's tokenizer as tokenizer.json + tokenizer_config.json +
    generation_config.json), which transformers' `AutoModelForCausalLM` / `AutoTokenizer` and
    `python -m scaling generate` load; `dtype` (float32, bfloat16, float16) for its weights,
    default the params' own. Also `export.json`.

    `out_dir` must be new or empty, and outside the run directory's config and checkpoints. The
    export is written into a hidden directory (beside `out_dir`, or inside it if it exists) and
    moved into place when whole: an error or an interrupt leaves `out_dir` as it was.
    Without `step`, partial saves and an unreadable latest checkpoint are reported through
    `log` (default: stderr) and the latest readable complete one is exported.
    """
    log = log or _warn
    if format not in EXPORT_FORMATS:
        raise CheckpointError(f"--format {format!r}: allowed {', '.join(EXPORT_FORMATS)}")
    if dtype is not None and format != "hf":
        raise CheckpointError("--dtype applies to --format hf only (an Orbax export keeps the checkpoint's dtypes)")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"--dtype {dtype!r}: allowed float32, bfloat16, float16")
    # resolve(): `--out run/../run` or a symlink to the run is the run directory too.
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir).resolve()
    if not run_dir.exists():
        raise CheckpointError(f"--run_dir: run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise CheckpointError(f"--run_dir: {run_dir} is a file, not a run directory")
    ckpt_dir = run_dir / "checkpoints"
    steps = complete_steps(ckpt_dir)
    if not steps:
        partial = partial_checkpoints(ckpt_dir)
        extra = f" (partial saves, never committed: {', '.join(p.name for p in partial)})" if partial else ""
        if (run_dir / "params").is_dir() and (run_dir / "config.yaml").is_file():
            extra += "; it is an export (params/ + config.yaml), not a training run's directory"
        raise CheckpointError(f"--run_dir: no complete checkpoint in {ckpt_dir}{extra}")
    if step is not None and step not in steps:
        raise CheckpointError(f"--step {step}: no complete checkpoint of that step in {ckpt_dir}; have {steps}")
    # Refuse a bad destination before reading anything (a large model's params take a while).
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--out {out_dir} exists and is not a directory; choose another --out")
    if out_dir == run_dir:
        raise CheckpointError(f"--out {out_dir} is the run directory itself (its config.yaml would be overwritten); "
                              "choose another --out")
    if out_dir == ckpt_dir or ckpt_dir in out_dir.parents:
        raise CheckpointError(f"--out {out_dir} is inside the run's checkpoints directory, which Orbax and the "
                              "trainer manage (a resumed run deletes a step-named directory there that Orbax did not "
                              "commit); choose another --out")
    if out_dir.is_dir():
        held = sorted(p.name for p in out_dir.iterdir())
        if held:
            shown = ", ".join(held[:5]) + (f", ... ({len(held)} entries)" if len(held) > 5 else "")
            raise CheckpointError(f"--out {out_dir} is not empty (holds {shown}); nothing is overwritten: "
                                  "choose a new or empty directory")
    tokenizer = run_dir / "tokenizer.json" if (run_dir / "tokenizer.json").exists() else None
    if format == "hf" and tokenizer is not None:
        tokenizer = _load_run_tokenizer(tokenizer)  # a broken one fails here, not after the read
    created = [p for p in out_dir.parents if not p.exists()]  # to make for the staging directory, deepest first
    try:
        staging = _staging_dir(out_dir)
        try:
            try:
                step, params, cfg = _restore_run_params(run_dir, step, None, _host_sharding(), log, need_config=True)
            except CheckpointError as e:
                raise CheckpointError(f"--{e}" if str(e).startswith("step ") else str(e)) from None
            try:
                _write_export(staging, format, cfg, params, dtype, tokenizer)
                info = {"run_dir": str(run_dir), "step": step, "format": format}
                (staging / "export.json").write_text(json.dumps(info, indent=1) + "\n")
                _publish(staging, out_dir)
            except OSError as e:
                raise CheckpointError(f"--out {out_dir}: the export could not be written ({_one_line(e)}); "
                                      "nothing was left there") from None
        except BaseException:  # an error or an interrupt: no half-written export
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except BaseException:  # ... and no directories of ours
        for d in created:
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return out_dir


def _load_run_tokenizer(path: Path):
    from scaling.data import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - bad JSON, or JSON of the wrong shape (KeyError, TypeError)
        raise CheckpointError(f"--format hf: the run's tokenizer {path} is unreadable ({_one_line(e)})") from None


def _staging_dir(out_dir: Path) -> Path:
    """A new hidden directory to write the export into, on out_dir's filesystem: beside it when it
    does not exist yet, inside it when it does (it is empty, and may be a mount point, which
    cannot be renamed onto). Made before the params are read: an unwritable --out fails at once."""
    where = out_dir if out_dir.is_dir() else out_dir.parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        staging = where / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as e:
        raise CheckpointError(f"--out {out_dir}: cannot write there ({_one_line(e)})") from None
    return staging


def _publish(staging: Path, out_dir: Path) -> None:
    """The whole export into place: one rename, or (staged inside out_dir) its entries moved up,
    export.json last, so that an export without it was cut short."""
    if staging.parent != out_dir:
        staging.rename(out_dir)
        return
    for entry in sorted(staging.iterdir(), key=lambda e: e.name == "export.json"):
        entry.rename(out_dir / entry.name)
    staging.rmdir()


def _write_export(path: Path, format: str, cfg: Config, params: dict, dtype: str | None, tokenizer) -> None:
    if format == "hf":
        from scaling.interop import hf

        try:
            hf.save_params(cfg.model, params, path, dtype=dtype, tokenizer=tokenizer)
        except ValueError as e:  # e.g. a tokenizer larger than the model's vocabulary
            raise CheckpointError(f"--format hf: {e}") from None
        return
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", params)
    (path / "config.yaml").write_text(dump_yaml(cfg))
    if tokenizer is not None:
        shutil.copyfile(tokenizer, path / "tokenizer.json")


def _host_sharding():
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def load_config_of(path: str | Path) -> Config:
    """The resolved config stored with an export (`config.yaml`) or a run's latest checkpoint."""
    path = Path(path)
    if (path / "config.yaml").exists() and (path / "params").exists():
        from scaling.config import load_config

        return load_config(path / "config.yaml")
    steps = complete_steps(path / "checkpoints")
    if not steps:
        raise CheckpointError(_not_loadable(path))
    return step_config(path / "checkpoints" / str(steps[-1]))


def _not_loadable(path: Path) -> str:
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file; expected an export directory (params/) or a run directory (checkpoints/)"
    partial = partial_checkpoints(path / "checkpoints")
    extra = f" (partial saves, never committed: {', '.join(p.name for p in partial)})" if partial else ""
    return f"{path} is neither an export (config.yaml + params/) nor a run with a complete checkpoint{extra}"


def load_params(path: str | Path, model_cfg: ModelConfig | None = None, sharding: Any = None,
                step: int | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Params as a pure dict of arrays, without the optimizer state.

    `path`: an export directory (`export_params`), or a run directory (its latest
    complete training checkpoint). `model_cfg`: the model to load into (default: the one
    stored with the params); a shape mismatch raises CheckpointMismatchError naming each
    parameter and both shapes. `sharding`: one sharding for every leaf or a tree of them
    (default: the first local device). `step`: a run directory's checkpoint of that step
    (default: the latest complete one); not for an export. Without `step`, partial saves
    and an unreadable latest checkpoint are reported through `log` (default: stderr) and
    the latest readable one is loaded, as a resumed training run does.
    """
    path = Path(path).absolute()
    sharding = sharding or _host_sharding()
    steps = complete_steps(path / "checkpoints")
    if (path / "params").exists() and not steps:
        if step is not None:
            raise CheckpointError(f"step {step}: {path} is an export (params/, one step); a step picks a run directory's checkpoint")
        model_cfg = model_cfg or load_config_of(path).model
        target = _params_target(model_cfg, sharding)
        try:
            return _read_params(path / "params", target, under=None)
        except (CheckpointError, CheckpointMismatchError):
            raise
        except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise bare Exceptions on bad data
            raise CheckpointError(f"{path / 'params'} is unreadable ({_one_line(e)})") from e
    if not steps:
        raise CheckpointError(_not_loadable(path))
    return _restore_run_params(path, step, model_cfg, sharding, log or _warn, need_config=False)[1]


def export_main(argv: list[str]) -> int:
    """python -m scaling export --run_dir DIR --out DIR [--step N] [--format orbax|hf] [--dtype D]"""
    parser = argparse.ArgumentParser(prog="python -m scaling export", description=export_params.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", required=True, help="training run directory (holds checkpoints/)")
    parser.add_argument("--out", required=True, help="directory to write the export to")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete)")
    parser.add_argument("--format", default="orbax", choices=EXPORT_FORMATS,
                        help="orbax: params/ + config.yaml (load_params); hf: a Hugging Face Llama directory")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="weights' dtype in an hf export (default: the params' own)")
    args = parser.parse_args(argv)
    try:
        out = export_params(args.run_dir, args.out, args.step, format=args.format, dtype=args.dtype)
    except (CheckpointError, CheckpointMismatchError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    step = json.loads((out / "export.json").read_text())["step"]
    what = "a Hugging Face directory" if args.format == "hf" else "params"
    print(f"exported {what} of step {step} from {Path(args.run_dir).absolute()} to {out}")
    return 0
