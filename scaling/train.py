"""Loss, the one jitted train step, sharded state init, and the training loop.

The train state is a pure pytree (nested dicts of arrays), born sharded:
    {"params", "opt_state", "step", "rng", "nonfinite": {"count", "first_step", "kind"}}
The model object is rebuilt from (graphdef, params) inside the jitted functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from scaling import accounting, attention, hardware, remat, strict_json
from scaling.checkpoint import CheckpointError, Checkpointer, complete_steps
from scaling.config import AttentionImpl, Config, ConfigError, NonFinitePolicy, RematPolicyName, dump_yaml, to_dict
from scaling.data import Dataset, make_dataset
from scaling.model import Transformer, build_model
from scaling.optim import global_norm, learning_rate_schedule, make_optimizer
from scaling.sharding import axes as A
from scaling.sharding import ShardingError, constrain, get_rule_set, logical_to_spec, make_mesh, sharding_rules, use_sharding
from scaling.sharding.mesh import active
from scaling.sharding.params import logical_axes, param_shardings

NONFINITE_LOSS, NONFINITE_GRADS = 1, 2


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Mean next-token negative log-likelihood in nats, computed in f32."""
    logits = logits_btv.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def chunked_cross_entropy(x_btd: jax.Array, w: jax.Array, targets_bt: jax.Array, chunk: int, layout: str = "dv") -> jax.Array:
    """cross_entropy(x · w, targets) without ever holding the [B, T, V] logits.

    The head matmul (compute dtype in, f32 accumulation) and the log-sum-exp run over chunks of
    `chunk` sequence positions (all batch rows, so batch sharding is kept). Under
    differentiation the same pass also forms the gradients, as Liger-Kernel's fused linear
    cross-entropy does: the loss is a scalar, so its cotangent only scales them. Per chunk,
    d logits = softmax - onehot (f32, rounded to the compute dtype as PyTorch's autocast
    backward has it) feeds two compute-dtype matmuls with f32 accumulation, dx (kept in f32)
    and dW (summed over chunks in f32); the backward scales both by the sum's cotangent (1/N
    under the mean) and rounds once. No logits are stored or recomputed, and all three head matmuls run in the
    compute dtype (the one-pass path multiplies its f32 d logits by the head in f32). The loss
    is the one-pass computation in another order (equal to f32 rounding). w is [D, V] ("dv")
    or [V, D] ("vd", tied embeddings). With the batch split over s devices (the active mesh
    and rules), each device sums its own rows' dW and the s partials are reduced once after
    the loop (a plain [D, V] carry made XLA all-reduce it once per chunk).
    """
    return _chunked_nll_sum(x_btd, w, targets_bt, chunk, layout) / targets_bt.size


def _chunk_logits(x_bcd, w, layout):
    spec = "bcd,dv->bcv" if layout == "dv" else "bcd,vd->bcv"
    logits = jnp.einsum(spec, x_bcd, w, preferred_element_type=jnp.float32)
    return constrain(logits, (A.BATCH, A.SEQ, A.ACT_VOCAB))


