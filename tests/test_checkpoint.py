"""Checkpoints: exact resume, resharding, preemption, kills mid-save, non-finite steps, export.

The subprocess test really sends SIGTERM / SIGKILL to `python -m scaling train` children
(single CPU device each) and compares their metrics.jsonl with an uninterrupted run, bit
for bit. The rest runs in-process on the 8 simulated devices from conftest.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from scaling import checkpoint as C
from scaling.config import load_config, replace, to_dict
from scaling.train import NonFiniteError, abstract_state, make_setup, train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/models/tiny.yaml")


def _leaves_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ in-process tests


def test_partial_markers_are_orbax_s():
    from orbax.checkpoint._src.path import atomicity_types

    assert C.TMP_DIR_SUFFIX == atomicity_types.TMP_DIR_SUFFIX
    assert C.COMMIT_SUCCESS_FILE == atomicity_types.COMMIT_SUCCESS_FILE


@pytest.fixture(scope="module")
def saved_fsdp8(tmp_path_factory, devices):
    """A checkpoint of the tiny model's full train state, written from an fsdp=8 mesh.

    Random values (not init_state, whose compile is slow here): every element distinct,
    so a resharding that moved shards around could not go unnoticed."""
    cfg = load_config(TINY, ["--model.num_kv_heads=4", "--mesh.fsdp=8", "--data.source=synthetic"])
    setup = make_setup(cfg, devices=devices)
    rng = np.random.default_rng(0)
    state = jax.tree.map(
        lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding), abstract_state(setup)
    )
    assert any("fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(state["params"]))
    run_dir = tmp_path_factory.mktemp("fsdp8")
    ck = C.Checkpointer(run_dir, cfg.checkpoint)
    ck.save(1, state, {"loader": {"next_index": 1}, "config": to_dict(cfg)})
    ck.close()
    return cfg, run_dir, jax.device_get(state)


@pytest.mark.parametrize("mesh", [{"data": 2, "fsdp": 1, "tensor": 4}, "single"])
def test_restore_reshards_with_identical_values(saved_fsdp8, devices, mesh):
    cfg, run_dir, saved = saved_fsdp8
    if mesh == "single":
        setup = make_setup(replace(cfg, mesh={"fsdp": 1}), devices=devices[:1])
    else:
        setup = make_setup(replace(cfg, mesh=mesh), devices=devices)
    target = abstract_state(setup)
    ck = C.Checkpointer(run_dir, cfg.checkpoint)
    restored = ck.restore(target)
    ck.close()
    assert restored.step == 1 and restored.meta["loader"] == {"next_index": 1}
    _leaves_equal(saved, restored.state)
    for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(target)):
        assert got.sharding == want.sharding  # laid out for the new mesh, not the saved one
    if mesh != "single":
        assert restored.state["params"]["blocks"]["attn"]["q_dnh"].sharding.spec[2] == "tensor"


def test_mismatched_config_names_parameter_and_shapes(saved_fsdp8, devices):
    cfg, run_dir, _ = saved_fsdp8
    other = replace(cfg, model={"mlp_dim": 256})
    ck = C.Checkpointer(run_dir, other.checkpoint)
    with pytest.raises(C.CheckpointMismatchError) as e:
        ck.restore(abstract_state(make_setup(other, devices=devices)), config=to_dict(other))
    ck.close()
    msg = str(e.value)
    assert "params.blocks.mlp.up_df: config shape (4, 128, 256), checkpoint shape (4, 128, 384)" in msg
    assert "model.mlp_dim: config 256, checkpoint 384" in msg
    assert "opt_state" not in msg  # the optimizer's moments only repeat the params' mismatch


def test_export_and_load_params_without_optimizer(saved_fsdp8, tmp_path, capsys):
    from scaling.__main__ import main

    cfg, run_dir, saved = saved_fsdp8
    out = tmp_path / "export"
    assert main(["export", "--run_dir", str(run_dir), "--out", str(out)]) == 0
    assert "exported params of step 1" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "export.json", "params"]
    params = C.load_params(out, cfg.model)
    assert isinstance(params, dict) and set(params) == set(saved["params"])
    _leaves_equal(saved["params"], params)
    _leaves_equal(saved["params"], C.load_params(run_dir))  # straight from a run, optimizer skipped
    _leaves_equal(saved["params"], C.load_params(run_dir, step=1))
    with pytest.raises(C.CheckpointError, match=r"step 5: no complete checkpoint of that step .* have \[1\]"):
        C.load_params(run_dir, step=5)
    with pytest.raises(C.CheckpointError, match="is an export"):
        C.load_params(out, step=1)
    with pytest.raises(C.CheckpointMismatchError, match=r"embed.table_vd: config shape \(512, 128\), checkpoint shape \(1024, 128\)"):
        C.load_params(out, replace(cfg, model={"vocab_size": 512}).model)



def test_export_as_a_hugging_face_directory(saved_fsdp8, tmp_path, capsys):
    """export --format hf: the checkpoint's params, read back by our HF loader (checked against
    transformers' logits in test_hf_interop.py), equal the saved ones; the run's tokenizer comes
    along, so `generate` takes the directory; --dtype writes bf16 weights."""
    import shutil

    from scaling.__main__ import main
    from scaling.generate_cli import load_any
    from scaling.interop import hf

    cfg, run_dir, saved = saved_fsdp8
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "tokenizer.json").write_text('{"kind": "byte"}')
    out = tmp_path / "hf"
    assert main(["export", "--run_dir", str(run), "--out", str(out), "--format", "hf"]) == 0
    assert "exported a Hugging Face directory of step 1" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    cfg2, model = hf.load(out)
    assert cfg2.vocab_size == cfg.model.vocab_size and cfg2.num_layers == cfg.model.num_layers
    _leaves_equal(saved["params"], jax.device_get(hf.nnx.to_pure_dict(hf.nnx.state(model, hf.nnx.Param))))
    _, tok, stops = load_any(out)
    assert stops == [256] and tok.encode("hé") == list("hé".encode())
    out16 = tmp_path / "hf16"
    assert main(["export", "--run_dir", str(run), "--out", str(out16), "--format", "hf", "--dtype", "bfloat16"]) == 0
    tensors = hf.read_safetensors(out16 / "model.safetensors")
    emb = tensors["model.embed_tokens.weight"]
    assert emb.dtype == hf.ml_dtypes.bfloat16
    np.testing.assert_array_equal(emb, saved["params"]["embed"]["table_vd"].astype(hf.ml_dtypes.bfloat16))
    # refused: the directory already holds a model; --dtype without --format hf
    assert main(["export", "--run_dir", str(run), "--out", str(out), "--format", "hf"]) == 2
    assert f"--out {out} is not empty (holds config.json, export.json, generation_config.json" in capsys.readouterr().err
    assert main(["export", "--run_dir", str(run), "--out", str(tmp_path / "o"), "--dtype", "bfloat16"]) == 2
    assert "--dtype applies to --format hf only" in capsys.readouterr().err


def test_export_errors_exit_2_on_stderr_before_reading_params(saved_fsdp8, tmp_path, capsys, monkeypatch):
    from scaling.__main__ import main

    _, run_dir, _ = saved_fsdp8
    missing = tmp_path / "no_such_run"
    assert main(["export", "--run_dir", str(missing), "--out", str(tmp_path / "o1")]) == 2  # was 1, on stdout
    out = capsys.readouterr()
    assert f"run directory {missing} does not exist" in out.err and not out.out
    (tmp_path / "empty_run").mkdir()
    assert main(["export", "--run_dir", str(tmp_path / "empty_run"), "--out", str(tmp_path / "o2")]) == 2
    assert "no complete checkpoint in" in capsys.readouterr().err
    # An occupied destination is refused before the params are read (no restore happens).
    (tmp_path / "taken" / "params").mkdir(parents=True)
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setattr(C, "_read_params", lambda *a, **k: pytest.fail("read the params for a refused --out"))
    for out_dir, why in ((tmp_path / "taken", "is not empty (holds params)"), (tmp_path / "a_file", "is not a directory"),
                         (run_dir, "is the run directory itself")):
        assert main(["export", "--run_dir", str(run_dir), "--out", str(out_dir)]) == 2
        assert why in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "x" and not (run_dir / "export.json").exists()

def _small_state(i: int) -> dict:
    return {"w": np.full((4, 4), float(i), np.float32), "step": np.int32(i)}


def test_keep_last_k_and_every_m_th(tmp_path):
    cfg = load_config(None, ["--checkpoint.keep=2", "--checkpoint.keep_period=4", "--checkpoint.every=1"]).checkpoint
    ck = C.Checkpointer(tmp_path, cfg)
    for step in range(1, 11):
        assert ck.save(step, _small_state(step), {"loader": {"next_index": step}})
    # A preemption at a step that was just saved periodically: no second save, no error.
    assert not ck.save(10, _small_state(10), {"loader": {"next_index": 10}}, force=True)
    ck.close()
    assert C.complete_steps(tmp_path / "checkpoints") == [4, 8, 9, 10]


def test_async_save_returns_before_the_write_and_partial_is_ignored(tmp_path, monkeypatch):
    """Hold Orbax's final commit of step 2 on an event: save() must return anyway (async).
    A copy of the directory taken at that moment is what a kill -9 leaves behind."""
    from orbax.checkpoint._src.path import atomicity

    release, reached = threading.Event(), threading.Event()
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def held_finalize(self, *args, **kwargs):
        if self.get_final().name == "2":
            reached.set()
            release.wait(timeout=60)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held_finalize)
    cfg = load_config(None, ["--checkpoint.every=1"]).checkpoint
    run = tmp_path / "run"
    ck = C.Checkpointer(run, cfg)
    ck.save(1, _small_state(1), {"loader": {"next_index": 1}})
    ck.wait()
    t0 = time.perf_counter()
    ck.save(2, _small_state(2), {"loader": {"next_index": 2}})
    assert time.perf_counter() - t0 < 30 and ck.is_saving()  # returned while the write is pending
    assert reached.wait(timeout=60)
    killed = tmp_path / "killed"
    shutil.copytree(run, killed)  # the disk as a process killed right now would leave it
    release.set()
    ck.close()
    assert C.complete_steps(run / "checkpoints") == [1, 2]

    ckd = killed / "checkpoints"
    assert [p.name for p in C.partial_checkpoints(ckd)] == ["2" + C.TMP_DIR_SUFFIX]
    assert C.complete_steps(ckd) == [1]
    (ckd / "3").mkdir()  # an empty step directory: nothing of a save (one with files is complete: audit2)
    assert len(C.partial_checkpoints(ckd)) == 2
    ck2 = C.Checkpointer(killed, cfg)
    assert len(ck2.partial) == 2 and C.partial_checkpoints(ckd) == []  # reported, then removed
    target = {"w": jax.ShapeDtypeStruct((4, 4), np.float32), "step": jax.ShapeDtypeStruct((), np.int32)}
    restored = ck2.restore(target)
    assert restored.step == 1 and float(restored.state["w"][0, 0]) == 1.0
    ck2.save(2, _small_state(2), {"loader": {"next_index": 2}})  # the step can be saved again
    ck2.close()
    assert C.complete_steps(ckd) == [1, 2]


def test_unreadable_latest_checkpoint_falls_back_and_is_moved_aside(tmp_path):
    cfg = load_config(None, ["--checkpoint.every=1"]).checkpoint
    ck = C.Checkpointer(tmp_path, cfg)
    for step in (1, 2):
        ck.save(step, _small_state(step), {"loader": {"next_index": step}})
    ck.close()
    for f in (tmp_path / "checkpoints/2/state").rglob("*"):  # committed, but its data is gone
        if f.is_file() and f.name != C.COMMIT_SUCCESS_FILE:
            f.write_bytes(b"")
    lines = []
    ck = C.Checkpointer(tmp_path, cfg)
    target = {"w": jax.ShapeDtypeStruct((4, 4), np.float32), "step": jax.ShapeDtypeStruct((), np.int32)}
    restored = ck.restore(target, log=lines.append)
    ck.close()
    assert restored.step == 1
    assert len(lines) == 1 and lines[0].startswith("checkpoint: step 2 is unreadable")
    assert C.complete_steps(tmp_path / "checkpoints") == [1]
    assert len(list((tmp_path / C.BROKEN_DIR).iterdir())) == 1


def _blowup_cfg(policy: str):
    # lr 1e30: the first update makes the weights ~1e30, so step 2's logits overflow to
    # inf and its loss is NaN: the real non-finite path, no test-only knob.
    return load_config(
        TINY,
        [
            "--data.source=synthetic",
            "--mesh.fsdp=1",  # one device: the policy is the same on any mesh, and compiles faster
            "--train.steps=4",
            "--train.batch_size=8",
            "--train.seq_len=16",
            "--train.log_every=1",
            "--train.eval_every=0",
            f"--train.nonfinite={policy}",
            "--optimizer.learning_rate=1e30",
            "--optimizer.warmup_steps=0",
            "--checkpoint.every=1",
            "--checkpoint.keep=5",
            "--logging.progress=false",
            "--logging.tensorboard=false",
        ],
    )


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def compile_cache(tmp_path):
    """A persistent compilation cache for this test only: both runs compile the same
    programs (the policy acts on the host), so the second one reuses the first's."""
    from jax._src import compilation_cache  # reset_cache: how JAX's own tests switch it

    old = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
    compilation_cache.reset_cache()


