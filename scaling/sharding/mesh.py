"""Mesh construction and the activation-constraint context."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from scaling.config import AxisType, MeshConfig
from scaling.sharding.axes import MESH_AXES
from scaling.sharding.rules import RuleSet, get_rule_set


class MeshError(ValueError):
    pass


def resolve_mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """Fill in the -1 axis; the product must equal the device count."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise MeshError(
                f"mesh {dict(zip(MESH_AXES, sizes))}: the fixed axes multiply to {known}, "
                f"which does not divide the {num_devices} devices"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise MeshError(
            f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices "
            f"but {num_devices} are available; make the product of mesh.data, mesh.fsdp and "
            f"mesh.tensor equal {num_devices} (or set one of them to -1)"
        )
    return tuple(sizes)  # type: ignore[return-value]


EXPLICIT_UNSUPPORTED = (
    "mesh.axis_type=explicit is not supported for training: in Explicit mode every op whose "
    "output sharding is ambiguous needs it spelled out (the embedding gather from the "
    "vocab-sharded table, the FSDP weight all-gathers before each matmul, an out_sharding on "
    "each row-parallel contraction, the vocab-sharded cross-entropy), and the model code does "
    "not give them yet. Use mesh.axis_type=auto (the default): the compiler propagates "
    "shardings and `constrain` pins the key activations. See docs/sharding.md."
)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None, *, allow_explicit: bool = False) -> Mesh:
    """The (data, fsdp, tensor) mesh over `devices` (default: all, topology-ordered).

    Explicit axes are refused unless `allow_explicit` (see EXPLICIT_UNSUPPORTED); sharded
    init and `constrain` do work with them, the train step does not.
    """
    if cfg.axis_type == AxisType.explicit and not allow_explicit:
        raise MeshError(EXPLICIT_UNSUPPORTED)
    devices = list(devices) if devices is not None else jax.devices()
    shape = resolve_mesh_shape(cfg, len(devices))
    axis_type = jax.sharding.AxisType.Explicit if cfg.axis_type == AxisType.explicit else jax.sharding.AxisType.Auto
    if len(devices) == len(jax.devices()) and devices == jax.devices():
        # make_mesh orders devices for the physical topology (NVLink islands, TPU torus).
        return jax.make_mesh(shape, MESH_AXES, axis_types=(axis_type,) * 3)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(axis_type,) * 3)


# The active (mesh, rules) for activation constraints; None outside a sharded context,
# where `constrain` is the identity (single-device code paths, tests of bare modules).
_ACTIVE: contextvars.ContextVar[tuple[Mesh, RuleSet] | None] = contextvars.ContextVar("scaling_sharding", default=None)


@contextlib.contextmanager
def use_sharding(mesh: Mesh, rules: RuleSet | str) -> Iterator[None]:
    """Activate a mesh + rule set for `constrain` calls traced inside the block."""
    rules = get_rule_set(rules) if isinstance(rules, str) else rules
    token = _ACTIVE.set((mesh, rules))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh, RuleSet] | None:
    return _ACTIVE.get()


def logical_to_spec(names: Sequence[str | None], mapping, mesh: Mesh | None = None) -> P:
    """Logical names -> PartitionSpec. A mesh axis is used at most once per spec."""
    used: set[str] = set()
    out: list[tuple[str, ...] | str | None] = []
    for name in names:
        axes = tuple(a for a in mapping.get(name, ()) if a not in used) if name is not None else ()
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)  # size-1 axes add nothing
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names (identity outside `use_sharding`)."""
    ctx = _ACTIVE.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    spec = logical_to_spec(names, rules.activations, mesh)
    if mesh.axis_types and mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