def _chunk_nll(x_btd, w, targets_bt, i, chunk, layout):
    """One chunk's logits [B, c, V] f32, their log-sum-exp and the targets' negative log-likelihoods."""
    x_bcd = jax.lax.dynamic_slice_in_dim(x_btd, i * chunk, chunk, axis=1)
    t_bc = jax.lax.dynamic_slice_in_dim(targets_bt, i * chunk, chunk, axis=1)
    logits = _chunk_logits(x_bcd, w, layout)
    lse_bc = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t_bc[..., None], axis=-1)[..., 0]
    return x_bcd, t_bc, logits, lse_bc, jnp.sum(lse_bc - picked)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_nll_sum(x_btd, w, targets_bt, chunk, layout):
    def body(total, i):
        return total + _chunk_nll(x_btd, w, targets_bt, i, chunk, layout)[-1], None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), jnp.arange(x_btd.shape[1] // chunk))
    return total


def _batch_shards(batch: int) -> int:
    """Devices the batch is split over under the active mesh and rules (1 outside one)."""
    ctx = active()
    if ctx is None:
        return 1
    mesh, rules = ctx
    spec = logical_to_spec((A.BATCH,), rules.activations, mesh)
    axes = spec[0] if spec else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    shards = math.prod(mesh.shape[a] for a in axes)
    return shards if shards > 1 and batch % shards == 0 else 1


def _chunked_nll_fwd(x_btd, w, targets_bt, chunk, layout):
    dx_spec = "bcv,dv->bcd" if layout == "dv" else "bcv,vd->bcd"
    # dW sums over the batch, which is split over `s` devices. Summed straight into a [D, V]
    # carry, XLA all-reduces it inside the loop, once per chunk (seen in the compiled HLO).
    # Instead each device accumulates its own rows' partial dW in an [s, D, V] carry sharded
    # like the batch (no communication in the loop) and the s partials are summed once after it.
    s = _batch_shards(x_btd.shape[0])
    dw_spec = "sbcd,sbcv->sdv" if layout == "dv" else "sbcd,sbcv->svd"
    dw_axes = (A.BATCH, None, A.ACT_VOCAB) if layout == "dv" else (A.BATCH, A.ACT_VOCAB, None)

    def by_shard(a_bc_):  # [B, c, ...] -> [s, B/s, c, ...], the leading dim on the batch's devices
        a = a_bc_.reshape(s, a_bc_.shape[0] // s, *a_bc_.shape[1:])
        return constrain(a, (A.BATCH,) + (None,) * (a.ndim - 1))

    def body(carry, i):
        total, dx_btd, dw_s = carry
        x_bcd, t_bc, logits, lse_bc, nll = _chunk_nll(x_btd, w, targets_bt, i, chunk, layout)
        onehot = t_bc[..., None] == jax.lax.broadcasted_iota(t_bc.dtype, logits.shape, 2)
        dlogits = (jnp.exp(logits - lse_bc[..., None]) - onehot).astype(x_btd.dtype)
        dx_bcd = jnp.einsum(dx_spec, dlogits, w, preferred_element_type=jnp.float32)
        dw_s = dw_s + jnp.einsum(dw_spec, by_shard(x_bcd), by_shard(dlogits), preferred_element_type=jnp.float32)
        dw_s = constrain(dw_s, dw_axes)
        dx_btd = jax.lax.dynamic_update_slice_in_dim(dx_btd, dx_bcd, i * chunk, axis=1)
        return (total + nll, dx_btd, dw_s), None

    dw0 = constrain(jnp.zeros((s, *w.shape), jnp.float32), dw_axes)
    init = (jnp.zeros((), jnp.float32), jnp.zeros(x_btd.shape, jnp.float32), dw0)
    (total, dx_btd, dw_s), _ = jax.lax.scan(body, init, jnp.arange(x_btd.shape[1] // chunk))
    dw = jnp.sum(dw_s, axis=0)
    # Empty arrays carry the inputs' dtypes to the backward (residuals must be arrays).
    return total, (dx_btd, dw, jnp.zeros((0,), x_btd.dtype), jnp.zeros((0,), w.dtype))


def _chunked_nll_bwd(chunk, layout, residuals, g):
    dx_btd, dw, x_like, w_like = residuals
    return (g * dx_btd).astype(x_like.dtype), (g * dw).astype(w_like.dtype), None


_chunked_nll_sum.defvjp(_chunked_nll_fwd, _chunked_nll_bwd)


def model_loss(model: Transformer, tokens_bt: jax.Array, loss_chunk: int = 0) -> jax.Array:
    """Mean next-token NLL of a [B, T + 1] token batch; loss_chunk > 0 uses chunked_cross_entropy."""
    inputs_bt, targets_bt = tokens_bt[:, :-1], tokens_bt[:, 1:]
    if not loss_chunk:
        return cross_entropy(model(inputs_bt), targets_bt)
    w, layout = model.head_weight()
    return chunked_cross_entropy(model.hidden_states(inputs_bt), w, targets_bt, loss_chunk, layout)


# ------------------------------------------------------------------------ the setup


@dataclasses.dataclass
class Setup:
    """Everything derived from a config before any array is allocated."""

    cfg: Config
    mesh: Mesh
    graphdef: Any
    param_names: dict
    abstract_params: dict
    tx: optax.GradientTransformation
    state_shardings: dict
    batch_sharding: NamedSharding

    @property
    def rules(self):
        return get_rule_set(self.cfg.mesh.rules)

    def model(self, params) -> Transformer:
        return nnx.merge(self.graphdef, params)


def _build(cfg: Config, seed: int) -> Transformer:
    return build_model(cfg.model, attention=cfg.attention, remat_cfg=cfg.remat, seed=seed)


def check_runnable(setup: Setup) -> None:
    """What training with this setup cannot run, refused before any data or compile (each
    raises an error the command line reports in one line, exit code 2). Not in make_setup:
    abstract setups (shardings, memory tables) may name what this machine cannot run."""
    cfg, mesh = setup.cfg, setup.mesh
    remat.validate_names(cfg.remat.names)
    if cfg.attention.impl == AttentionImpl.cudnn and jax.default_backend() != "gpu":
        raise ConfigError(
            f"attention.impl: cudnn needs a GPU (the backend is {jax.default_backend()!r}); "
            f"allowed here: {', '.join(i.value for i in AttentionImpl if i != AttentionImpl.cudnn)}"
        )
    spec = setup.batch_sharding.spec
    batch_axes = spec[0] if len(spec) else None
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    if cfg.train.batch_size % shards:
        raise ShardingError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by the {shards} devices the batch is split "
            f"over (mesh axes {', '.join(f'{a}={mesh.shape[a]}' for a in batch_axes)} under mesh.rules={cfg.mesh.rules}); "
            f"use a multiple of {shards}, or a mesh with fewer devices on those axes"
        )
    if jax.process_count() > 1:
        process_rows(setup.batch_sharding, (cfg.train.batch_size, cfg.train.seq_len + 1))
    micro = cfg.train.batch_size // cfg.train.grad_accum
    if micro % shards:  # (each micro-batch is split over the same devices: a shard_map refused it, XLA padded it)
        raise ShardingError(
            f"train.batch_size={cfg.train.batch_size} / train.grad_accum={cfg.train.grad_accum} = {micro} rows a "
            f"micro-batch, not divisible by the {shards} devices the batch is split over; make the micro-batch a "
            f"multiple of {shards} (a smaller grad_accum or a larger batch_size)"
        )


def process_rows(sharding, shape: tuple[int, ...], process_of=lambda d: d.process_index) -> dict[int, int]:
    """Per process, how many rows of a `shape` batch its devices hold under `sharding`;
    ShardingError unless each process holds its own rows, B/P of them, none shared.

    Each process feeds only its own rows (scaling.data: process p reads its B/P rows) and
    `make_array_from_process_local_data` places them where that process's devices sit. A mesh
    that does not split the batch across processes (tensor parallelism over hosts) makes the
    processes hold the same rows: each would feed different data into what jax takes for one
    replicated array, and nothing downstream notices."""
    held: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        held.setdefault(process_of(device), set()).update(range(*index[0].indices(shape[0])))
    n = len(held)
    size = shape[0] // n
    shared = set.intersection(*held.values()) if n > 1 else set()
    if n > 1 and (shared or any(len(rows) != size for rows in held.values())):
        counts = {p: len(rows) for p, rows in sorted(held.items())}
        raise ShardingError(
            f"the batch is not split across the {n} processes (rows each holds: {counts} of {shape[0]}): each "
            f"process feeds its own {size} rows, so the mesh must split the batch over the hosts; put mesh.data "
            f"or mesh.fsdp across them (jax.make_mesh puts the first axes across hosts)"
        )
    return {p: len(rows) for p, rows in held.items()}


def make_setup(cfg: Config, devices=None) -> Setup:
    attention.prepare(cfg.attention.impl)  # before any trace: see its docstring
    mesh = make_mesh(cfg.mesh, devices)
    rules = get_rule_set(cfg.mesh.rules)
    abstract_model = nnx.eval_shape(lambda: _build(cfg, 0))
    graphdef, abs_state = nnx.split(abstract_model)
    abstract_params = nnx.to_pure_dict(abs_state)
    names = logical_axes(abstract_model)
    p_shard = param_shardings(names, abstract_params, mesh, rules)
    tx = make_optimizer(cfg.optimizer, cfg.train.steps)
    replicated = NamedSharding(mesh, P())
    abs_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shard = optax.tree_map_params(tx, lambda _, s: s, abs_opt, p_shard, transform_non_params=lambda _: replicated)
    state_shardings = {
        "params": p_shard,
        "opt_state": opt_shard,
        "step": replicated,
        "rng": replicated,
        "nonfinite": {"count": replicated, "first_step": replicated, "kind": replicated},
    }
    batch_spec = logical_to_spec((A.BATCH, None), rules.activations, mesh)
    return Setup(cfg, mesh, graphdef, names, abstract_params, tx, state_shardings, NamedSharding(mesh, batch_spec))


def _init_fn(setup: Setup, seed: int):
    """The state's constructor: traced under jit (init_state) or eval_shape (abstract_state)."""

    def init():
        params = nnx.to_pure_dict(nnx.state(_build(setup.cfg, seed)))
        return {
            "params": params,
            "opt_state": setup.tx.init(params),
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(seed)),
            "nonfinite": {
                "count": jnp.zeros((), jnp.int32),
                "first_step": jnp.full((), -1, jnp.int32),
                "kind": jnp.zeros((), jnp.int32),
            },
        }

    return init


def init_state(setup: Setup, seed: int | None = None) -> dict:
    """Initialise params and optimizer state directly in their shardings (under jit)."""
    seed = setup.cfg.train.seed if seed is None else seed
    with use_sharding(setup.mesh, setup.rules):
        return jax.jit(_init_fn(setup, seed), out_shardings=setup.state_shardings)()


def abstract_state(setup: Setup) -> dict:
    """The state's shapes, dtypes and shardings without allocating it (restore target)."""
    tree = jax.eval_shape(_init_fn(setup, 0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, setup.state_shardings)


# ------------------------------------------------------------------------ the step


def _under_sharding(setup: Setup, fn):
    """fn traced under the setup's mesh and rules, wherever it is first called or lowered: the
    activation constraints (`constrain`) are the identity outside `use_sharding`, and without them
    XLA picked other layouts (tiny on 8 CPU devices with fsdp=8: the whole batch on every device,
    6x the temporary memory)."""

    @functools.wraps(fn)
    def traced(*args):
        with sharding_rules(setup.mesh, setup.rules):  # (use_sharding's jax.set_mesh is refused under jit)
            return fn(*args)

    return traced


def accumulate_grads(grad_fn, params, batch_bt: jax.Array, accum: int):
    """(loss, grads) of `grad_fn` averaged over `accum` equal micro-batches of the batch.

    Summed in f32 whatever the params' dtype (a bfloat16 carry rounded every partial sum: with
    bf16 params the mean of 16 micro-batches was off by about 3x bf16's own rounding), then returned
    in the params' dtypes, as grad_fn gives them."""
    micro = batch_bt.reshape(accum, batch_bt.shape[0] // accum, *batch_bt.shape[1:])

    def body(carry, mb):
        l, g = grad_fn(params, mb)
        return jax.tree.map(lambda c, x: c + x.astype(jnp.float32), carry, (l, g)), None

    zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), (jnp.zeros(()), params))
    (loss, grads), _ = jax.lax.scan(body, zeros, micro)
    return loss / accum, jax.tree.map(lambda g, p: (g / accum).astype(p.dtype), grads, params)


def make_train_step(setup: Setup):
    cfg = setup.cfg
    accum = cfg.train.grad_accum
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)

    def loss_fn(params, tokens_bt):
        return model_loss(setup.model(params), tokens_bt, cfg.train.loss_chunk)

    grad_fn = jax.value_and_grad(loss_fn)

    def step_fn(state, batch_bt):
        params = state["params"]
        if accum == 1:
            loss, grads = grad_fn(params, batch_bt)
        else:
            loss, grads = accumulate_grads(grad_fn, params, batch_bt, accum)
        grad_norm = global_norm(grads)  # float32 for bf16 grads (optax's sums in bf16; an f16 300 squares to inf)
        updates, new_opt = setup.tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)

        # A non-finite step is never applied: `skip` counts it and goes on; `stop` also
        # keeps the last good params, and the host exits at the next check.
        loss_ok, grads_ok = jnp.isfinite(loss), jnp.isfinite(grad_norm)
        ok = loss_ok & grads_ok
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        nf = state["nonfinite"]
        first = (nf["count"] == 0) & ~ok
        new_state = {
            "params": keep(new_params, params),
            "opt_state": keep(new_opt, state["opt_state"]),
            "step": state["step"] + 1,
            "rng": state["rng"],
            "nonfinite": {
                "count": nf["count"] + (~ok).astype(jnp.int32),
                "first_step": jnp.where(first, state["step"] + 1, nf["first_step"]),
                "kind": jnp.where(first, jnp.where(loss_ok, NONFINITE_GRADS, NONFINITE_LOSS), nf["kind"]),
            },
        }
        # The optimizer's schedule counts applied updates: a skipped (non-finite) step leaves its
        # count where it was, so this step's lr is the schedule at step - skipped steps so far.
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"] - nf["count"])}
        return new_state, metrics

    return jax.jit(
        _under_sharding(setup, step_fn),
        in_shardings=(setup.state_shardings, setup.batch_sharding),
        out_shardings=(setup.state_shardings, None),
        donate_argnums=(0,),
        compiler_options=train_step_compiler_options(cfg),
    )