def test_nonfinite_stop_keeps_last_good_checkpoint_and_skip_drops_updates(tmp_path, compile_cache):
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 2; .* last good checkpoint \(step 1\) is kept"):
        train(_blowup_cfg("stop"), str(tmp_path / "stop"), log=lambda m: None, devices=jax.devices()[:1])
    assert C.complete_steps(tmp_path / "stop/checkpoints") == [1]

    summary = train(_blowup_cfg("skip"), str(tmp_path / "skip"), log=lambda m: None, devices=jax.devices()[:1])
    assert summary["exit"] == "done" and summary["step"] == 4
    assert [r["nonfinite_steps"] for r in _records(tmp_path / "skip")] == [0, 1, 2, 3]
    # Skipped updates leave params and optimizer state exactly as after step 1.
    ck = C.Checkpointer(tmp_path / "skip", _blowup_cfg("skip").checkpoint)
    after1 = ck.restore(abstract_state(summary["setup"]), step=1).state
    ck.close()
    _leaves_equal(after1["params"], summary["state"]["params"])
    _leaves_equal(after1["opt_state"], summary["state"]["opt_state"])


# ------------------------------------------------------------------ subprocess test

# Child wrapper: announce and slow down Orbax's final commit of each step directory (the
# rename that marks it complete), so the test can signal or kill it mid-save. The commit
# still runs on Orbax's background thread, as in a normal run.
HOOK = r"""
import os, sys, time
from orbax.checkpoint._src.path import atomicity
original = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize(self, *args, **kwargs):
    if self.get_final().name.isdigit():
        print(f"test-hook: committing step {self.get_final().name}", flush=True)
        time.sleep(float(os.environ["HOOK_SLEEP"]))
    return await original(self, *args, **kwargs)
atomicity.AtomicRenameTemporaryPath.finalize = finalize
from scaling.__main__ import main
sys.exit(main(sys.argv[1:]))
"""

