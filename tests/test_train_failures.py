"""Training starts and runs that go wrong, as a user meets them: a start refused by the checkpoint
it would resume, a background save that fails (a full disk), a damaged token cache, non-finite
config numbers. Each compares with what the run directory held before, or with a fresh build.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from scaling import checkpoint as C
from scaling.__main__ import main
from scaling.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/models/tiny.yaml")
SMALL = [  # a one-layer model on synthetic tokens: compiles in seconds
    "--data.source=synthetic",
    "--model.num_layers=1",
    "--model.hidden_size=64",
    "--model.mlp_dim=128",
    "--model.vocab_size=512",
    "--model.compute_dtype=float32",
    "--train.batch_size=8",
    "--train.seq_len=16",
    "--train.eval_every=0",
    "--logging.progress=false",
    "--logging.tensorboard=false",
]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_a_start_refused_by_the_checkpoint_leaves_the_runs_config_and_tokenizer(tmp_path, capsys):
    """`generate` reads <run_dir>/config.yaml and tokenizer.json with the checkpoints: a start that
    the checkpoint refuses (another model shape) must not have replaced them first."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 30)
    run = tmp_path / "run"
    base = ["train", "--config", TINY, "--run_dir", str(run), *SMALL, "--data.source=text",
            f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'cache'}", "--data.eval_fraction=0.2",
            "--train.steps=2"]
    assert main(base + ["--data.tokenizer=byte"]) == 0
    config, tokenizer = (run / "config.yaml").read_text(), (run / "tokenizer.json").read_text()
    assert json.loads(tokenizer) == {"kind": "byte"}
    capsys.readouterr()

    assert main(base + ["--data.tokenizer=bpe", "--model.mlp_dim=256", "--train.steps=4"]) == 2
    err = capsys.readouterr().err
    assert "does not match the config" in err and "model.mlp_dim: config 256, checkpoint 128" in err
    assert (run / "config.yaml").read_text() == config
    assert (run / "tokenizer.json").read_text() == tokenizer
    assert C.complete_steps(run / "checkpoints") == [2]


class _DiskFull:
    """A write future that fails as TensorStore's did on a full disk (raised on waiting for it)."""

    def result(self, timeout=None):
        raise OSError(28, "No space left on device")


def _fail_saving(monkeypatch, step: int) -> None:
    """The state item's background write of `step` fails: Orbax then never commits that step."""
    async_save = ocp.StandardCheckpointHandler.async_save

    async def failing(self, directory, *args, **kwargs):
        futures = await async_save(self, directory, *args, **kwargs)
        return [*(futures or []), _DiskFull()] if any(f"/{step}{c}" in f"{directory}/" for c in "./") else futures

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)


def test_a_failed_background_save_is_named_by_the_checkpointer(tmp_path, monkeypatch):
    _fail_saving(monkeypatch, 2)
    cfg = load_config(None, ["--checkpoint.keep=5"]).checkpoint
    ck = C.Checkpointer(tmp_path, cfg)
    state = {"w": np.arange(8192, dtype=np.float32)}
    ck.save(1, state, {"loader": {}})
    ck.wait()
    ck.check()  # nothing pending: no error
    ck.save(2, state, {"loader": {}})
    with pytest.raises(C.CheckpointError) as e:
        ck.wait()
    msg = str(e.value)
    assert "step 2" in msg and "No space left on device" in msg and "newest complete checkpoint is step 1" in msg
    ck.check()  # reported once
    ck.close()
    assert C.complete_steps(tmp_path / "checkpoints") == [1]


