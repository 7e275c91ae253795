"""Orbax checkpoints in the run directory: save, keep, resume, reshard, export.

Layout: `<run_dir>/checkpoints/<step>/{state, meta}`. `state` holds params, optimizer
state, step and RNG key as one pytree (Orbax StandardSave, restored straight into the
target shardings, so a checkpoint written on one mesh restores onto any other). `meta`
is JSON: the data loader's position and the resolved config.

Orbax writes each step into a temporary directory and renames it when complete, so a
process killed mid-save leaves a partial directory that `all_steps` never lists; the
next start ignores it (and we report it).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from scaling.config import CheckpointConfig

logging.getLogger("absl").setLevel(logging.WARNING)


class CheckpointMismatchError(ValueError):
    pass


def partial_checkpoints(directory: Path) -> list[Path]:
    """Step directories left incomplete by a crash (Orbax's temporary names)."""
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if "tmp" in p.name)


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    meta: dict


def _shape_mismatches(target: Any, saved: Any) -> list[str]:
    out = []
    flat_t = dict(jax.tree_util.tree_flatten_with_path(target)[0])
    flat_s = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    for path, leaf in flat_t.items():
        name = jax.tree_util.keystr(path)
        if path not in flat_s:
            out.append(f"{name}: in the config's model but not in the checkpoint")
            continue
        want, got = tuple(leaf.shape), tuple(flat_s[path].shape)
        if want != got:
            out.append(f"{name}: config shape {want}, checkpoint shape {got}")
    for path in flat_s.keys() - flat_t.keys():
        out.append(f"{jax.tree_util.keystr(path)}: in the checkpoint but not in the config's model")
    return out


class Checkpointer:
    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_period or None,
            enable_async_checkpointing=cfg.async_save,
            create=True,
            cleanup_tmp_directories=False,  # we report partial saves before removing them
        )
        self.partial = partial_checkpoints(self.directory)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        return self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )

    def should_save(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def restore(self, abstract_state: Any, step: int | None = None) -> Restored | None:
        """Restore into `abstract_state`'s shapes, dtypes and shardings (any mesh)."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        saved = self.manager.item_metadata(step)["state"]
        mismatches = _shape_mismatches(abstract_state, saved)
        if mismatches:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory / str(step)} does not match the config:\n  " + "\n  ".join(mismatches)
            )
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
        )
        return Restored(step, restored["state"], restored["meta"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with shardings, as Orbax's restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), tree
    )