STEPS = 30
STEP_LINE = re.compile(r"^step +(\d+) loss")


class Child:
    """`python -m scaling train` in a subprocess, its output read line by line."""

    def __init__(self, run_dir: Path, corpus: str, compile_cache: Path, hook: bool = False):
        args = [
            "train",
            "--config",
            TINY,
            "--run_dir",
            str(run_dir),
            f"--data.cache_dir={corpus}",
            "--data.max_corpus_mb=0.5",
            f"--train.steps={STEPS}",
            "--train.batch_size=8",
            "--train.seq_len=32",
            "--train.log_every=1",
            "--train.eval_every=0",
            "--checkpoint.every=3",
            "--checkpoint.keep=2",
            "--logging.progress=false",
            "--logging.tensorboard=false",
        ]
        env = dict(os.environ, JAX_PLATFORMS="cpu", HOOK_SLEEP="1.5", PYTHONUNBUFFERED="1")
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
        env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        cmd = [sys.executable, "-c", HOOK, *args] if hook else [sys.executable, "-m", "scaling", *args]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.lines: list[str] = []
        self.t0 = time.perf_counter()

    def until(self, pattern: str) -> re.Match:
        """Read lines until one matches; fail if the child exits first."""
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"child exited before {pattern!r}:\n" + "\n".join(self.lines[-40:]))

    def last_step(self) -> int:
        steps = [int(m.group(1)) for line in self.lines if (m := STEP_LINE.match(line))]
        return max(steps, default=0)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float = 300) -> int:
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines += out.splitlines()
        print(f"child {self.proc.args[-14:-13]} exit {self.proc.returncode} after {time.perf_counter() - self.t0:.0f}s")
        return self.proc.returncode

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _trajectory(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["nonfinite_steps"]) for r in _records(run_dir)]