def test_a_failed_background_save_stops_training_at_once_with_exit_1(tmp_path, monkeypatch, capsys):
    """Orbax raises a failed save only when the next one starts: checkpoint.every steps later, all
    of them unsaveable. The run stops within steps instead, names the save and its cause, exits 1
    without a traceback, and a restart resumes from the last complete checkpoint."""
    _fail_saving(monkeypatch, 20)
    run = tmp_path / "run"
    base = ["train", "--config", TINY, "--run_dir", str(run), *SMALL, "--train.log_every=1",
            "--checkpoint.every=10"]
    assert main(base + ["--train.steps=60"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: saving the checkpoint of step 20") and "No space left on device" in err, err
    assert "newest complete checkpoint is step 10" in err and "Traceback" not in err
    last = _records(run)[-1]["step"]
    assert 20 <= last < 30, last  # (Orbax alone: at the next save, step 30, and as a traceback)
    assert C.complete_steps(run / "checkpoints") == [10]

    monkeypatch.undo()
    assert main(base + ["--train.steps=12"]) == 0
    assert "resuming from checkpoint step 10" in capsys.readouterr().out
    assert [r["step"] for r in _records(run)] == list(range(1, 13))


def test_an_error_on_its_way_out_is_not_replaced_by_a_failed_save(tmp_path, monkeypatch, capsys):
    """A run that stops on an error (here the step-3 batch raising, as an out-of-memory would)
    while a background save fails: closing the checkpointer raised the save's CheckpointError,
    which replaced the error (the CLI then said only "saving ... failed" and exited 1). The
    error now leaves as it was, with the failed save as a note and a warning line."""
    from scaling import train as T

    _fail_saving(monkeypatch, 2)
    real, calls = T.global_batch, []

    def batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (stand-in)")
        return real(*args, **kwargs)

    monkeypatch.setattr(T, "global_batch", batch)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED") as e:
        main(["train", "--config", TINY, "--run_dir", str(tmp_path / "run"), *SMALL, "--train.steps=6",
              "--checkpoint.every=2"])
    notes = getattr(e.value, "__notes__", [])
    assert any("saving the checkpoint of step 2" in n and "No space left on device" in n for n in notes), notes
    assert "warning: saving the checkpoint of step 2" in capsys.readouterr().out


def test_a_non_finite_stop_still_says_so_when_the_save_before_it_failed(tmp_path, monkeypatch, capsys):
    """lr 1e30 makes step 2's loss NaN; step 1's background save fails. The non-finite check waits
    for that save, and its CheckpointError had replaced the NaN report (exit 1, not 3). Now exit 3
    with both. (Checkpointer.check, which may see the failure a step earlier, is stubbed so the
    failure reaches the non-finite check.)"""
    _fail_saving(monkeypatch, 1)
    monkeypatch.setattr(C.Checkpointer, "check", lambda self: None)
    argv = ["train", "--config", TINY, "--run_dir", str(tmp_path / "run"), *SMALL, "--train.steps=4",
            "--train.log_every=1", "--train.nonfinite=stop", "--optimizer.learning_rate=1e30",
            "--optimizer.warmup_steps=0", "--checkpoint.every=1"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: non-finite loss at step 2") and "no checkpoint was written" in err, err
    assert "also, saving the checkpoint of step 1" in err and "No space left on device" in err, err


@pytest.mark.parametrize("override", ["--optimizer.weight_decay=.inf", "--optimizer.clip_norm=.inf",
                                      "--data.max_corpus_mb=.inf", "--model.rope_low_freq_factor=.nan"])
def test_every_non_finite_number_is_refused_at_load(override):
    """README: non-finite numbers fail at load time, naming the key; these passed their range checks
    (or have none with RoPE scaling off), and weight_decay=.inf trained NaN params."""
    key = override[2:].split("=")[0]
    with pytest.raises(ConfigError, match=f"{key}: must be a finite number"):
        load_config(None, [override])


def _byte_corpus_cfg(tmp_path: Path):
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for i in range(5):
        (corpus / f"{i}.txt").write_text(f"document {i} " * 50)
    return load_config(None, ["--data.tokenizer=byte", "--model.vocab_size=257", f"--data.path={corpus}",
                              f"--data.cache_dir={tmp_path / 'cache'}"])


@pytest.mark.parametrize("damage", ["truncate", "remove", "meta"])
def test_a_damaged_token_cache_is_rebuilt_not_a_bare_mmap_error(tmp_path, damage):
    from scaling.data import build_token_store

    cfg = _byte_corpus_cfg(tmp_path)
    fresh = build_token_store(cfg, log=lambda m: None)
    want = np.array(fresh.tokens)
    if damage == "truncate":
        (fresh.directory / "tokens.bin").write_bytes((fresh.directory / "tokens.bin").read_bytes()[:100])
    elif damage == "remove":
        (fresh.directory / "tokens.bin").unlink()
    else:
        (fresh.directory / "meta.json").write_text('{"num_tokens": ')
    said = []
    again = build_token_store(cfg, log=said.append)
    assert "damaged" in said[0] and str(fresh.directory) in said[0]
    np.testing.assert_array_equal(np.array(again.tokens), want)
    said.clear()
    build_token_store(cfg, log=said.append)  # whole again: memory-mapped, nothing said
    assert said == []


def test_a_corpus_cap_below_the_first_file_names_the_cap():
    from scaling.data import DataError, build_token_store

    cfg = load_config(None, ["--data.max_corpus_mb=1e-6"])
    with pytest.raises(DataError, match=r"data\.max_corpus_mb=1e-06 holds none of the default corpus"):
        build_token_store(cfg, log=lambda m: None)


def test_a_second_training_process_on_the_same_run_dir_is_refused(tmp_path, capsys):
    """Started twice on one run directory, the second start removed the first one's save in
    progress (an uncommitted step directory reads as a partial save) and both wrote the same
    steps: it is refused before anything is touched, naming the process that holds it."""
    import os

    import scaling.train as T

    run = tmp_path / "run"
    in_progress = run / "checkpoints" / f"4{C.TMP_DIR_SUFFIX}"
    in_progress.mkdir(parents=True)
    args = ["train", "--config", TINY, "--run_dir", str(run), *SMALL, "--train.steps=2"]
    with T._run_dir_lock(run):  # (flock: a second open file in this process is refused like another process)
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "is in use by a training process" in err and f"pid {os.getpid()}" in err and "Traceback" not in err
        assert in_progress.is_dir() and not (run / "metrics.jsonl").exists()
    assert main(args) == 0  # released: the run goes ahead
    assert [r["step"] for r in _records(run)] == [2]


def test_resuming_with_clipping_turned_off_names_the_optimizer_change(tmp_path, capsys):
    """clip_norm=0 removes a stage of the optimizer chain, so its state no longer fits the
    checkpoint's. That was 50 lines of opt_state leaves "in the config's model"; the error now
    says the optimizer changed, how, and how to resume without clipping."""
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--run_dir", str(run), *SMALL]
    assert main(args + ["--train.steps=2"]) == 0
    capsys.readouterr()
    assert main(args + ["--train.steps=3", "--optimizer.clip_norm=0"]) == 2
    err = capsys.readouterr().err
    assert "the optimizer's state differs in structure" in err and err.count("\n") < 10, err
    assert "optimizer.clip_norm: config 0.0, checkpoint 1.0" in err and "(e.g. 1e9)" in err
    assert main(args + ["--train.steps=3", "--optimizer.clip_norm=1e9", "--train.log_every=1"]) == 0  # the way the error gives
    out = capsys.readouterr().out
    warning = out[out.index("warning: "):out.index("\nresuming with other")]
    assert "optimizer.clip_norm: checkpoint 1.0, now 1000000000.0" in warning and "train.steps: checkpoint 2, now 3" in warning
    # log_every only changes what is recorded: named on one line of its own, not in the warning.
    assert "log_every" not in warning and "as it was: train.log_every (observation or bookkeeping only)\n" in out, out


def test_a_start_with_checkpoints_off_says_it_ignores_the_run_s_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--config", TINY, "--run_dir", str(run), *SMALL, "--train.steps=2"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + ["--checkpoint.enabled=false"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint.enabled=false: not resuming from the checkpoints" in out and "(latest step 2)" in out


def test_gradient_accumulation_sums_in_float32_for_bfloat16_params():
    """The mean of the micro-batches' bf16 gradients must be their exact mean rounded once to
    bf16 (a float64 reference), as from an f32 sum; a bf16 carry rounded every partial sum."""
    import jax
    import jax.numpy as jnp

    from scaling.train import accumulate_grads

    accum, n = 64, 4096
    rng = np.random.default_rng(0)
    grads = (rng.standard_normal((accum, n)) * rng.uniform(0.1, 10, (accum, 1))).astype(jnp.bfloat16)
    params = {"w": jnp.zeros((n,), jnp.bfloat16)}

    def grad_fn(p, mb):  # the micro-batch is its own gradient
        return jnp.sum(mb.astype(jnp.float32)), {"w": mb[0]}

    loss, out = jax.jit(lambda p, b: accumulate_grads(grad_fn, p, b, accum))(params, jnp.asarray(grads))
    ref = grads.astype(np.float64).mean(axis=0)
    assert out["w"].dtype == jnp.bfloat16
    exact = np.asarray(out["w"], np.float64) == ref.astype(jnp.bfloat16).astype(np.float64)
    assert exact.mean() > 0.999, exact.mean()
    assert float(loss) == pytest.approx(grads.astype(np.float64).sum() / accum, rel=1e-6)


def test_a_start_refused_before_writing_anything_leaves_no_run_directory(tmp_path, capsys):
    """Missing data: exit 2, and the run directory this start created (which held only .lock) is
    gone. A directory that existed before is kept, even empty."""
    run = tmp_path / "new" / "run"
    argv = ["train", "--config", TINY, "--run_dir", str(run), *SMALL[1:], "--data.source=tokens",
            f"--data.path={tmp_path / 'missing.npy'}"]
    assert main(argv) == 2
    assert "missing.npy" in capsys.readouterr().err and not run.exists()
    run.mkdir(parents=True)
    assert main(argv) == 2
    assert run.is_dir()


def test_remat_names_under_a_policy_that_ignores_them_is_said(tmp_path, capsys):
    """remat.names is read by `names` and `offload` only: under `full` the run says it ignores
    them (a YAML file may keep the list while the command line switches the policy)."""
    argv = ["train", "--config", TINY, "--run_dir", str(tmp_path / "run"), *SMALL, "--train.steps=1",
            "--remat.policy=full", "--remat.names=[query_proj]"]
    assert main(argv) == 0
    assert "remat.names ['query_proj'] is read only by the names and offload policies; remat.policy=full ignores it" \
        in capsys.readouterr().out
    assert main(argv[:-2] + ["--run_dir", str(tmp_path / "run2"), "--remat.policy=names", "--remat.names=[query_proj]"]) == 0
    assert "remat.names" not in capsys.readouterr().out


@pytest.mark.parametrize("given", ["", "  "])
def test_an_empty_run_dir_flag_is_refused_not_a_fresh_run(tmp_path, monkeypatch, capsys, given):
    """`--run_dir=$DIR` with DIR unset had trained a fresh run under runs/<name>-<timestamp>
    (the empty string read as "not given") instead of resuming the one meant; a config file's
    empty run_dir was already refused."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", TINY, f"--run_dir={given}", *SMALL, "--train.steps=1"]) == 2
    assert "--run_dir: must not be empty" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
