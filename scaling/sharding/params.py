"""Parameter shardings from logical names, with divisibility checks, and sharded init."""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from scaling.sharding import axes as A
from scaling.sharding.mesh import logical_to_spec
from scaling.sharding.rules import RuleSet


class ShardingError(ValueError):
    pass


def logical_axes(model: nnx.Module) -> dict:
    """Pure dict, same structure as the params, of each parameter's logical axis names."""
    state = nnx.state(model, nnx.Param)
    names = jax.tree.map(
        lambda v: tuple(v.get_metadata().get("out_sharding") or (None,) * v.value.ndim),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.to_pure_dict(names)


def _path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


# The model config field behind each parameter dimension's logical name (for error messages).
_MODEL_FIELD = {
    A.VOCAB: "model.vocab_size",
    A.EMBED: "model.hidden_size",
    A.HEADS: "model.num_heads",
    A.KV_HEADS: "model.num_kv_heads",
    A.HEAD_DIM: "model.head_dim",
    A.MLP: "model.mlp_dim",
    A.LAYERS: "model.num_layers",
}


def spec_for(path: str, shape: tuple[int, ...], names: tuple, mapping: Mapping, mesh: Mesh) -> P:
    if len(names) != len(shape):
        raise ShardingError(
            f"parameter {path}: {len(names)} logical axis names {tuple(names)} for a rank-{len(shape)} "
            f"array of shape {tuple(shape)}; give one name (or None) per dimension"
        )
    spec = logical_to_spec(names, mapping, mesh)
    for dim, (size, axes, name) in enumerate(zip(shape, spec, names)):
        if axes is None:
            continue
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
        n = math.prod(mesh.shape[a] for a in axes_t)
        if size % n:
            mesh_fields = " x ".join(f"mesh.{a}" for a in axes_t)
            field = _MODEL_FIELD.get(name)
            # A mesh axis must also divide the device count (the other axes take the rest).
            allowed = ", ".join(str(d) for d in range(1, min(size, mesh.size) + 1) if size % d == 0 and mesh.size % d == 0)
            raise ShardingError(
                f"parameter {path}: dimension {dim} ({name}) has size {size}, which mesh axis "
                f"{'x'.join(axes_t)} of size {n} cannot divide; make {mesh_fields} one of {allowed}, "
                f"or {field + '=' + str(size) if field else 'the size'} a multiple of {n}"
            )
    return spec


def param_shardings(names_tree: dict, shapes_tree: dict, mesh: Mesh, rules: RuleSet) -> dict:
    """NamedSharding per parameter (pure-dict trees in, pure-dict tree out)."""

    def one(path, names, shape):
        return NamedSharding(mesh, spec_for(_path_str(path), tuple(shape.shape), names, rules.params, mesh))

    return jax.tree.map_with_path(one, names_tree, shapes_tree, is_leaf=lambda x: isinstance(x, tuple))
