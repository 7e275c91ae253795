"""Config audit: a Config built in Python gets load_config's checks; API misuse fails clearly.

Expected values are written out by hand (the loaded config a command line gives, the
message a user reads), never recomputed by the code under test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from scaling.config import (
    AttentionImpl,
    Config,
    ConfigError,
    DataConfig,
    DataSource,
    ModelConfig,
    OptimizerConfig,
    ProfileConfig,
    RematConfig,
    Schedule,
    TokenizerKind,
    TrainConfig,
    dump_yaml,
    load_config,
    replace,
)


# ------------------------------------------------- a Config built in Python is checked when built


@pytest.mark.parametrize(
    "build, needle",
    [
        # cross-section and range checks that load_config runs (train() never called validate)
        (lambda: Config(train=TrainConfig(seq_len=4096)), "train.seq_len: 4096 exceeds model.max_seq_len=2048"),
        (lambda: Config(train=TrainConfig(batch_size=10, grad_accum=3)), "train.grad_accum=3"),
        (lambda: Config(optimizer=OptimizerConfig(learning_rate=-1.0)), "optimizer.learning_rate: must be a positive"),
        (lambda: Config(model=ModelConfig(num_heads=6, num_kv_heads=4)), "not divisible by model.num_kv_heads=4"),
        (lambda: Config(train=TrainConfig(loss_chunk=48)), "train.loss_chunk"),
        # types: before, a TypeError/AttributeError deep in validate, or silently accepted
        (lambda: Config(train=TrainConfig(steps=2.5)), "train.steps: got 2.5; it takes an integer"),
        (lambda: Config(train=TrainConfig(batch_size=True)), "train.batch_size: got True; it takes an integer"),
        (lambda: Config(train=TrainConfig(steps="five")), "train.steps: got 'five'; it takes an integer"),
        (lambda: Config(optimizer=OptimizerConfig(schedule="cosin")),
         "optimizer.schedule: 'cosin' is not allowed; allowed values: cosine, linear, constant"),
        (lambda: Config(data=DataConfig(source="txt")), "data.source: 'txt' is not allowed; allowed values: text, tokens, synthetic"),
        (lambda: Config(remat=RematConfig(policy="names", names="attn")), "remat.names: got str 'attn'; it takes a list of strings"),
        (lambda: Config(profile=ProfileConfig(steps=[5, "x"])), "profile.steps[1]: got 'x'; it takes an integer"),
        (lambda: Config(run_dir=17), "run_dir: got int 17"),
        (lambda: Config(model={"num_layers": 3}), "model: got dict"),
        # dataclasses.replace builds a new Config too
        (lambda: dataclasses.replace(Config(), train=TrainConfig(seq_len=4096)), "train.seq_len: 4096 exceeds"),
    ],
)
def test_config_built_in_python_is_checked_like_a_loaded_one(build, needle):
    with pytest.raises(ConfigError) as e:
        build()
    assert needle in str(e.value), str(e.value)


def test_config_built_in_python_equals_the_loaded_one():
    """Values a loaded config holds as enum members, tuples, ints and str are normalised the
    same way, so the built config compares equal, hashes, dumps to YAML, and train's
    `.value` reads work (a plain "byte" tokenizer failed in scaling.data)."""
    built = Config(
        model=ModelConfig(num_layers=np.int64(3), rope_theta=np.float32(500000.0), param_dtype="bfloat16"),
        train=TrainConfig(steps=np.int64(7), nonfinite="skip"),
        optimizer=OptimizerConfig(schedule="linear", learning_rate=1),
        data=DataConfig(tokenizer="byte", path=Path("corpus/x.txt")),
        attention=dataclasses.replace(Config().attention, impl="xla"),
        remat=RematConfig(policy="names", names=["attn", "mlp"]),
        profile=ProfileConfig(steps=[5, 8]),
    )
    loaded = load_config(None, [
        "--model.num_layers=3", "--model.rope_theta=500000", "--model.param_dtype=bfloat16",
        "--train.steps=7", "--train.nonfinite=skip", "--optimizer.schedule=linear", "--optimizer.learning_rate=1",
        "--data.tokenizer=byte", "--data.path=corpus/x.txt", "--attention.impl=xla",
        "--remat.policy=names", "--remat.names=[attn, mlp]", "--profile.steps=[5, 8]",
    ])
    assert built == loaded
    assert hash(built) == hash(loaded)
    assert built.data.tokenizer is TokenizerKind.byte and built.data.tokenizer.value == "byte"
    assert built.optimizer.schedule is Schedule.linear and built.attention.impl is AttentionImpl.xla
    assert type(built.model.num_layers) is int and type(built.optimizer.learning_rate) is float
    assert built.data.path == "corpus/x.txt" and built.profile.steps == (5, 8)
    assert "path: corpus/x.txt" in dump_yaml(built)  # a PosixPath or a numpy scalar made safe_dump raise


def test_valid_config_built_in_python_is_unchanged():
    cfg = Config(data=DataConfig(source=DataSource.synthetic), train=TrainConfig(steps=5))
    assert cfg.data.source is DataSource.synthetic and cfg.train.steps == 5
    assert Config() == load_config(None)


def test_loading_still_names_the_key_when_the_check_runs_inside_decoding():
    # the checks now run while draccus builds the Config; its wrapper must not hide them
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train.seq_len=4096"])
    assert str(e.value).startswith("train.seq_len: 4096 exceeds model.max_seq_len=2048"), str(e.value)


# ----------------------------------------------------------------------------- API misuse


def test_overrides_given_as_one_string_are_refused_clearly():
    # a str is iterable: each character became an "override" ("override '-' must look like ...")
    with pytest.raises(ConfigError) as e:
        load_config(None, "--train.steps=5")
    assert "overrides must be a list of strings" in str(e.value) and "'--train.steps=5'" in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="overrides must be a list of strings"):
        load_config(None, ["--train.steps", 5])


def test_replace_takes_a_section_dataclass_as_well_as_a_mapping():
    cfg = load_config("configs/models/tiny.yaml")
    model = dataclasses.replace(cfg.model, num_layers=7)
    assert replace(cfg, model=model).model.num_layers == 7
    assert replace(cfg, model=model) == replace(cfg, model={"num_layers": 7})
    with pytest.raises(ConfigError, match="not divisible by model.num_kv_heads=3"):
        replace(cfg, model=dataclasses.replace(cfg.model, num_kv_heads=3))


def test_overrides_may_be_any_iterable_of_strings():
    cfg = load_config(None, (o for o in ["--train.steps=5", "--model.num_layers=3"]))  # a generator: read once
    assert (cfg.train.steps, cfg.model.num_layers) == (5, 3)


def test_an_empty_inherit_is_refused_not_ignored(tmp_path):
    # `inherit:` with the path left out read as "no parent": the run silently used the defaults
    path = tmp_path / "exp.yaml"
    path.write_text("inherit:\ntrain:\n  steps: 5\n")
    with pytest.raises(ConfigError, match="inherit must be the path of a YAML file .*got None"):
        load_config(path)
