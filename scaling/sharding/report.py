"""The sharding report: per parameter, shape, spec and bytes per device; totals."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh


def _per_device_bytes(shape, dtype, sharding) -> int:
    shard = sharding.shard_shape(tuple(shape))
    return int(math.prod(shard) * np.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class AbstractLayout:
    """What sharding_report reads from a Setup, for a mesh whose devices need not exist here."""

    cfg: Any
    mesh: AbstractMesh
    abstract_params: dict
    state_shardings: dict


def abstract_layout(cfg, num_devices: int) -> AbstractLayout:
    """The params' shardings on cfg's mesh resolved over `num_devices` devices, as an AbstractMesh:
    a 64-GPU or multi-host layout checked and printed on a laptop (same rules, same errors)."""
    from flax import nnx

    from scaling.config import AxisType
    from scaling.model import build_model
    from scaling.sharding.axes import MESH_AXES
    from scaling.sharding.mesh import EXPLICIT_UNSUPPORTED, MeshError, resolve_mesh_shape
    from scaling.sharding.params import logical_axes, param_shardings
    from scaling.sharding.rules import get_rule_set

    if cfg.mesh.axis_type == AxisType.explicit:  # make_mesh refuses it for the real devices: the same here
        raise MeshError(EXPLICIT_UNSUPPORTED)
    mesh = AbstractMesh(resolve_mesh_shape(cfg.mesh, num_devices), MESH_AXES)
    model = nnx.eval_shape(lambda: build_model(cfg.model, attention=cfg.attention, remat_cfg=cfg.remat, seed=0))
    params = nnx.to_pure_dict(nnx.split(model)[1])
    shardings = param_shardings(logical_axes(model), params, mesh, get_rule_set(cfg.mesh.rules))
    return AbstractLayout(cfg, mesh, params, {"params": shardings})


def sharding_report(setup) -> str:
    shard = setup.state_shardings["params"]
    rows = []
    flat = jax.tree_util.tree_flatten_with_path(setup.abstract_params)[0]
    shards = jax.tree.leaves(shard)
    total = total_dev = 0
    for (path, leaf), s in zip(flat, shards):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        full = int(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize)
        dev = _per_device_bytes(leaf.shape, leaf.dtype, s)
        total, total_dev = total + full, total_dev + dev
        rows.append((name, str(tuple(leaf.shape)), str(s.spec), f"{dev / 2**20:,.2f}"))
    mesh = setup.mesh
    head = ("parameter", "shape", "spec", "MiB/device")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines = [
        f"mesh {dict(mesh.shape)} rules={setup.cfg.mesh.rules}",
        fmt(head),
        "-" * (sum(widths) + 6),
        *map(fmt, rows),
        "-" * (sum(widths) + 6),
        f"params: {total / 2**20:,.2f} MiB total, {total_dev / 2**20:,.2f} MiB per device; "
        f"with AdamW state (x3): {3 * total_dev / 2**20:,.2f} MiB per device",
    ]
    return "\n".join(lines)