def test_sigterm_kill9_and_double_signal_resume_bit_exactly(tmp_path, corpus_cache):
    """One run directory taken through SIGTERM, SIGKILL mid-save, and a second SIGTERM
    mid-save, then resumed to the end: its per-step metrics equal an uninterrupted run's."""
    from scaling.data import build_token_store

    build_token_store(load_config(TINY, [f"--data.cache_dir={corpus_cache}", "--data.max_corpus_mb=0.5"]), log=lambda m: None)
    cache = tmp_path / "xla-cache"
    ref = Child(tmp_path / "ref", corpus_cache, cache)  # runs alongside the interrupted chain
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    rng = random.Random()
    seed = rng.randrange(10**6)
    rng.seed(seed)

    # 1. SIGTERM mid-run: the step finishes, a checkpoint is written, exit 0 with one line.
    c = Child(run, corpus_cache, cache)
    c.until(r"^step +2 loss")
    c.signal(signal.SIGTERM)
    assert c.finish() == 0, c.text
    m = re.search(r"^SIGTERM: saved checkpoint at step (\d+) in .*; exiting$", c.text, re.M)
    assert m, c.text
    stopped = int(m.group(1))
    assert stopped < STEPS and stopped in C.complete_steps(ckpts)

    # 2. Resume, then SIGKILL while the commit of a (randomly chosen) later save is pending;
    #    steps logged after that save started show the step loop did not wait for it.
    c = Child(run, corpus_cache, cache, hook=True)
    assert int(c.until(r"resuming from checkpoint step (\d+)").group(1)) == stopped
    for _ in range(rng.choice([1, 2])):
        killed_at = int(c.until(r"test-hook: committing step (\d+)").group(1))
    # The save of step `killed_at` began after that step; a later step logged before it is
    # committed shows the loop went on meanwhile (a further save would wait for this one).
    if c.last_step() <= killed_at:
        c.until(r"^step +\d+ loss")
    assert c.last_step() > killed_at, c.text
    c.signal(signal.SIGKILL)
    assert c.finish() == -signal.SIGKILL
    assert [p.name for p in C.partial_checkpoints(ckpts)] == [f"{killed_at}{C.TMP_DIR_SUFFIX}"], f"seed {seed}"
    good = C.complete_steps(ckpts)[-1]
    assert good < killed_at

    # 3. The next start reports the partial save and resumes from the step before it; a
    #    SIGTERM asks for a checkpoint, and a second one during that save exits at once.
    c = Child(run, corpus_cache, cache, hook=True)
    c.until(rf"checkpoint: ignoring and removing partial save .*/{killed_at}{re.escape(C.TMP_DIR_SUFFIX)}")
    assert int(c.until(r"resuming from checkpoint step (\d+)").group(1)) == good
    c.until(r"^step +\d+ loss")
    c.signal(signal.SIGTERM)
    c.until(r"test-hook: committing step")
    c.signal(signal.SIGTERM)
    assert c.finish() == -signal.SIGTERM, c.text
    assert "send it again to exit now" in c.text

    # 4. Finish. Every step is logged once, with the uninterrupted run's values, bit for bit.
    c = Child(run, corpus_cache, cache)
    assert c.finish() == 0, c.text
    assert re.search(r"resuming from checkpoint step \d+", c.text)
    assert ref.finish() == 0, ref.text
    assert _trajectory(run) == _trajectory(tmp_path / "ref"), f"seed {seed}"
    assert [r["step"] for r in _records(run)] == list(range(1, STEPS + 1))
    assert STEPS in C.complete_steps(ckpts)  # always saved at the end