def train_step_compiler_options(cfg: Config) -> dict[str, Any]:
    """XLA options for the train step. Scanned layers under remat `none` stack the attention
    core's outputs as residuals; XLA:GPU's dynamic-slice fusion then runs the (custom-call) flash
    forward twice per layer, once for the layer and once to write the stack (the compiled HLO:
    docs/benchmarks.md, "Forty-eighth session"). Without that fusion the H200 step was 1.1-2.1%
    faster (350m, 1b; batch 4-8, accumulation too); under `full` and `dots`, which do not save the
    core's outputs, it was level to 0.9% slower, so they keep XLA's default. (A GPU option: XLA's
    other backends ignore it.)"""
    if cfg.model.scan_layers and cfg.remat.policy == RematPolicyName.none:
        return {"xla_gpu_enable_dynamic_slice_fusion": False}
    return {}


def make_eval_step(setup: Setup):
    cfg = setup.cfg
    accum = cfg.train.grad_accum

    def eval_fn(params, batch_bt):
        if accum == 1:
            return model_loss(setup.model(params), batch_bt, cfg.train.loss_chunk)
        # The train step's micro-batches: an eval batch needs no more memory than a training
        # micro-batch (the whole batch at once would hold grad_accum x its activations and
        # logits). Equal sizes, so the mean of the micro-batch means is the batch mean.
        micro = batch_bt.reshape(accum, batch_bt.shape[0] // accum, batch_bt.shape[1])

        def body(total, mb):
            return total + model_loss(setup.model(params), mb, cfg.train.loss_chunk), None

        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), micro)
        return total / accum

    return jax.jit(_under_sharding(setup, eval_fn), in_shardings=(setup.state_shardings["params"], setup.batch_sharding))


