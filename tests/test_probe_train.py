"""The training loop as a user drives it: bad input, timing and MFU, eval, resume, skipped steps,
recompiles, the host's lead over the device, profiling and TensorBoard.

Each test compares with an independent reference: a fake clock, the FLOPs formula by hand,
numpy's cross-entropy, a run never interrupted, the learning-rate formula, the jit cache's own
count, XLA's memory analysis, TensorBoard's purge rule applied to the raw event files.
"""

import json
import os
import shutil
import subprocess
import sys
import time as _time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scaling.train as T
from scaling.__main__ import main
from scaling.config import load_config
from scaling.data import make_dataset

ROOT = Path(__file__).resolve().parents[1]
TINY = "configs/models/tiny.yaml"
SMALL = [  # a one-layer model on synthetic tokens: compiles in seconds
    "--data.source=synthetic",
    "--model.num_layers=1",
    "--model.hidden_size=64",
    "--model.mlp_dim=128",
    "--model.vocab_size=256",
    "--model.compute_dtype=float32",
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--logging.progress=false",
    "--logging.tensorboard=false",
]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_bad_input_exits_2_naming_the_field_before_any_compile(tmp_path, capsys):
    base = ["train", "--config", TINY, "--run_dir", str(tmp_path / "r"), *SMALL, "--train.batch_size=8"]
    assert main(base + ["--remat.policy=names", "--remat.names=[bogus]"]) == 2
    err = capsys.readouterr().err
    assert "remat.names" in err and "bogus" in err and "query_proj" in err and "Traceback" not in err
    assert main(base + ["--attention.impl=cudnn"]) == 2  # the tests run on the CPU
    err = capsys.readouterr().err
    assert "attention.impl" in err and "cudnn" in err and "xla" in err and "Traceback" not in err
    # A run directory that is a file.
    (tmp_path / "file").write_text("")
    assert main(["train", "--config", TINY, "--run_dir", str(tmp_path / "file"), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "run_dir" in err and "is a file" in err and "Traceback" not in err
    # A global batch the 8 simulated devices of the default FSDP mesh cannot split.
    assert main(base + ["--train.batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert "train.batch_size=4" in err and "8 devices" in err and "fsdp=8" in err and "Traceback" not in err
    # A batch the devices split, but whose micro-batches they do not (8 / 2 = 4 rows over 8 devices).
    assert main(base + ["--train.grad_accum=2"]) == 2
    err = capsys.readouterr().err
    assert "= 4 rows a micro-batch, not divisible by the 8 devices" in err and "Traceback" not in err


class _Clock:
    """A fake perf_counter that moves only when the wrapped train / eval steps run."""

    def __init__(self):
        self.t = 1000.0

    def perf_counter(self):
        return self.t


def test_eval_on_synthetic_data_and_eval_time_kept_out_of_tokens_per_sec(tmp_path, monkeypatch):
    # eval_every=2 falls inside each log window of 4 steps. Every train step takes 1 s on the
    # fake clock and every eval batch 100 s: each window's step_time must be exactly 1 s.
    cfg = load_config(TINY, SMALL + ["--train.steps=8", "--train.log_every=4", "--train.eval_every=2",
                                     "--train.eval_batches=2", "--checkpoint.enabled=false"])
    clock = _Clock()
    monkeypatch.setattr(T, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, strftime=_time.strftime))
    make_train, make_eval = T.make_train_step, T.make_eval_step

    def timed(make, seconds):
        def wrapped_make(setup):
            fn = make(setup)

            def run(*args):
                out = fn(*args)
                clock.t += seconds
                return out

            return run

        return wrapped_make

    monkeypatch.setattr(T, "make_train_step", timed(make_train, 1.0))
    monkeypatch.setattr(T, "make_eval_step", timed(make_eval, 100.0))
    summary = T.train(cfg, str(tmp_path / "run"), log=lambda m: None, devices=jax.devices()[:1])

    recs = _records(tmp_path / "run")
    train_recs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train_recs] == [4, 8]
    for r in train_recs:
        assert r["step_time"] == 1.0, r
        assert r["tokens_per_sec"] == cfg.train.batch_size * cfg.train.seq_len / 1.0, r

    # The eval loss against numpy's cross-entropy of the final params on the same eval batches.
    assert [r["step"] for r in recs if "eval_loss" in r] == [2, 4, 6, 8]
    data = make_dataset(cfg, log=lambda m: None)
    model = summary["setup"].model(jax.device_get(summary["state"]["params"]))
    nll = []
    for i in range(cfg.train.eval_batches):
        tokens = data.eval.batch(i)
        logits = np.asarray(model(jnp.asarray(tokens[:, :-1])), np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        picked = np.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
        nll.append(np.mean(logz - picked))
    assert summary["eval_loss"] == pytest.approx(float(np.mean(nll)), rel=1e-5)


def test_the_compiling_first_step_is_timed_apart(tmp_path, monkeypatch):
    """The first step of a start compiles: on the fake clock it takes 50 s and the others 1 s. The
    first record's rates are over steps 2-4 only (they were (50 + 3) / 4 s a step), the 50 s are
    its first_step_s; with log_every=1 the first record has no rate at all."""
    clock = _Clock()
    monkeypatch.setattr(T, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, strftime=_time.strftime))
    make_train = T.make_train_step

    def wrapped_make(setup):
        fn, calls = make_train(setup), []

        def run(*args):
            out = fn(*args)
            clock.t += 50.0 if not calls else 1.0
            calls.append(1)
            return out

        return run

    monkeypatch.setattr(T, "make_train_step", wrapped_make)
    tokens = 4 * 16  # SMALL's batch x sequence
    for log_every, want in ((4, [(4, 1.0, 50.0), (8, 1.0, None)]), (1, [(1, None, 50.0), (2, 1.0, None)])):
        cfg = load_config(TINY, SMALL + ["--train.steps=8", f"--train.log_every={log_every}", "--train.eval_every=0",
                                         "--checkpoint.enabled=false"])
        run_dir = tmp_path / f"log{log_every}"
        T.train(cfg, str(run_dir), log=lambda m: None, devices=jax.devices()[:1])
        recs = _records(run_dir)
        for (step, step_time, first), r in zip(want, recs):
            assert r["step"] == step and r["step_time"] == step_time and r.get("first_step_s") == first, r
            assert r["tokens_per_sec"] == (tokens / step_time if step_time else None), r


def test_resume_inside_a_log_window_logs_the_uninterrupted_records(tmp_path):
    # log_every=4 and checkpoints every 3 steps: a run resumed from step 3 must log the mean
    # loss of steps 1-4 at step 4, as the run that was never stopped does.
    args = SMALL + ["--train.steps=8", "--train.log_every=4", "--train.eval_every=0", "--checkpoint.every=3",
                    "--checkpoint.async_save=false"]
    cfg = load_config(TINY, args)
    ref = tmp_path / "ref"
    T.train(cfg, str(ref), log=lambda m: None, devices=jax.devices()[:1])
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    for step in (6, 8):  # as if stopped right after the save at step 3
        shutil.rmtree(run / "checkpoints" / str(step))
    lines: list[str] = []
    summary = T.train(cfg, str(run), log=lines.append, devices=jax.devices()[:1])
    assert summary["start_step"] == 3
    assert not any("differs" in line for line in lines)
    keys = ("step", "loss", "grad_norm", "lr", "nonfinite_steps")
    want = [tuple(r[k] for k in keys) for r in _records(ref)]
    assert [tuple(r[k] for k in keys) for r in _records(run)] == want

    # Resuming with changed settings says which, with both values.
    lines.clear()
    changed = load_config(TINY, args + ["--optimizer.learning_rate=0.001", "--train.seed=7"])
    T.train(changed, str(run), log=lines.append, devices=jax.devices()[:1])
    text = "\n".join(lines)
    assert "optimizer.learning_rate: checkpoint 0.003, now 0.001" in text, text
    assert "train.seed: checkpoint 0, now 7" in text, text


def test_skipped_steps_log_the_learning_rate_the_optimizer_applies(tmp_path):
    # Batch 1 holds a token outside the vocabulary: its embedding is NaN (jnp.take fills
    # out-of-range rows with NaN), so that step is skipped and the optimizer's schedule count
    # stays behind the step. The logged lr must be the one the optimizer uses.
    cfg = load_config(TINY, SMALL + ["--train.steps=20", "--train.nonfinite=skip", "--optimizer.warmup_steps=8",
                                     "--optimizer.clip_norm=0"])
    setup = T.make_setup(cfg, devices=jax.devices()[:1])
    state = T.init_state(setup)
    step = T.make_train_step(setup)
    data = make_dataset(cfg)
    lrs, counts = [], []
    for i in range(4):
        tokens = data.train.batch(i)
        if i == 1:
            tokens[0, 3] = cfg.model.vocab_size
        state, m = step(state, T.global_batch(setup, tokens))
        lrs.append(float(m["lr"]))
    assert int(state["nonfinite"]["count"]) == 1
    # Every count in the optimizer state (Adam's and the schedule's) is the number of applied updates.
    counts = {int(x) for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"]) if "count" in jax.tree_util.keystr(p)}
    assert counts == {3}
    applied_before = [0, 1, 1, 2]  # updates applied before each of the 4 steps
    peak, warmup = cfg.optimizer.learning_rate, cfg.optimizer.warmup_steps
    want = [np.float32(peak * k / warmup) for k in applied_before]  # linear warmup, float64 then f32
    np.testing.assert_allclose(lrs, want, rtol=1e-6)


CHILD = r"""
import jax, numpy as np
from scaling.config import load_config
from scaling.train import global_batch, init_state, make_eval_step, make_setup
cfg = load_config("configs/models/tiny.yaml", ["--attention.impl=pallas", "--data.source=synthetic",
    "--model.num_layers=1", "--model.hidden_size=64", "--model.num_heads=2", "--model.num_kv_heads=1",
    "--model.vocab_size=256", "--train.batch_size=1", "--train.seq_len=16"])
setup = make_setup(cfg, devices=jax.devices()[:1])
params = init_state(setup)["params"]
step = make_eval_step(setup)
batch = global_batch(setup, np.arange(17, dtype=np.int32)[None] % 256)
a, b = float(step(params, batch)), float(step(params, batch))
assert a == b, (a, b)
print("cache entries", step._cache_size())
"""


def test_pallas_model_compiles_once_per_shape(tmp_path):
    # In a fresh process: lowering the first pallas_call on the CPU imports Pallas' interpreter,
    # which defines a jax config option of the trace context, so without the import up front
    # the second call of the same jitted function missed the cache and compiled again.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cache entries 1" in out.stdout, out.stdout + out.stderr[-2000:]


def test_eval_runs_in_the_train_steps_micro_batches():
    # With grad_accum=4 an eval batch must not need the whole batch's [B, T, V] f32 logits at
    # once (the memory grad_accum was chosen to avoid), and its loss is the whole batch's.
    b, t, v = 32, 64, 1024
    base = ["--data.source=synthetic", "--model.num_layers=1", "--model.compute_dtype=float32",
            f"--train.batch_size={b}", f"--train.seq_len={t}", f"--model.vocab_size={v}"]
    tokens = np.random.default_rng(0).integers(0, v, (b, t + 1), dtype=np.int32)
    out = {}
    for accum in (1, 4):
        setup = T.make_setup(load_config(TINY, base + [f"--train.grad_accum={accum}"]), devices=jax.devices()[:1])
        params = T.init_state(setup)["params"]
        ev = T.make_eval_step(setup)
        batch = T.global_batch(setup, tokens)
        temp = ev.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
        out[accum] = (float(ev(params, batch)), temp)
    assert out[4][0] == pytest.approx(out[1][0], rel=1e-5)
    logits_bytes = b * t * v * 4
    assert out[1][1] >= logits_bytes  # the one-pass eval holds them (the reference point)
    assert out[4][1] < logits_bytes / 2, out


def test_host_waits_for_the_previous_step_so_a_signal_is_seen_within_a_step(tmp_path, monkeypatch):
    # Each step's metrics pass through a host callback that takes 0.25 s, after the step is
    # dispatched. When the loop dispatches step n, step n-2 must be finished: the host runs at
    # most one step ahead, so a SIGTERM handler (which runs only between Python bytecodes, not
    # inside a wait on the device) is seen within a step rather than at the next log step.
    cfg = load_config(TINY, SMALL + ["--train.steps=6", "--train.log_every=6", "--train.eval_every=0",
                                     "--checkpoint.enabled=false"])
    make_train = T.make_train_step
    seen: list[int] = []  # at each dispatch: earlier steps' metrics not yet computed

    def slow_identity(x):
        _time.sleep(0.25)
        return x

    def make(setup):
        fn = make_train(setup)
        slow = jax.jit(lambda m: jax.pure_callback(slow_identity, jax.ShapeDtypeStruct((), jnp.float32), m))
        outs = []

        def run(state, batch):
            seen.append(sum(not m["loss"].is_ready() for m in outs))
            state, m = fn(state, batch)
            m = dict(m, loss=slow(m["loss"]))
            outs.append(m)
            return state, m

        return run

    monkeypatch.setattr(T, "make_train_step", make)
    T.train(cfg, str(tmp_path / "run"), log=lambda m: None, devices=jax.devices()[:1])
    assert len(seen) == 6 and max(seen) <= 1, seen


def test_a_profile_window_past_the_last_step_is_stopped_and_summarized(tmp_path):
    cfg = load_config(TINY, SMALL + ["--train.steps=3", "--train.eval_every=0", "--checkpoint.enabled=false",
                                     "--profile.steps=[1,10]"])
    lines: list[str] = []
    T.train(cfg, str(tmp_path / "run"), log=lines.append, devices=jax.devices()[:1])
    assert any(line.startswith("profile: trace of steps (1, 3) written") for line in lines), lines
    assert any(line.startswith("profile: per step") for line in lines), lines
    assert (tmp_path / "run" / "profile" / "summary.md").exists()


def test_a_profile_window_the_run_never_reaches_is_reported_not_skipped_silently(tmp_path):
    base = SMALL + ["--train.eval_every=0", "--checkpoint.every=2", "--checkpoint.async_save=false"]
    run = tmp_path / "run"
    T.train(load_config(TINY, base + ["--train.steps=2"]), str(run), log=lambda m: None, devices=jax.devices()[:1])
    # Resumed at step 2, past the window's first step 1: no trace, and the log says why.
    lines: list[str] = []
    T.train(load_config(TINY, base + ["--train.steps=4", "--profile.steps=[1,3]"]), str(run),
            log=lines.append, devices=jax.devices()[:1])
    assert any(line.startswith("profile: no trace: profile.steps=[1, 3) starts before step 2") for line in lines), lines
    assert not (run / "profile").exists()
    # A window that starts at or after train.steps.
    lines.clear()
    T.train(load_config(TINY, SMALL + ["--train.steps=2", "--train.eval_every=0", "--checkpoint.enabled=false",
                                       "--profile.steps=[5,8]"]),
            str(tmp_path / "short"), log=lines.append, devices=jax.devices()[:1])
    assert any("profile: no trace: profile.steps=[5, 8) starts at or after the last step (train.steps=2)" in line
               for line in lines), lines
    assert not (tmp_path / "short" / "profile").exists()


def test_mfu_is_model_flops_over_the_peak_of_the_devices_the_run_uses(tmp_path, monkeypatch):
    # A pretend accelerator of 1e12 FLOP/s; the run uses 1 of the 8 simulated devices.
    import dataclasses

    from scaling import hardware

    hw = dataclasses.replace(hardware.HARDWARE["h100"], bf16_flops=1e12)
    monkeypatch.setattr(hardware, "detect", lambda device=None: hw)
    cfg = load_config(TINY, SMALL + ["--train.steps=2", "--train.log_every=1", "--train.eval_every=0",
                                     "--checkpoint.enabled=false"])
    T.train(cfg, str(tmp_path / "run"), log=lambda m: None, devices=jax.devices()[:1])
    m, t = cfg.model, cfg.train.seq_len
    d, n, k, f, v, layers = m.hidden_size, m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size, m.num_layers
    h = d // n
    dense = 6 * (layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) + d * v)  # fwd + bwd, 2 per weight
    attn = 3 * 2 * t * n * h * layers  # q.k and p.v, causal half, fwd + bwd
    rated = [r for r in _records(tmp_path / "run") if r["tokens_per_sec"] is not None]  # (not the compiling step)
    assert [r["step"] for r in rated] == [2]
    for r in rated:
        assert r["mfu"] == pytest.approx((dense + attn) * r["tokens_per_sec"] / 1e12, rel=1e-9), r


def _tensorboard_scalars(tb_dir: Path) -> dict[int, dict[str, float]]:
    """What TensorBoard shows: the event files in order, and at a SessionLog START of step s
    (a writer's purge_step) the events read so far at steps >= s dropped (its purge rule)."""
    import struct

    from tensorboardX.proto import event_pb2

    seen: list[tuple[int, str, float]] = []
    for path in sorted(tb_dir.iterdir()):
        data, i = path.read_bytes(), 0
        while i < len(data):
            n = struct.unpack("<Q", data[i : i + 8])[0]
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
                seen = [e for e in seen if e[0] < ev.step]
            for v in ev.summary.value:
                seen.append((ev.step, v.tag, v.simple_value))
    out: dict[int, dict[str, float]] = {}
    for step, tag, value in seen:
        out.setdefault(step, {})[tag] = value
    return out


def test_tensorboard_shows_what_metrics_jsonl_holds_after_a_restart_from_scratch(tmp_path):
    # A run stopped before its first checkpoint starts again from step 0: metrics.jsonl drops
    # the earlier start's records, and TensorBoard must hide its events too.
    args = SMALL + ["--logging.tensorboard=true", "--train.log_every=1", "--train.eval_every=0", "--checkpoint.enabled=false"]
    run = tmp_path / "run"
    T.train(load_config(TINY, args + ["--train.steps=4"]), str(run), log=lambda m: None, devices=jax.devices()[:1])
    T.train(load_config(TINY, args + ["--train.steps=2", "--train.seed=5"]), str(run), log=lambda m: None,
            devices=jax.devices()[:1])
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2]
    shown = _tensorboard_scalars(run / "tensorboard")
    assert sorted(shown) == [1, 2]
    for r in recs:
        assert shown[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-6)


def test_a_restart_in_the_same_second_keeps_the_earlier_starts_tensorboard_events(tmp_path, monkeypatch):
    # tensorboardX names event files by the second and opens them with "wb": a resume within
    # the same second used to truncate the first start's file, and TensorBoard lost steps 1-2.
    from tensorboardX import event_file_writer

    monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: 1_800_000_000.0))
    args = SMALL + ["--logging.tensorboard=true", "--train.log_every=1", "--train.eval_every=0",
                    "--checkpoint.every=2", "--checkpoint.async_save=false"]
    run = tmp_path / "run"
    T.train(load_config(TINY, args + ["--train.steps=2"]), str(run), log=lambda m: None, devices=jax.devices()[:1])
    T.train(load_config(TINY, args + ["--train.steps=4"]), str(run), log=lambda m: None, devices=jax.devices()[:1])
    recs = _records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    shown = _tensorboard_scalars(run / "tensorboard")
    assert sorted(shown) == [1, 2, 3, 4]
    for r in recs:
        assert shown[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-6)


