"""Gaps found by mutation testing scaling/train.py and scaling/data.py: each test here failed
on a small plausible bug (named in its docstring) that the rest of the suite let through.

Each compares with an independent reference: a float64 numpy loss, a hand-driven step loop,
the token positions of an arange token file, set algebra over the windows served.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scaling.train as T
from scaling.config import load_config
from scaling.data import Batches, make_dataset

from test_probe_train import SMALL, TINY  # the one-layer synthetic config the loop tests share


def _nll64(logits, targets) -> float:
    """Mean next-token NLL in float64 numpy."""
    z = np.asarray(logits, np.float64)
    m = z.max(-1, keepdims=True)
    logz = np.log(np.exp(z - m).sum(-1)) + m[..., 0]
    return float(np.mean(logz - np.take_along_axis(z, np.asarray(targets)[..., None], -1)[..., 0]))


# ------------------------------------------------------------------ the loss


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_chunked_loss_value_alone_equals_float64_numpy(layout):
    """Undifferentiated (as eval calls it), chunked_cross_entropy runs its primal, not the
    custom-vjp forward the gradient tests exercise. Mutant: the primal's scan dropped the last
    chunk (eval loss silently over T - chunk positions, or 0 with one chunk)."""
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 16, 8, 40
    x = rng.standard_normal((b, t, d)).astype(np.float32)
    w = rng.standard_normal((d, v) if layout == "dv" else (v, d)).astype(np.float32)
    tgt = rng.integers(0, v, (b, t)).astype(np.int32)
    logits = np.einsum("btd,dv->btv" if layout == "dv" else "btd,vd->btv", x.astype(np.float64), w.astype(np.float64))
    want = _nll64(logits, tgt)
    for chunk in (1, 4, 16):
        got = jax.jit(lambda x, w, t, c=chunk: T.chunked_cross_entropy(x, w, t, c, layout))(x, w, tgt)
        assert float(got) == pytest.approx(want, rel=1e-5), chunk


def test_eval_step_with_loss_chunk_equals_float64_numpy():
    """The eval step under train.loss_chunk against numpy's loss of the model's logits."""
    cfg = load_config(TINY, SMALL + ["--train.loss_chunk=4"])
    setup = T.make_setup(cfg, devices=jax.devices()[:1])
    params = T.init_state(setup)["params"]
    tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (4, 17), dtype=np.int32)
    got = float(T.make_eval_step(setup)(params, T.global_batch(setup, tokens)))
    logits = setup.model(jax.device_get(params))(jnp.asarray(tokens[:, :-1]))
    assert got == pytest.approx(_nll64(logits, tokens[:, 1:]), rel=1e-5)


# ------------------------------------------------------------------ the step


@jax.custom_vjp
def _inf_gradient(x):
    return x


_inf_gradient.defvjp(lambda x: (x, None), lambda _, g: (g * jnp.inf,))


def test_nonfinite_gradients_under_a_finite_loss_are_not_applied(monkeypatch):
    """The guard must look at the gradients, not only the loss (an overflow in the backward
    alone). Mutant: ok = isfinite(loss) -> the NaN/inf update was applied."""
    real = T.model_loss
    monkeypatch.setattr(T, "model_loss", lambda model, tokens, chunk=0: _inf_gradient(real(model, tokens, chunk)))
    cfg = load_config(TINY, SMALL + ["--train.nonfinite=skip", "--optimizer.warmup_steps=0"])
    setup = T.make_setup(cfg, devices=jax.devices()[:1])
    state = T.init_state(setup)
    before = jax.device_get({k: state[k] for k in ("params", "opt_state")})
    tokens = make_dataset(cfg).train.batch(0)
    state, m = T.make_train_step(setup)(state, T.global_batch(setup, tokens))
    assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
    after = jax.device_get(state)
    for k in ("params", "opt_state"):
        for a, b in zip(jax.tree.leaves(before[k]), jax.tree.leaves(after[k]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    nf = after["nonfinite"]
    assert (int(nf["count"]), int(nf["first_step"]), int(nf["kind"])) == (1, 1, T.NONFINITE_GRADS)
    assert int(after["step"]) == 1


# ------------------------------------------------------------------ the loop


def test_logged_records_are_window_means_of_a_hand_driven_loop(tmp_path):
    """train()'s records against a loop driven by hand: step i (0-based) trains on batch i of
    the loader, each record's loss is the mean of its window's per-step losses and its
    grad_norm / lr are the window's last step's. Mutants: the record's loss was the last
    step's; the loop fed batch i + 1 at step i."""
    cfg = load_config(TINY, SMALL + ["--train.steps=6", "--train.log_every=3", "--train.eval_every=0",
                                     "--checkpoint.enabled=false"])
    T.train(cfg, str(tmp_path / "run"), log=lambda m: None, devices=jax.devices()[:1])
    recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]

    setup = T.make_setup(cfg, devices=jax.devices()[:1])
    state, step, data = T.init_state(setup), T.make_train_step(setup), make_dataset(cfg)
    per_step = []
    for i in range(cfg.train.steps):
        state, m = step(state, T.global_batch(setup, data.train.batch(i)))
        per_step.append({k: float(v) for k, v in m.items()})
    assert [r["step"] for r in recs] == [3, 6]
    for r in recs:
        window = per_step[r["step"] - 3 : r["step"]]
        assert r["loss"] == pytest.approx(float(np.mean([np.float32(x["loss"]) for x in window])), rel=1e-6)
        assert r["grad_norm"] == pytest.approx(window[-1]["grad_norm"], rel=1e-6)
        assert r["lr"] == pytest.approx(window[-1]["lr"], rel=1e-6)
    assert len({round(x["loss"], 6) for x in per_step[:3]}) == 3  # (the window's losses differ: a mean is tested)


