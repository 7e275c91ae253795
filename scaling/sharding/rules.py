"""Rule sets: logical axis name -> mesh axes, kept as data.

Each set has one mapping for parameters and one for activations. A logical name absent
from a mapping is replicated. Mesh axes of size 1 cost nothing, so one set serves many
mesh shapes: `default` is FSDP (ZeRO-3: params, grads and optimizer state over `fsdp`)
plus Megatron tensor parallelism (heads, MLP width and vocabulary over `tensor`).

In the book's notation the MLP under `default` is
  In[B_{data,fsdp}, D] ·_D W_in[D_{fsdp}, F_{tensor}] -> H[B_{data,fsdp}, F_{tensor}]
  (W_in is all-gathered over fsdp first: column parallel, no reduction)
  H[B_{data,fsdp}, F_{tensor}] ·_F W_out[F_{tensor}, D_{fsdp}] -> Out[B_{data,fsdp}, D]{U_tensor}
  (row parallel: an all-reduce over tensor follows)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from scaling.sharding import axes as A

MeshAxes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RuleSet:
    name: str
    params: Mapping[str, MeshAxes]
    activations: Mapping[str, MeshAxes]
    description: str = ""

    def __post_init__(self):
        # Read-only copies: the built-in sets share their dicts (fsdp_tp is default), so an edit
        # through get_rule_set("default").params would change every later user in the process.
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "activations", MappingProxyType(dict(self.activations)))

    def __reduce__(self):  # a mappingproxy does not pickle or deepcopy; rebuild from plain dicts
        return RuleSet, (self.name, dict(self.params), dict(self.activations), self.description)


_BATCH_AXES: MeshAxes = ("data", "fsdp")

_TP_ACTIVATIONS: dict[str, MeshAxes] = {
    A.BATCH: _BATCH_AXES,
    A.ACT_HEADS: ("tensor",),
    A.ACT_KV_HEADS: ("tensor",),
    A.ACT_MLP: ("tensor",),
    A.ACT_VOCAB: ("tensor",),
}

RULE_SETS: dict[str, RuleSet] = {
    "default": RuleSet(
        name="default",
        description="FSDP over `fsdp` + Megatron tensor parallel over `tensor`; batch over data x fsdp",
        params={
            A.EMBED: ("fsdp",),
            A.VOCAB: ("tensor",),
            A.HEADS: ("tensor",),
            A.KV_HEADS: ("tensor",),
            A.MLP: ("tensor",),
        },
        activations=_TP_ACTIVATIONS,
    ),
    "fsdp": RuleSet(
        name="fsdp",
        description="pure FSDP: params over fsdp x tensor (tensor used as a second FSDP axis), batch over all axes",
        params={A.EMBED: ("fsdp", "tensor")},
        activations={A.BATCH: ("data", "fsdp", "tensor")},
    ),
    "dp": RuleSet(
        name="dp",
        description="pure data parallel: params replicated, batch over every axis",
        params={},
        activations={A.BATCH: ("data", "fsdp", "tensor")},
    ),
}
RULE_SETS["fsdp_tp"] = dataclasses.replace(RULE_SETS["default"], name="fsdp_tp")


def get_rule_set(name: str) -> RuleSet:
    if name not in RULE_SETS:
        raise ValueError(f"mesh.rules={name!r} is not a rule set; allowed: {', '.join(sorted(RULE_SETS))}")
    return RULE_SETS[name]


def mesh_axes_of(name: str, mapping) -> tuple[str, ...]:
    """The mesh axes a rule maps `name` to; a bare string is one axis (not its characters)."""
    axes = mapping.get(name, ())
    return (axes,) if isinstance(axes, str) else tuple(axes)
