import json

import jax
import numpy as np
import pytest

from scaling.__main__ import main
from scaling.config import load_config
from scaling.data import make_dataset, unigram_entropy
from scaling.train import global_batch, init_state, make_setup, make_train_step, train


def test_loss_falls_below_unigram_entropy_on_default_corpus(tmp_path, corpus_cache):
    overrides = [
        f"--data.cache_dir={corpus_cache}",
        "--data.max_corpus_mb=1",
        "--train.steps=60",
        "--train.batch_size=8",
        "--train.seq_len=64",
        "--train.log_every=10",
        "--train.eval_every=60",
        "--train.eval_batches=2",
        "--optimizer.warmup_steps=10",
        "--checkpoint.enabled=false",
        "--logging.progress=false",
    ]
    cfg = load_config("configs/tiny_corpus.yaml", overrides)  # 8-way FSDP over the simulated devices
    data = make_dataset(cfg, log=lambda m: None)
    h_unigram = unigram_entropy(data.train.tokens, cfg.model.vocab_size)
    summary = train(cfg, str(tmp_path / "run"), log=lambda m: None)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train_recs = [r for r in records if "loss" in r]
    assert {"step", "loss", "lr", "tokens_per_sec", "grad_norm", "mfu"} <= set(train_recs[0])
    assert train_recs[0]["loss"] > h_unigram > summary["eval_loss"], (train_recs[0]["loss"], h_unigram, summary["eval_loss"])
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "tokenizer.json").exists()
    assert list((tmp_path / "run" / "tensorboard").iterdir())


def test_grad_accumulation_matches_full_batch():
    base = ["--data.source=synthetic", "--model.compute_dtype=float32", "--train.batch_size=8", "--train.seq_len=16"]
    cfg1 = load_config("configs/models/tiny.yaml", base)
    cfg2 = load_config("configs/models/tiny.yaml", base + ["--train.grad_accum=4"])
    batch = make_dataset(cfg1).train.batch(0)
    out = []
    for cfg in (cfg1, cfg2):
        setup = make_setup(cfg, devices=jax.devices()[:1])
        state = init_state(setup)
        state, m = make_train_step(setup)(state, global_batch(setup, batch))
        out.append((float(m["loss"]), float(m["grad_norm"]), jax.device_get(state["params"])))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-5)
    assert out[0][1] == pytest.approx(out[1][1], rel=1e-4)
    for a, b in zip(jax.tree.leaves(out[0][2]), jax.tree.leaves(out[1][2])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_cli_train_runs_and_reports_config_errors(tmp_path, capsys):
    rc = main(
        [
            "train",
            "--config",
            "configs/models/tiny.yaml",
            "--run_dir",
            str(tmp_path / "cli"),
            "--data.source=synthetic",
            "--train.steps=3",
            "--train.log_every=1",
            "--train.eval_every=0",
            "--checkpoint.enabled=false",
            "--logging.progress=false",
        ]
    )
    assert rc == 0
    lines = [json.loads(line) for line in open(tmp_path / "cli" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert main(["train", "--config", "configs/models/tiny.yaml", "--model.num_kv_heads=3"]) == 2
    assert "model.num_heads" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, off", [
    ([], True),  # the defaults: scanned layers, remat none
    (["--remat.policy=full"], False),
    (["--remat.policy=dots"], False),
    (["--model.scan_layers=false"], False),
])
def test_train_step_turns_dynamic_slice_fusion_off_only_for_scanned_none(overrides, off, monkeypatch):
    """XLA:GPU's dynamic-slice fusion duplicates the flash forward when the scan stacks its
    outputs (remat none): the step is compiled without it there, and with XLA's defaults
    elsewhere (docs/benchmarks.md, "Forty-eighth session")."""
    from scaling import train as T

    cfg = load_config("configs/models/tiny.yaml", ["--train.batch_size=2", "--train.seq_len=16", *overrides])
    want = {"xla_gpu_enable_dynamic_slice_fusion": False} if off else {}
    assert T.train_step_compiler_options(cfg) == want
    seen = {}
    real_jit = T.jax.jit

    def spy(fn, **kw):
        seen.update(kw)
        return real_jit(fn, **kw)

    monkeypatch.setattr(T.jax, "jit", spy)
    setup = make_setup(cfg, devices=jax.devices()[:1])
    make_train_step(setup)
    assert seen["compiler_options"] == want


def test_every_config_field_has_a_resume_kind():
    """A resume sorts changed fields by RESUME_FIELD_KINDS; a field left out would silently
    count as a trajectory change, so a new field must be classified there on purpose."""
    from scaling import train as T
    from scaling.config import Config, to_dict

    fields = set(T._flatten(to_dict(Config())))
    assert not fields - set(T.RESUME_FIELD_KINDS), "classify these in scaling.train.RESUME_FIELD_KINDS"
    assert not set(T.RESUME_FIELD_KINDS) - fields, "entries for fields that no longer exist"
    assert set(T.RESUME_FIELD_KINDS.values()) == {T.TRAJECTORY, T.LAYOUT, T.BOOKKEEPING, T.LAUNCH}


def test_resume_message_warns_about_the_trajectory_and_names_the_rest_in_one_line():
    from scaling import train as T
    from scaling.config import Config, replace, to_dict

    saved = to_dict(Config())
    now = to_dict(replace(Config(), optimizer={"learning_rate": 1e-3}, mesh={"fsdp": 2}, train={"grad_accum": 2},
                          logging={"progress": False}, run_dir="/moved"))
    assert T.resume_config_messages(saved, now) == [
        "warning: resuming with settings that change the training trajectory from the checkpoint's "
        "(the run continues with the new values):\n  optimizer.learning_rate: checkpoint 0.003, now 0.001",
        "resuming with other changed settings that leave the trajectory as it was: "
        "mesh.fsdp, train.grad_accum (same math up to summation order); logging.progress (observation or "
        "bookkeeping only)",
    ]  # run_dir (a launch detail) is not named at all
    harmless = to_dict(replace(Config(), train={"log_every": 1}, checkpoint={"keep": 9}))
    assert T.resume_config_messages(saved, harmless) == [
        "resuming with other changed settings that leave the trajectory as it was: "
        "checkpoint.keep, train.log_every (observation or bookkeeping only)"]
    assert T.resume_config_messages(saved, saved) == [] and T.resume_config_messages(None, now) == []
    # A field the table does not know (one an older checkpoint still has) counts as a change.
    old = {**saved, "train": {**saved["train"], "retired_knob": 1}}
    assert T.resume_config_messages(old, saved)[0].endswith("train.retired_knob: checkpoint 1, now '(absent)'")