def global_batch(setup: Setup, local_rows: np.ndarray) -> jax.Array:
    """Assemble this process's rows into the global, sharded batch array."""
    return jax.make_array_from_process_local_data(setup.batch_sharding, local_rows)


# ------------------------------------------------------------------------ the loop


class _Preemption:
    """SIGTERM/SIGINT: finish the step, checkpoint, exit 0. A second signal exits at once.

    The first signal only sets a flag (the loop checks it after each step) and restores
    the OS's default action for both signals, so a second one terminates the process
    immediately, even while the main thread is inside a compile or a device call where a
    Python-level handler would not run (exit status 128 + signum in a shell).

    Several processes must stop at the same step: a save is collective, so a process that
    saved at step 10 while another ran step 11 left both hung and no checkpoint. There SIGTERM
    is left to JAX's preemption notifier (installed by jax.distributed.initialize), which tells
    every process and picks one step for all (`reached`, called after every step); a SIGINT is
    handed to it as a SIGTERM.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._received: str | None = None  # (multi-host: a SIGINT this process handed on)
        self._old = {}
        from jax._src import distributed as _distributed  # (no public accessor for the manager)

        # The notifier exists only with jax.distributed and jax_enable_preemption_service (default on).
        self.synced = jax.process_count() > 1 and _distributed.global_state.preemption_sync_manager is not None

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        for sig in self._old:
            signal.signal(sig, signal.SIG_DFL)
        if self.synced:
            self._received = name
            os.kill(os.getpid(), signal.SIGTERM)  # -> JAX's notifier (SIGTERM is its signal)
            os.write(2, f"\n{name}: every process finishes the step they agree on, saves a checkpoint and exits; "
                        f"send SIGINT again to exit now without one\n".encode())
            return
        self.requested = name
        # os.write: print() is not safe here (the main thread may be inside a print).
        os.write(2, f"\n{name}: finishing this step, then saving a checkpoint; send it again to exit now without one\n".encode())

    def reached(self, step: int) -> bool:
        """Whether to save and exit after `step`: this process's signal, or, across processes,
        the step JAX's preemption sync picked (every process gets True at the same step)."""
        if self.synced:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                here = f"{self._received} here, " if self._received else ""
                self.requested = f"{here}SIGTERM to one of the processes (JAX's preemption sync)"
        return self.requested is not None

    def __enter__(self):
        # Multi-host: SIGTERM stays with JAX's notifier (a Python handler would replace it).
        for sig in (signal.SIGINT,) if self.synced else self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. inside some test runners)
                pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class NonFiniteError(RuntimeError):
    pass


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


# How a config field that differs from the checkpoint's bears on the resumed run. Kept as
# data, one entry per field (tests/test_train.py checks that every field has one), so a new
# field is classified on purpose. A field missing here (one an older checkpoint still has)
# counts as TRAJECTORY: warning about nothing is cheaper than hiding a change.
TRAJECTORY = "trajectory"  # what is computed, with what precision, or on which data
LAYOUT = "layout"  # the same math placed or scheduled otherwise: equal up to summation order
BOOKKEEPING = "bookkeeping"  # what is logged, evaluated, traced or saved; or read by nothing after the restore
LAUNCH = "launch"  # where and how the process starts: not compared (a moved run, another host)

