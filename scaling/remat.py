"""Rematerialization policies as a registry of typed values.

A policy decides which intermediates of the layer body are saved for the backward pass;
everything else is recomputed. Applied with `jax.checkpoint` to the (scanned) layer body.
What each policy keeps, tensor by tensor and in bytes, is `scaling.accounting.layer_residuals`
(tests/test_remat.py checks it against JAX's saved residuals and XLA's memory analysis).

`offload` moves the tagged tensors to the `pinned_host` memory space. A backend without
that memory space gets a `RematError` naming the alternatives, never a silent fallback. The
CPU backend has one (JAX exposes `pinned_host` on CPU devices), so offload runs there and
gives identical gradients, but host and device memory are the same RAM: it saves nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from scaling import layers
from scaling.config import RematConfig, RematPolicyName

cp = jax.checkpoint_policies


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    name: RematPolicyName
    description: str
    # names -> jax checkpoint policy, or None for "no jax.checkpoint at all".
    make: Callable[[tuple[str, ...]], Callable | None]


def _offload(names: tuple[str, ...]):
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src="device",
        offload_dst="pinned_host",
    )


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
# Models": keep the linear layers' outputs, recompute the attention core (QK^T, softmax,
# probabilities x V), whose activations grow with T^2 (or cost a flash re-run).
SELECTIVE_SAVED = (
    layers.QUERY_PROJ,
    layers.KEY_PROJ,
    layers.VALUE_PROJ,
    layers.OUT_PROJ,
    layers.MLP_GATE,
    layers.MLP_UP,
    layers.MLP_DOWN,
)

POLICIES: dict[RematPolicyName, RematPolicy] = {
    p.name: p
    for p in (
        RematPolicy(RematPolicyName.none, "save everything; no recomputation", lambda names: None),
        RematPolicy(RematPolicyName.full, "save only each layer's input; recompute the layer", lambda names: cp.nothing_saveable),
        RematPolicy(
            RematPolicyName.dots,
            "save matmul outputs without batch dims (the projections), recompute the rest",
            lambda names: cp.dots_with_no_batch_dims_saveable,
        ),
        RematPolicy(RematPolicyName.names, "save the checkpoint_name tags listed in remat.names", lambda names: cp.save_only_these_names(*names)),
        RematPolicy(RematPolicyName.offload, "offload the tags in remat.names to host memory", _offload),
        RematPolicy(
            RematPolicyName.selective,
            "Korthikanti et al.: keep the linear layers' outputs, recompute the attention core",
            lambda names: cp.save_only_these_names(*SELECTIVE_SAVED),
        ),
    )
}


class RematError(ValueError):
    pass


def host_offload_supported(device: jax.Device | None = None) -> bool:
    """Does the device have a `pinned_host` memory space to offload residuals to?"""
    device = device or jax.devices()[0]
    try:
        kinds = {mem.kind for mem in device.addressable_memories()}
    except Exception:  # backends without the memories API
        return False
    return "pinned_host" in kinds


def validate_names(names: tuple[str, ...]) -> None:
    if not isinstance(names, (tuple, list)):
        # A bare string would be taken letter by letter ("mlp_up" -> 'm', 'l', ...).
        got = f"the string {names!r}; write [{names}]" if isinstance(names, str) else f"{type(names).__name__} {names!r}"
        raise RematError(f"remat.names: takes a list of tags, got {got}; allowed tags: {', '.join(layers.CHECKPOINT_NAMES)}")
    unknown = [n for n in names if n not in layers.CHECKPOINT_NAMES]
    if unknown:
        # A RematError (a ValueError) so the command line reports it in one line, exit code 2.
        raise RematError(f"remat.names: unknown tag(s) {unknown}; allowed: {', '.join(layers.CHECKPOINT_NAMES)}")


def validate(cfg: RematConfig) -> RematPolicyName:
    """The policy of a RematConfig (one built in Python skips the config file's checks), or a
    RematError naming the field and the allowed values."""
    try:
        policy = RematPolicyName(cfg.policy)
    except ValueError:
        raise RematError(f"remat.policy: {cfg.policy!r} is not a policy; allowed: {', '.join(p.value for p in POLICIES)}") from None
    validate_names(cfg.names)
    if policy in (RematPolicyName.names, RematPolicyName.offload) and not cfg.names:
        # save_only_these_names() of nothing saves nothing: `full` under another name.
        raise RematError(f"remat.names: remat.policy={policy.value} needs the checkpoint_name tags to "
                         f"{'save' if policy == RematPolicyName.names else 'offload'}; allowed: {', '.join(layers.CHECKPOINT_NAMES)}")
    return policy


def apply(fn: Callable, cfg: RematConfig, *, prevent_cse: bool = True) -> Callable:
    """Wrap a layer body with jax.checkpoint under the configured policy."""
    policy_name = validate(cfg)
    if policy_name == RematPolicyName.offload and not host_offload_supported():
        raise RematError(
            f"remat.policy=offload needs a pinned_host memory space, which the {jax.default_backend()!r} "
            "backend does not have; use remat.policy=names with the same remat.names (keep them on the "
            "device) or remat.policy=full"
        )
    policy = POLICIES[policy_name].make(tuple(cfg.names))
    if policy_name == RematPolicyName.none:
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)
