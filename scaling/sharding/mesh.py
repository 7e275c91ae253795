"""Mesh construction and the activation-constraint context."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from scaling.config import AxisType, MeshConfig
from scaling.sharding.axes import MESH_AXES
from scaling.sharding.rules import RuleSet, get_rule_set, mesh_axes_of


class MeshError(ValueError):
    pass


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _devices(n: int) -> str:
    return "1 device" if n == 1 else f"{n} devices"


def resolve_mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """Fill in the -1 axis; the product must equal the device count.

    Checks the sizes itself (as config validation does) so that a MeshConfig built in
    Python, which skips that validation, fails with a MeshError naming the field."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    for name, size in zip(MESH_AXES, sizes):
        if isinstance(size, bool) or not isinstance(size, int) or not (size == -1 or size >= 1):
            raise MeshError(f"mesh.{name}: must be an integer >= 1 or -1 (take the remaining devices), got {size!r}")
    if sizes.count(-1) > 1:
        raise MeshError(f"mesh {dict(zip(MESH_AXES, sizes))}: at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
    if num_devices < 1:
        raise MeshError(f"mesh {dict(zip(MESH_AXES, sizes))}: no devices to build it over")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            fixed = " x ".join(f"mesh.{a}={s}" for a, s in zip(MESH_AXES, sizes) if s != -1)
            raise MeshError(
                f"mesh {dict(zip(MESH_AXES, sizes))}: the fixed axes ({fixed}) multiply to {known}, "
                f"which does not divide the {num_devices} devices; their product must be one of "
                f"{_divisors(num_devices)}"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        have = f"{num_devices} is" if num_devices == 1 else f"{num_devices} are"
        raise MeshError(
            f"mesh {dict(zip(MESH_AXES, sizes))} has {_devices(math.prod(sizes))} "
            f"but {have} available; make the product of mesh.data, mesh.fsdp and "
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
    if cfg.axis_type not in tuple(AxisType):  # a MeshConfig built in Python skips config validation
        raise MeshError(f"mesh.axis_type={cfg.axis_type!r} is not an axis type; allowed: {', '.join(AxisType)}")
    if cfg.axis_type == AxisType.explicit and not allow_explicit:
        raise MeshError(EXPLICIT_UNSUPPORTED)
    devices = list(devices) if devices is not None else jax.devices()
    if len(set(devices)) != len(devices):
        raise MeshError(f"make_mesh: the {len(devices)} devices given contain duplicates; each device may appear once")
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
    """Activate a mesh + rule set for `constrain` calls traced inside the block (and the mesh as
    JAX's ambient mesh: outside jit only, where jax.set_mesh is allowed)."""
    with sharding_rules(mesh, rules), jax.set_mesh(mesh):
        yield


@contextlib.contextmanager
def sharding_rules(mesh: Mesh, rules: RuleSet | str) -> Iterator[None]:
    """The mesh + rule set for `constrain`, without JAX's ambient mesh: usable inside a function
    being traced by jit (jax.set_mesh is refused there). Enough for `constrain` on Auto and
    Explicit axes alike: its constraints name the mesh themselves."""
    rules = get_rule_set(rules) if isinstance(rules, str) else rules
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh, RuleSet] | None:
    return _ACTIVE.get()


def logical_to_spec(names: Sequence[str | None], mapping, mesh: Mesh | None = None) -> P:
    """Logical names -> PartitionSpec. A mesh axis is used at most once per spec.

    With a mesh, every mesh axis a rule names must be one of the mesh's (MeshError)."""
    if isinstance(names, str):  # ("batch") is the string "batch", not a 1-tuple
        raise MeshError(f"logical axis names must be a sequence of names, one per dimension, got the string {names!r}")
    used: set[str] = set()
    out: list[tuple[str, ...] | str | None] = []
    for name in names:
        named = mesh_axes_of(name, mapping) if name is not None else ()
        if len(set(named)) != len(named):  # ("data", "data"), a typo: jax refuses the spec without naming the rule
            raise MeshError(f"logical axis {name!r} maps to {named}, which names a mesh axis twice; name each once")
        axes = tuple(a for a in named if a not in used)
        if mesh is not None:
            unknown = [a for a in axes if a not in mesh.shape]
            if unknown:
                raise MeshError(
                    f"logical axis {name!r} maps to mesh axis {unknown[0]!r}, which this mesh does not have; "
                    f"allowed: {', '.join(mesh.axis_names)}"
                )
            axes = tuple(a for a in axes if mesh.shape[a] > 1)  # size-1 axes add nothing
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by logical names (identity outside `use_sharding`)."""
    # One name per dimension, checked in or out of a context: jax pads a short spec with None
    # (the trailing dimensions silently replicated), as parameters' names may not (spec_for).
    if not isinstance(names, str) and len(names) != jnp.ndim(x):
        raise MeshError(
            f"constrain: {len(names)} logical axis names {tuple(names)} for a rank-{jnp.ndim(x)} array of shape "
            f"{jnp.shape(x)}; give one name (or None) per dimension"
        )
    ctx = _ACTIVE.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    spec = logical_to_spec(names, rules.activations, mesh)
    if mesh.axis_types and mesh.axis_types[0] == jax.sharding.AxisType.Explicit:
        # A NamedSharding, not a bare spec: under `sharding_rules` inside jit there is no ambient mesh.
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