RESUME_FIELD_KINDS: dict[str, str] = {
    # Shape fields (vocab_size ... mlp_dim, tie_embeddings) never get here: a model that does
    # not fit the checkpoint is refused by Checkpointer.check_compatible.
    **dict.fromkeys((
        "model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads",
        "model.head_dim", "model.mlp_dim", "model.rope_theta", "model.rope_scaling_factor",
        "model.rope_low_freq_factor", "model.rope_high_freq_factor", "model.rope_original_max_len",
        "model.norm_eps", "model.tie_embeddings", "model.param_dtype", "model.compute_dtype",
    ), TRAJECTORY),
    "model.init_std": BOOKKEEPING,  # read only by init, which a resume skips
    "model.max_seq_len": BOOKKEEPING,  # bounds seq_len and generation; RoPE is computed per position
    "model.scan_layers": LAYOUT,  # the same stacked parameters walked by scan or by a loop
    # Shardings only: a checkpoint restores onto any mesh, and the rule sets map the same
    # logical axes onto it (losses identical on CPU with mesh.rules=dp).
    **dict.fromkeys(("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.rules", "mesh.axis_type"), LAYOUT),
    **dict.fromkeys(("mesh.coordinator_address", "mesh.num_processes", "mesh.process_id"), LAUNCH),
    # steps: the learning-rate schedule is a function of it; batch_size, seq_len and seed: the
    # data seen; loss_chunk: its backward runs the head's matmuls in the compute dtype.
    **dict.fromkeys(("train.steps", "train.batch_size", "train.seq_len", "train.seed", "train.nonfinite",
                     "train.loss_chunk"), TRAJECTORY),
    "train.grad_accum": LAYOUT,  # equal micro-batches: the same batch mean, summed in another order
    **dict.fromkeys(("train.log_every", "train.eval_every", "train.eval_batches", "train.show_shardings"),
                    BOOKKEEPING),
    **dict.fromkeys((
        "optimizer.learning_rate", "optimizer.warmup_steps", "optimizer.schedule", "optimizer.min_lr_ratio",
        "optimizer.b1", "optimizer.b2", "optimizer.eps", "optimizer.weight_decay", "optimizer.decay_embeddings",
        "optimizer.clip_norm",
    ), TRAJECTORY),
    **dict.fromkeys(("data.source", "data.path", "data.tokenizer", "data.eval_fraction", "data.max_corpus_mb"),
                    TRAJECTORY),
    "data.cache_dir": BOOKKEEPING,  # where tokenized corpora are kept, keyed by what they hold
    # Other kernels round differently (not only in another order); the workspace size picks
    # between our backward's kernels too.
    **dict.fromkeys(("attention.impl", "attention.bwd_workspace_mb"), TRAJECTORY),
    # Recomputing saved activations repeats the same ops (losses identical on CPU).
    **dict.fromkeys(("remat.policy", "remat.names"), LAYOUT),
    **dict.fromkeys(("checkpoint.enabled", "checkpoint.every", "checkpoint.keep", "checkpoint.keep_period",
                     "checkpoint.async_save", "logging.tensorboard", "logging.progress", "profile.steps"),
                    BOOKKEEPING),
    "run_dir": LAUNCH,
}

# The info line's words for the kinds that leave the trajectory as it was.
_HARMLESS = {LAYOUT: "same math up to summation order", BOOKKEEPING: "observation or bookkeeping only"}


def changed_fields(saved: dict | None, current: dict) -> dict[str, list[tuple[str, Any, Any]]]:
    """Kind -> (field, checkpoint's value, current value) for each compared field that differs."""
    if not saved:
        return {}
    a, b = _flatten(saved), _flatten(current)
    out: dict[str, list[tuple[str, Any, Any]]] = {}
    for k in sorted(set(a) | set(b)):
        kind = RESUME_FIELD_KINDS.get(k, TRAJECTORY)
        if kind != LAUNCH and a.get(k) != b.get(k):  # (absent == None: a new field left unset)
            out.setdefault(kind, []).append((k, a.get(k, "(absent)"), b.get(k, "(absent)")))
    return out


def resume_config_messages(saved: dict | None, current: dict) -> list[str]:
    """What a resume logs about its config's changes: a warning naming each change to the
    trajectory with both values, then one line naming the harmless ones. Those are named at
    all because a flag that seems to do nothing is confusing, and a layout change explains
    losses that differ from an uninterrupted run's in the last bits."""
    changed = changed_fields(saved, current)
    lines = []
    if TRAJECTORY in changed:
        lines.append("warning: resuming with settings that change the training trajectory from the checkpoint's "
                     "(the run continues with the new values):\n  "
                     + "\n  ".join(f"{k}: checkpoint {old!r}, now {new!r}" for k, old, new in changed[TRAJECTORY]))
    harmless = [f"{', '.join(k for k, _, _ in changed[kind])} ({words})"
                for kind, words in _HARMLESS.items() if kind in changed]
    if harmless:
        lines.append("resuming with other changed settings that leave the trajectory as it was: " + "; ".join(harmless))
    return lines


def default_run_dir(config_path: str | None) -> str:
    name = Path(config_path).stem if config_path else "run"
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


