"""scaling.optim against references written out by hand in float64."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scaling.config import ModelConfig, OptimizerConfig, Schedule
from scaling.model import build_model
from scaling.optim import decay_mask, learning_rate_schedule, make_optimizer


def closed_form_lr(step, *, peak, warmup, total, ratio, kind):
    """Linear warmup from 0 to the peak at step `warmup` (cut to end at the last step,
    total - 1, when longer than the run), then cosine/linear decay reaching ratio x peak at
    the last step and staying there; `constant` holds the peak."""
    end = peak * ratio
    w = min(warmup, total - 1)
    if step < w:
        return peak * step / w
    if kind == "constant":
        return peak
    span = total - 1 - w  # steps from the peak to the last step
    if span == 0:
        return peak if step == w else end
    p = min((step - w) / span, 1.0)
    if kind == "cosine":
        return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * p))
    return peak + (end - peak) * p


CASES = [  # (warmup, total_steps, min_lr_ratio)
    (5, 20, 0.1),
    (0, 10, 0.1),  # no warmup
    (5, 20, 0.0),
    (5, 20, 1.0),
    (1, 3, 0.1),
    (3, 5, 0.25),  # warmup ends one step before the last
    (4, 5, 0.1),  # warmup ends on the last step
    (10, 5, 0.1),  # warmup longer than the run
    (0, 1, 0.1),  # one-step run
    (7, 1, 0.1),
]


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup,total,ratio", CASES)
def test_schedule_boundaries_match_closed_form(kind, warmup, total, ratio):
    peak = 3e-3
    cfg = OptimizerConfig(learning_rate=peak, warmup_steps=warmup, schedule=Schedule(kind), min_lr_ratio=ratio)
    sched = learning_rate_schedule(cfg, total)
    w = min(warmup, total - 1)
    steps = sorted({0, max(w - 1, 0), w, w + 1, total - 2, total - 1, total, total + 7} - {-1})
    got = np.array([float(sched(s)) for s in steps])
    want = np.array([closed_form_lr(s, peak=peak, warmup=warmup, total=total, ratio=ratio, kind=kind) for s in steps])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-12, err_msg=f"steps {steps}")
    # The peak is reached, at the end of the warmup.
    assert float(sched(w)) == pytest.approx(peak, rel=1e-6)
    # The last step runs at min_lr_ratio x peak ("final lr"), unless the warmup fills the run.
    if kind != "constant" and w < total - 1:
        assert float(sched(total - 1)) == pytest.approx(peak * ratio, rel=1e-6, abs=1e-12)


def _tiny(tie: bool) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, mlp_dim=24,
                       tie_embeddings=tie)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_decay_mask_by_hand(tie, decay_embeddings):
    params = nnx.to_pure_dict(nnx.state(build_model(_tiny(tie)), nnx.Param))
    mask = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(decay_mask(params, decay_embeddings))}
    matrices = {f"['blocks']['attn']['{n}']" for n in ("q_dnh", "k_dkh", "v_dkh", "o_nhd")}
    matrices |= {f"['blocks']['mlp']['{n}']" for n in ("gate_df", "up_df", "down_fd")}
    if not tie:
        matrices.add("['head_dv']")  # an untied output head is a matrix like any other: decayed
    norms = {"['blocks']['attn_norm']['scale']", "['blocks']['mlp_norm']['scale']", "['final_norm']['scale']"}
    embed = "['embed']['table_vd']"  # also the output head when tied: decayed only when asked
    assert set(mask) == matrices | norms | {embed}
    assert {k for k, m in mask.items() if m} == matrices | ({embed} if decay_embeddings else set())


def test_adamw_steps_match_float64_numpy():
    """Several steps of make_optimizer: global-norm clipping before Adam, bias correction,
    eps outside the sqrt, decoupled weight decay times the scheduled lr on the masked leaves."""
    rng = np.random.default_rng(0)
    shapes = {"embed": {"table_vd": (6, 4)}, "blocks": {"attn": {"q_dnh": (2, 4, 2, 3)}, "attn_norm": {"scale": (2, 4)}},
              "final_norm": {"scale": (4,)}, "head_dv": (4, 6)}
    decayed = {"['embed']['table_vd']": False, "['blocks']['attn']['q_dnh']": True,
               "['blocks']['attn_norm']['scale']": False, "['final_norm']['scale']": False, "['head_dv']": True}
    peak, ratio, b1, b2, eps, wd, clip, total = 0.1, 0.2, 0.8, 0.9, 1e-3, 0.3, 2.0, 4
    cfg = OptimizerConfig(learning_rate=peak, warmup_steps=1, schedule=Schedule.linear, min_lr_ratio=ratio, b1=b1, b2=b2,
                          eps=eps, weight_decay=wd, clip_norm=clip)
    tx = make_optimizer(cfg, total)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    state = tx.init(params)
    keys = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    ref = {k: np.asarray(x, np.float64) for k, x in zip(keys, jax.tree.leaves(params))}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    lrs = [0.0, peak, peak * (1 + ratio) / 2, peak * ratio]  # warmup 1, then linear to the last step
    for step in range(total):
        # Alternate small (unclipped) and large (clipped) gradients.
        g = {k: rng.normal(size=x.shape) * (0.1 if step % 2 == 0 else 3.0) for k, x in ref.items()}
        norm = math.sqrt(sum(float((x * x).sum()) for x in g.values()))
        assert (norm > clip) == (step % 2 == 1)
        scale = min(1.0, clip / norm)
        for k in ref:
            gk = g[k] * scale
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk * gk
            mhat, vhat = m[k] / (1 - b1 ** (step + 1)), v[k] / (1 - b2 ** (step + 1))
            ref[k] = ref[k] - lrs[step] * (mhat / (np.sqrt(vhat) + eps) + (wd * ref[k] if decayed[k] else 0.0))
        grads = jax.tree.unflatten(jax.tree.structure(params), [jnp.asarray(g[k], jnp.float32) for k in keys])
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        for k, x in zip(keys, jax.tree.leaves(params)):
            np.testing.assert_allclose(np.asarray(x), ref[k], rtol=1e-5, atol=1e-6, err_msg=f"step {step} {k}")


def test_adam_moments_of_bf16_params_are_float32_and_decay():
    """optax keeps Adam's moments in the params' dtype: with bf16 params b2 = 0.999 times the
    second moment rounded back to itself, so it never decayed (1.11x its value after 300 steps of
    a constant gradient, updates ~5% small). Against float64 Adam on the same gradient: the
    moments float32 and within 1e-5, each update within bf16's rounding of it (0.4%)."""
    cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=0, schedule=Schedule.constant, b1=0.9, b2=0.999,
                          eps=1e-8, weight_decay=0.0, clip_norm=0.0)
    tx = make_optimizer(cfg, total_steps=1000)
    g = jax.random.normal(jax.random.key(0), (4, 8), jnp.bfloat16)
    params = {"w_df": jnp.zeros((4, 8), jnp.bfloat16)}
    state = tx.init(params)
    steps = 300

    def step(carry, _):
        state = carry
        updates, state = tx.update({"w_df": g}, state, params)
        return state, updates["w_df"]

    state, updates = jax.lax.scan(step, state, None, length=steps)
    adam = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    assert adam.mu["w_df"].dtype == adam.nu["w_df"].dtype == jnp.float32
    g64 = np.asarray(g, np.float64)
    t = np.arange(1, steps + 1, dtype=np.float64)[:, None, None]
    m = (1 - 0.9**t) * g64  # the moments of a constant gradient, closed form
    v = (1 - 0.999**t) * g64**2
    np.testing.assert_allclose(np.asarray(adam.nu["w_df"]), v[-1], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(adam.mu["w_df"]), m[-1], rtol=1e-5)
    ref = -1e-3 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    assert updates.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(updates, np.float64), ref, rtol=2**-8)