def test_metrics_jsonl_is_strict_json_with_a_non_finite_loss(tmp_path):
    """A skipped step's NaN loss was written as a bare NaN, which strict JSON readers (jq,
    JavaScript, json.loads with parse_constant) refuse: it is null now."""

    def strict(text):
        def refuse(name):
            raise ValueError(f"not JSON: {name}")

        return json.loads(text, parse_constant=refuse)

    logger = T.MetricsLogger(tmp_path, tensorboard=False, enabled=True, start_step=0, log=lambda m: None)
    logger.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.5, "nonfinite_steps": 1})
    logger.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert strict(line) == {"step": 1, "loss": None, "grad_norm": None, "lr": 0.5, "nonfinite_steps": 1}


@pytest.mark.parametrize("mesh, host, ok", [({"fsdp": 8}, "block", True), ({"data": 2, "fsdp": 4}, "block", True),
                                            ({"fsdp": 8}, "interleaved", True),
                                            ({"fsdp": 4, "tensor": 2}, "block", True),
                                            ({"fsdp": 4, "tensor": 2}, "interleaved", False)])
def test_the_batch_must_be_split_across_processes(mesh, host, ok):
    """The 8 simulated devices as 2 pretend hosts of 4, ids 0-3 and 4-7 ("block"), or even and
    odd ids ("interleaved"): each host must hold its own half of the batch. With the tensor axis
    (innermost: neighbouring ids) across the interleaved hosts, both hold the whole batch, and
    each process would feed different rows into one 'replicated' array."""
    cfg = load_config(TINY, SMALL + ["--train.batch_size=8", *(f"--mesh.{k}={v}" for k, v in
                                                              {"data": 1, "fsdp": 1, "tensor": 1, **mesh}.items())])
    setup = T.make_setup(cfg)
    of = {d: (d.id // 4 if host == "block" else d.id % 2) for d in jax.devices()}
    shape = (8, cfg.train.seq_len + 1)
    if ok:
        assert T.process_rows(setup.batch_sharding, shape, process_of=of.__getitem__) == {0: 4, 1: 4}
    else:
        with pytest.raises(T.ShardingError, match=r"not split across the 2 processes \(rows each holds: \{0: 8, 1: 8\}"):
            T.process_rows(setup.batch_sharding, shape, process_of=of.__getitem__)
    assert T.process_rows(setup.batch_sharding, shape, process_of=lambda d: 0) == {0: 8}  # one process: any mesh