class MetricsLogger:
    """metrics.jsonl (append, flushed per record) + TensorBoard event files.

    A run that starts at `start_step` (0, or the step it resumed from) first drops the
    records after that step: they came from an interrupted run whose later steps are being
    redone, so the file always holds one record per logged step of one trajectory.
    """

    def __init__(self, run_dir: Path, tensorboard: bool, enabled: bool = True, start_step: int = 0, log=print):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        if enabled:
            dropped = truncate_metrics(self.path, start_step)
            if dropped:
                log(f"metrics: dropped {dropped} records after step {start_step} from the interrupted run")
        self.file = open(self.path, "a") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step hides events at or after it that an earlier start wrote: like the records
            # dropped above, also on a start from step 0 (a run stopped before its first checkpoint).
            # tensorboardX names a file by the second it opens it and opens it with "wb": a start
            # in the same second as the last one would erase that one's events. The nanosecond
            # suffix keeps the names apart and in the order TensorBoard reads them (by name).
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1,
                                    filename_suffix=f".{time.time_ns()}")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        # Strict JSON: a non-finite value (a skipped step's loss under nonfinite=skip) is null;
        # nonfinite_steps says how many there were.
        self.file.write(strict_json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep only the records of steps <= last_step (and no torn last line); returns how many went."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            ok = json.loads(line)["step"] <= last_step
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            ok = False
        if ok:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return dropped


def _evaluate(eval_step, params, setup: Setup, data: Dataset) -> float | None:
    if data.eval is None:
        return None
    # Held-out text has a fixed number of windows; synthetic eval batches are endless.
    windows = getattr(data.eval, "num_windows", None)
    n = setup.cfg.train.eval_batches
    if windows is not None:
        n = min(n, windows // data.eval.global_batch or 1)
    losses = [eval_step(params, global_batch(setup, data.eval.batch(i))) for i in range(n)]
    return float(jnp.mean(jnp.stack(losses)))


def _untraced_profile_window(window: tuple[int, ...], start_step: int, total: int) -> str | None:
    """Why profile.steps [start, stop) will not be traced by this run, or None when it will be.

    The trace starts only at the window's first step, so a run resumed past it, or one that
    ends before it, would otherwise skip the trace without a word."""
    first, stop = window
    if start_step >= total:
        return None  # nothing to train, so nothing to trace either (said elsewhere)
    if first < start_step:
        return (f"profile: no trace: profile.steps=[{first}, {stop}) starts before step {start_step}, where this "
                f"run resumes (choose a window from step {start_step})")
    if first >= total:
        return (f"profile: no trace: profile.steps=[{first}, {stop}) starts at or after the last step "
                f"(train.steps={total})")
    return None


def _summarize_profile(profile_dir: Path, steps: int, write) -> None:
    """Device time per step by category (scaling.profile_summary) -> <profile_dir>/summary.md."""
    from scaling import profile_summary

    try:
        s, _ = profile_summary.summarize_path(profile_dir)
        if s["steps_source"].startswith("unknown"):
            s, _ = profile_summary.summarize_path(profile_dir, steps=steps)
        (profile_dir / "summary.md").write_text(profile_summary.to_markdown(s, title=f"profile of {steps} steps"))
        n = s["steps"]
        cats = ", ".join(f"{k} {v['us'] / n / 1e3:.2f}" for k, v in s["categories"].items() if v["us"])
        write(f"profile: per step {s['window_us'] / n / 1e3:.2f} ms = {cats}, idle {s['idle_us'] / n / 1e3:.2f} (ms); "
              f"details in {profile_dir / 'summary.md'}")
    except Exception as e:  # a summary is a convenience; never fail the run over it
        write(f"profile: no summary ({type(e).__name__}: {e})")


def train(cfg: Config, run_dir: str | None = None, *, config_path: str | None = None, log=None, devices=None) -> dict:
    """Train per `cfg`; resumes from the latest checkpoint in `run_dir` if there is one.

    Returns a summary: final step, final (window-mean) train loss, last eval loss, etc.
    """
    from scaling.distributed import maybe_initialize

    maybe_initialize(cfg.mesh)
    is_main = jax.process_index() == 0
    log = log or (lambda msg: print(msg, flush=True) if is_main else None)
    if run_dir is not None and not str(run_dir).strip():
        # `--run_dir=$DIR` with DIR unset: a fresh run under a default name would silently not
        # resume the run the caller meant (config files refuse an empty run_dir alike).
        raise ConfigError("--run_dir: must not be empty (leave it out for runs/<config name>-<timestamp>)")
    run_dir_path = Path(run_dir or cfg.run_dir or default_run_dir(config_path))
    created = not run_dir_path.exists()
    try:
        run_dir_path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission, ...: bad input, not a crash
        why = "it is a file" if run_dir_path.is_file() else (e.strerror or str(e))
        raise ConfigError(f"run_dir: cannot use {str(run_dir_path)!r} as the run directory ({why})") from None
    try:
        with _run_dir_lock(run_dir_path):
            return _train(cfg, run_dir_path, is_main, log, devices)
    except BaseException:
        # A start refused before writing anything (missing data, a mesh that does not fit) had left
        # a directory holding only .lock. Only one this call made, and only when nothing else is in it.
        if created and jax.process_count() == 1 and {p.name for p in run_dir_path.iterdir()} <= {".lock"}:
            (run_dir_path / ".lock").unlink(missing_ok=True)
            run_dir_path.rmdir()
        raise


@contextlib.contextmanager
def _run_dir_lock(run_dir: Path):
    """Refuse a second training process on the same run directory (the same command started
    twice, a job requeued while the old one still runs): it would remove the first one's save in
    progress as a partial checkpoint, and both would write the same steps and metrics.jsonl.
    An flock on <run_dir>/.lock: the OS releases it when the process ends, however it ends, so
    a killed run never leaves a stale lock. Not for a multi-host job, whose processes share the
    directory by design."""
    if jax.process_count() > 1:
        yield
        return
    with open(run_dir / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ConfigError(f"run_dir: {str(run_dir)!r} is in use by a training process ({holder}); wait for it "
                              "to end, stop it (SIGTERM saves a checkpoint), or choose another --run_dir") from None
        except OSError:  # a filesystem without locks: train unguarded, as before
            locked = False
        if locked:
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def _train(cfg: Config, run_dir_path: Path, is_main: bool, log, devices) -> dict:
    setup = make_setup(cfg, devices)  # devices: default all; tests pass a subset
    check_runnable(setup)
    data = make_dataset(cfg, process_index=jax.process_index(), process_count=jax.process_count(), log=log)

    if cfg.remat.names and cfg.remat.policy not in (RematPolicyName.names, RematPolicyName.offload):
        # Not an error: one YAML file may list the names while the command line switches policy.
        log(f"remat: remat.names {list(cfg.remat.names)} is read only by the names and offload policies; "
            f"remat.policy={cfg.remat.policy.value} ignores it")
    if cfg.train.show_shardings and is_main:
        from scaling.sharding.report import sharding_report

        log(sharding_report(setup))

    ckpt = Checkpointer(run_dir_path, cfg.checkpoint) if cfg.checkpoint.enabled else None
    ignored = complete_steps(run_dir_path / "checkpoints") if ckpt is None else []
    if ignored:  # (a start from step 0 whose records replace the ones of those checkpoints' run)
        log(f"checkpoint.enabled=false: not resuming from the checkpoints in {run_dir_path / 'checkpoints'} "
            f"(latest step {ignored[-1]}); training from step 0, and metrics.jsonl restarts with it")
    state = None
    restored_window: list = []
    if ckpt is not None:
        for p in ckpt.partial:
            log(f"checkpoint: ignoring and removing partial save {p} (interrupted before it was committed)")
        restored = ckpt.restore(abstract_state(setup), config=to_dict(cfg), log=log)
        if restored is not None:
            state = restored.state
            data.train.restore(restored.meta["loader"])
            log(f"resuming from checkpoint step {restored.step} in {ckpt.directory}")
            for line in resume_config_messages(restored.meta.get("config"), to_dict(cfg)):
                log(line)
            # Per-step losses of the log window the checkpoint was saved inside (steps after
            # the last logged one), so the next record's window mean is the uninterrupted run's.
            restored_window = [{"loss": np.float32(float.fromhex(h))} for h in restored.meta.get("window_losses", [])]
            if restored.step >= cfg.train.steps:
                log(f"checkpoint step {restored.step} already reaches train.steps={cfg.train.steps}; nothing to train")
    if is_main:
        # Only now: a start refused above (a model that does not fit the checkpoint, bad data)
        # left the run's config and tokenizer, which `generate` reads with its checkpoints, as
        # they were.
        (run_dir_path / "config.yaml").write_text(dump_yaml(cfg))
        if data.tokenizer_path is not None:
            (run_dir_path / "tokenizer.json").write_bytes(data.tokenizer_path.read_bytes())
    if state is None:
        state = init_state(setup)

    train_step = make_train_step(setup)
    eval_step = make_eval_step(setup)
    start_step = int(state["step"])
    total = cfg.train.steps

    flops = accounting.flops_per_token(cfg.model, cfg.train.seq_len)
    hw = hardware.detect()
    peak = hw.bf16_flops * setup.mesh.size if hw else None  # the devices this run uses (all of them by default)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len

    if cfg.profile.steps and is_main:
        note = _untraced_profile_window(cfg.profile.steps, start_step, total)
        if note:
            log(note)
    logger = MetricsLogger(run_dir_path, cfg.logging.tensorboard, enabled=is_main, start_step=start_step, log=log)
    bar = None
    if cfg.logging.progress and is_main and start_step < total:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
    write = bar.write if bar is not None else log

    def save(step: int, force: bool = False):
        if ckpt is None:
            return
        nf = int(state["nonfinite"]["count"])
        if nf and cfg.train.nonfinite == NonFinitePolicy.stop:
            return  # never checkpoint past a non-finite step under `stop`
        # The losses of the steps since the last log record (exact, as float32 hex strings):
        # a run resumed from here logs the same window mean as one never interrupted.
        losses = [float(np.float32(x["loss"])).hex() for x in jax.device_get(window)]
        meta = {"loader": data.train.state(), "config": to_dict(cfg), "window_losses": losses}
        ckpt.save(step, state, meta, force=force)

    def check_nonfinite():
        nf = jax.device_get(state["nonfinite"])
        if int(nf["count"]) and cfg.train.nonfinite == NonFinitePolicy.stop:
            kind = "loss" if int(nf["kind"]) == NONFINITE_LOSS else "gradients"
            kept, failed_save = "no checkpoint was written", ""
            if ckpt is not None:
                try:
                    ckpt.wait()
                except CheckpointError as e:  # (it had replaced the non-finite report, exit 1 for 3)
                    failed_save = f"; also, {e}"
                good = ckpt.latest_step()
                kept = f"the last good checkpoint (step {good}) is kept" if good is not None else kept
            raise NonFiniteError(
                f"non-finite {kind} at step {int(nf['first_step'])}; the update was not applied and {kept} "
                f"(train.nonfinite=skip drops such steps instead){failed_save}"
            )

    summary: dict[str, Any] = {"run_dir": str(run_dir_path), "start_step": start_step}
    window: list = restored_window
    in_flight = None  # the last dispatched step's metrics
    first_step_s = None  # the compiling first step's wall time, until the first record takes it
    t_window = time.perf_counter()
    steps_in_window = 0
    eval_loss = None
    profiling = False
    exit_reason = "done"
    try:
        with _Preemption() as pre, use_sharding(setup.mesh, setup.rules):
            step = start_step
            while step < total:
                if cfg.profile.steps and step == cfg.profile.steps[0] and is_main:
                    # The previous step may still be running (the host keeps one step ahead):
                    # wait for it, or the trace holds part of it too and the summary counts it.
                    jax.block_until_ready(state)
                    jax.profiler.start_trace(str(run_dir_path / "profile"), create_perfetto_trace=True)
                    profiling = True
                batch = global_batch(setup, next(data.train))
                state, metrics = train_step(state, batch)
                step += 1
                steps_in_window += 1
                window.append(metrics)
                # Keep the host at most one step ahead of the device: wait for the previous
                # step while this one runs. Unbounded, the host dispatched every step up to the
                # next log step and then sat in one long wait, where a SIGTERM's handler cannot
                # run: the "finish this step and save" of a preemption came a whole log window
                # late (and the progress bar counted dispatches, not steps).
                if in_flight is not None:
                    jax.block_until_ready(in_flight)
                in_flight = metrics
                if ckpt is not None and jax.process_count() == 1:
                    # A failed background save stops the run now, not a whole checkpoint.every later.
                    # (One process only: processes that saw the failure at different steps would
                    # leave the others waiting in a collective.)
                    ckpt.check()
                if step == start_step + 1:
                    # The first step of a start compiles: time it apart (first_step_s in the first
                    # record) and start the window's clock after it, so tokens/s and mfu are rates.
                    jax.block_until_ready(metrics)
                    first_step_s = time.perf_counter() - t_window
                    t_window, steps_in_window = time.perf_counter(), 0
                if profiling and (step == cfg.profile.steps[1] or step == total):
                    # (a window past train.steps ends with the run: traced and summarized as far as it went)
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                    profiling = False
                    traced = (cfg.profile.steps[0], step)
                    write(f"profile: trace of steps {traced} written to {run_dir_path / 'profile'}")
                    _summarize_profile(run_dir_path / "profile", traced[1] - traced[0], write)
                if bar is not None:
                    bar.update(1)

                last = step == total
                if step % cfg.train.log_every == 0 or last:
                    m = jax.device_get(window)
                    dt = time.perf_counter() - t_window
                    # (None where the window holds only the compiling first step: log_every=1)
                    tps = steps_in_window * tokens_per_step / dt if steps_in_window else None
                    rec = {
                        "step": step,
                        "loss": float(np.mean([x["loss"] for x in m])),
                        "grad_norm": float(m[-1]["grad_norm"]),
                        "lr": float(m[-1]["lr"]),
                        "tokens_per_sec": tps,
                        "step_time": dt / steps_in_window if steps_in_window else None,
                        "mfu": (flops.total * tps / peak) if peak and tps else None,
                        "nonfinite_steps": int(state["nonfinite"]["count"]),
                    }
                    if first_step_s is not None:
                        rec["first_step_s"] = first_step_s
                        first_step_s = None
                    logger.log(rec)
                    summary["loss"] = rec["loss"]
                    mfu = f" mfu {rec['mfu']:.1%}" if rec["mfu"] is not None else ""
                    rate = f" tok/s {tps:,.0f}" if tps is not None else ""
                    first = f" (first step, compile included: {rec['first_step_s']:.1f}s)" if "first_step_s" in rec else ""
                    write(
                        f"step {step:>6} loss {rec['loss']:.4f} grad_norm {rec['grad_norm']:.3f} "
                        f"lr {rec['lr']:.2e}{rate}{mfu}{first}"
                    )
                    if bar is not None:
                        bar.set_postfix(loss=f"{rec['loss']:.3f}")
                    check_nonfinite()
                    window, steps_in_window, t_window = [], 0, time.perf_counter()
                if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or last):
                    # Keep eval out of tokens/s: the window's clock is moved on by the eval's
                    # time (the steps dispatched so far finish first), so a window that an eval
                    # falls inside still counts the time of all its steps and only theirs.
                    jax.block_until_ready(state)
                    t_eval = time.perf_counter()
                    eval_loss = _evaluate(eval_step, state["params"], setup, data)
                    t_window += time.perf_counter() - t_eval
                    if eval_loss is not None:
                        logger.log({"step": step, "eval_loss": eval_loss})
                        write(f"step {step:>6} eval_loss {eval_loss:.4f}")
                if ckpt is not None and (ckpt.should_save(step) or last):
                    check_nonfinite()
                    save(step, force=last)
                if pre.reached(step) and not last:
                    check_nonfinite()
                    save(step, force=True)
                    if ckpt is not None:
                        ckpt.wait()
                    exit_reason = "preempted"
                    msg = f"{pre.requested}: saved checkpoint at step {step} in {run_dir_path}; exiting"
                    write(msg)
                    break
    finally:
        propagating = sys.exc_info()[1]
        if profiling:
            jax.profiler.stop_trace()
        if bar is not None:
            bar.close()
        if ckpt is not None:
            try:
                ckpt.close()
            except CheckpointError as e:
                if propagating is None:
                    raise
                # An error already on its way out (a non-finite loss's exit 3, an out-of-memory
                # message) had been replaced by this one: report the failed save beside it instead.
                log(f"warning: {e}")
                propagating.add_note(f"also: {e}")
        logger.close()
    summary.update(step=int(state["step"]), eval_loss=eval_loss, exit=exit_reason, state=state, setup=setup)
    return summary