def test_eval_reads_each_held_out_window_at_most_once(tmp_path):
    """eval_batches beyond the held-out split is capped at its whole batches. Mutant: one batch
    too many, whose rows past the split's end wrapped around to its first windows again."""
    np.save(tmp_path / "t.npy", np.arange(2000, dtype=np.uint16))  # eval split: tokens 1800.. (12 windows)
    cfg = load_config(TINY, ["--data.source=tokens", f"--data.path={tmp_path / 't.npy'}", "--model.vocab_size=2048",
                             "--train.seq_len=16", "--train.batch_size=5", "--train.eval_batches=10",
                             "--data.eval_fraction=0.1"])
    setup = T.make_setup(cfg, devices=jax.devices()[:1])
    data = make_dataset(cfg, log=lambda m: None)
    seen = []

    def eval_step(params, batch):
        seen.append(np.asarray(batch))
        return jnp.zeros((), jnp.float32)

    T._evaluate(eval_step, None, setup, data)
    starts = [int(row[0]) for b in seen for row in b]
    assert len(set(starts)) == len(starts) and min(starts) >= 1800 and max(starts) + 16 < 2000, starts
    assert len(seen) == 2  # 12 windows: two whole batches of 5


# ------------------------------------------------------------------ the data


def test_batches_straddling_epochs_serve_each_window_once_per_epoch_in_a_new_order():
    """7 windows in batches of 3: batches straddle the epoch boundaries. The flat stream of
    windows served, cut into epochs of 7, must be 3 permutations of all 7 windows, each epoch
    in a different order, and the same for two processes' halves and a resumed loader.
    Mutants: a straddling batch took its next-epoch rows from the old epoch's order (windows
    served twice, others skipped); every epoch reused epoch 0's order."""
    seq = 4
    tokens = np.arange(7 * seq + 1, dtype=np.uint16)  # window w starts at token 4 w
    a = Batches(tokens, seq, 3, seed=5)
    served = np.concatenate([a.batch(i)[:, 0] // seq for i in range(7)])  # 21 rows = 3 epochs
    epochs = served.reshape(3, 7)
    for e in epochs:
        assert sorted(e.tolist()) == list(range(7)), epochs
    assert len({tuple(e) for e in epochs}) == 3, epochs
    # Rows of a straddling batch follow each other in the stream, whichever process reads them.
    p = [Batches(tokens, seq, 2, seed=5, process_index=i, process_count=2) for i in range(2)]
    two = np.concatenate([np.concatenate([p[0].batch(i), p[1].batch(i)])[:, 0] // seq for i in range(7)])
    b2 = Batches(tokens, seq, 2, seed=5)
    np.testing.assert_array_equal(two, np.concatenate([b2.batch(i)[:, 0] // seq for i in range(7)]))
    np.testing.assert_array_equal(two, served[:14])  # the flat order does not depend on the batch size
    r = Batches(tokens, seq, 3, seed=5)
    r.restore({"next_index": 2})  # batch 2 = rows 6, 7, 8: across the first boundary
    np.testing.assert_array_equal(next(r)[:, 0] // seq, served[6:9])


def test_train_and_eval_splits_of_a_token_file_are_disjoint_and_whole(tmp_path):
    """An arange token file: every token is its own position. Training (one whole epoch)
    touches only positions before the held-out tail, eval walks the tail in order from its
    start. Mutants: eval read the training split; the training split included the tail."""
    n, seq = 4000, 16
    np.save(tmp_path / "t.npy", np.arange(n, dtype=np.uint16))
    cfg = load_config(TINY, ["--data.source=tokens", f"--data.path={tmp_path / 't.npy'}", "--model.vocab_size=4096",
                             f"--train.seq_len={seq}", "--train.batch_size=4", "--data.eval_fraction=0.1"])
    data = make_dataset(cfg, log=lambda m: None)
    cut = int(n * 0.9)
    windows = (cut - 1) // seq
    rows = np.concatenate([data.train.batch(i) for i in range(windows // 4)])
    assert rows.max() < cut
    assert sorted(rows[:, 0].tolist()) == [seq * w for w in range(windows)][: len(rows)]
    for i in range(3):
        b = data.eval.batch(i)
        want = cut + seq * (4 * i + np.arange(4))[:, None] + np.arange(seq + 1)
        np.testing.assert_array_equal(b, want)


def test_synthetic_eval_batches_are_not_training_batches():
    """Mutant: the synthetic eval loader had the training loader's seed (eval on the batches
    just trained on)."""
    cfg = load_config(TINY, ["--data.source=synthetic", "--train.batch_size=4", "--train.seq_len=8"])
    data = make_dataset(cfg)
    train = [data.train.batch(i) for i in range(4)]
    for i in range(4):
        assert not any(np.array_equal(data.eval.batch(i), t) for t in train)
