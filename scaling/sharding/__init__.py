"""Named meshes, logical axis names, rule sets, constraints and parameter shardings."""

from scaling.sharding import axes
from scaling.sharding.rules import RULE_SETS, RuleSet, get_rule_set

# The mesh and parameter helpers import jax: loaded on first use (PEP 562), so that the
# accounting and `plan` / `sweep --help`, which need only the rule sets, start without it.
_LAZY = {
    "MeshError": "mesh", "active": "mesh", "constrain": "mesh", "logical_to_spec": "mesh", "make_mesh": "mesh",
    "resolve_mesh_shape": "mesh", "sharding_rules": "mesh", "use_sharding": "mesh", "ShardingError": "params",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"scaling.sharding.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'scaling.sharding' has no attribute {name!r}")


__all__ = [
    "axes",
    "MeshError",
    "active",
    "constrain",
    "logical_to_spec",
    "make_mesh",
    "resolve_mesh_shape",
    "sharding_rules",
    "use_sharding",
    "RULE_SETS",
    "RuleSet",
    "get_rule_set",
    "ShardingError",
]
