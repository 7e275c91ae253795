"""Named meshes, logical axis names, rule sets, constraints and parameter shardings."""

from scaling.sharding import axes
from scaling.sharding.mesh import MeshError, active, constrain, logical_to_spec, make_mesh, resolve_mesh_shape, sharding_rules, use_sharding
from scaling.sharding.params import ShardingError
from scaling.sharding.rules import RULE_SETS, RuleSet, get_rule_set

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
