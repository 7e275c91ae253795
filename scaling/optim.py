"""AdamW (float32 moments) with warmup + decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from scaling.config import OptimizerConfig, Schedule, validate_optimizer


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to the peak, then cosine/linear decay to min_lr_ratio x peak.

    Indexed by the 0-based count of applied updates, for a run of steps 0 .. total_steps - 1:
    lr(0) = 0, the peak at step `warmup_steps` (a warmup longer than the run is cut to end
    at the last step), and the decay lands on min_lr_ratio x peak exactly at the last step,
    total_steps - 1, staying there beyond it. `constant` holds the peak after the warmup.
    """
    validate_optimizer(cfg)  # a bare OptimizerConfig is checked nowhere else
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    # The last step is total_steps - 1, so the decay spans total_steps - 1 - warmup steps.
    decay_steps = max(total_steps - 1 - warmup, 1)
    if cfg.schedule == Schedule.cosine:
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == Schedule.linear:
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decay_mask(params, decay_embeddings: bool):
    """Decay matrices only: not norm scales (1-D, or [L, D] stacked over layers), and not
    the embedding table unless asked. An untied output head (`head_dv`) is a matrix and is
    decayed; a tied head is the embedding table, so follows decay_embeddings. `params` is a
    pure dict (train.py) or an nnx.State (nnx.split), with the same mask."""

    def keep(path, p) -> bool:
        # Names of dict keys and attributes alike. An nnx.State (params from nnx.split, used
        # with tx.update directly) ends each path in the Variable's `.value`, no parameter
        # name: read as one, the stacked [L, D] norm scales were decayed.
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path
                if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]
        if p.ndim <= 1 or keys[-1:] == ["scale"]:  # (a bare array has no keys: keys[-1] was an IndexError)
            return False
        if "embed" in keys and not decay_embeddings:
            return False
        return True

    return jax.tree.map_with_path(keep, params)


def global_norm(tree) -> jax.Array:
    """The L2 norm of all the leaves together, accumulated in float32 (float64 for float64
    leaves) whatever their dtype: optax's norm of bf16 grads sums and rounds in bf16."""
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        x = jnp.asarray(x)
        total = total + jnp.sum(jnp.square(x.astype(jnp.promote_types(x.dtype, jnp.float32))))
    return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm and the scale in float32 (`global_norm`): for bf16
    grads optax rounded the norm to bf16 (8 significant bits: up to 0.4% off) and divided in bf16. Each
    clipped leaf is rounded to its own dtype once; below max_norm the leaves pass unchanged."""

    def update_fn(updates, state, params=None):
        del params
        norm = global_norm(updates)
        scale = max_norm / norm  # (NaN for a NaN norm: NaN updates, as optax's)

        def clip(t):
            return jnp.where(norm < max_norm, t, (t.astype(scale.dtype) * scale).astype(t.dtype))

        return jax.tree.map(clip, updates), state

    # (optax's state too: checkpoints of the optimizer state keep their structure)
    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def float32_moments(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run `inner` (AdamW) on float32 views of the updates and params, so that its state is
    float32 whatever the param dtype, and round its updates once to each param's dtype (the
    updates' without params).

    optax keeps Adam's second moment in the params' dtype. In bf16, b2 = 0.999 times the moment
    rounds back to the moment itself (a 0.1% step is below bf16's 0.4% spacing): it never decays,
    and after 5,000 steps of unit gradients the bias-corrected moment is ~2x its value (updates
    ~30% small). float32 params pass through unchanged; float64 ones stay float64."""

    def up(tree):
        return jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32)), tree)

    def init_fn(params):
        return inner.init(up(params))

    def update_fn(updates, state, params=None):
        new, state = inner.update(up(updates), state, None if params is None else up(params))
        # rounded once, to the dtype the update is applied in: the params' where given
        return jax.tree.map(lambda n, t: n.astype(t.dtype), new, updates if params is None else params), state

    return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg, total_steps)
    parts = []
    if cfg.clip_norm > 0:
        parts.append(clip_by_global_norm(cfg.clip_norm))
    parts.append(float32_moments(
        optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=lambda params: decay_mask(params, cfg.decay_embeddings),
        )
    ))
    return optax.chain(*parts)
