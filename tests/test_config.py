import pytest

from scaling import accounting
from scaling.config import AttentionImpl, ConfigError, load_config, parse_overrides, replace

PRESETS = ["tiny", "25m", "125m", "350m", "1b", "llama2_7b", "llama2_13b", "llama3_8b", "llama3.2_1b", "tinyllama_1.1b"]

# Published parameter counts (Hugging Face model cards / safetensors metadata).
PUBLISHED_PARAMS = {
    "llama2_7b": 6_738_415_616,
    "llama2_13b": 13_015_864_320,
    "llama3_8b": 8_030_261_248,
    "llama3.2_1b": 1_235_814_400,
    "tinyllama_1.1b": 1_100_048_384,
}


def test_defaults_and_overrides():
    cfg = load_config(None, ["--model.num_layers=4", "--train.steps=7", "--attention.impl=xla", "mesh.fsdp=2"])
    assert cfg.model.num_layers == 4 and cfg.train.steps == 7 and cfg.mesh.fsdp == 2
    assert cfg.attention.impl is AttentionImpl.xla


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load(name):
    cfg = load_config(f"configs/models/{name}.yaml")
    assert cfg.model.num_heads % cfg.model.num_kv_heads == 0


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_public_shapes_match_published_parameter_counts(name):
    cfg = load_config(f"configs/models/{name}.yaml")
    assert accounting.param_count(cfg.model) == PUBLISHED_PARAMS[name]


def test_inherit_and_deltas(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  num_layers: 3\n  hidden_size: 64\n")
    (tmp_path / "exp.yaml").write_text("inherit: base.yaml\nmodel:\n  num_layers: 5\ntrain:\n  steps: 11\n")
    cfg = load_config(tmp_path / "exp.yaml", ["--train.seed=3"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.steps, cfg.train.seed) == (5, 64, 11, 3)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--model.num_layrs=4"], "unknown config key 'model.num_layrs'"),
        (["--modle.num_layers=4"], "allowed keys under the top level"),
        (["--model.num_layers=abc"], "model.num_layers"),
        (["--model.num_heads=6", "--model.num_kv_heads=4"], "not divisible by model.num_kv_heads=4"),
        (["--train.seq_len=4096"], "exceeds model.max_seq_len=2048"),
        (["--model.hidden_size=-8"], "model.hidden_size: must be a positive integer"),
        (["--train.batch_size=10", "--train.grad_accum=3"], "train.grad_accum=3"),
        (["--attention.impl=flash"], "allowed values: xla, cudnn, pallas, auto"),
        (["--remat.policy=names"], "remat.names"),
        (["--mesh.data=-1", "--mesh.fsdp=-1"], "at most one axis may be -1"),
        (["model.num_layers"], "--section.key=value"),
        (["--profile.steps=[4, 2]"], "profile.steps"),
        (["--mesh.rules=bogus"], "mesh.rules: 'bogus' is not a rule set; allowed: default, dp, fsdp, fsdp_tp"),
    ],
)
def test_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, overrides)
    assert needle in str(e.value), str(e.value)


def test_unknown_key_in_yaml(tmp_path):
    (tmp_path / "bad.yaml").write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="train.stepz"):
        load_config(tmp_path / "bad.yaml")


def test_parse_overrides_types():
    assert parse_overrides(["--a.b=4", "--a.c=0.5", "--d=[1, 2]", "--e=null", "--f=true"]) == {
        "a": {"b": 4, "c": 0.5},
        "d": [1, 2],
        "e": None,
        "f": True,
    }


def test_replace_revalidates():
    cfg = load_config("configs/models/tiny.yaml")
    assert replace(cfg, train={"steps": 3}).train.steps == 3
    with pytest.raises(ConfigError):
        replace(cfg, model={"num_kv_heads": 3})


# ------------------------------------------------------------ loading edge cases (YAML, overrides, domains)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, needle",
    [
        ("model:\n  num_layers: [1,\n", "line 3"),  # unclosed flow list
        ("model:\n num_layers: 2\n  hidden_size: 3\n", "line 3"),  # bad indentation
        ("model:\n\tnum_layers: 2\n", "line 2"),  # a tab
    ],
)
def test_yaml_syntax_errors_are_config_errors_naming_file_and_line(tmp_path, text, needle):
    path = _write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "text, key",
    [
        ("model:\n  num_layers: 3\n  hidden_size: 64\n  num_layers: 5\n", "'num_layers' repeated (first at line 2)"),
        ("model:\n  num_layers: 3\ntrain:\n  steps: 4\nmodel:\n  hidden_size: 64\n", "'model' repeated (first at line 1)"),
    ],
)
def test_a_key_repeated_in_one_yaml_file_is_an_error(tmp_path, text, key):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "dup.yaml", text))
    assert key in str(e.value), str(e.value)


def test_yaml_merge_keys_still_work(tmp_path):
    # `<<: *anchor` then an explicit key overriding the merged one is not a repeat
    path = _write(tmp_path, "m.yaml", "model:\n  <<: {num_layers: 3, hidden_size: 64}\n  num_layers: 5\n")
    cfg = load_config(path)
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (5, 64)


@pytest.mark.parametrize("value", ["3", "[base.yaml]", "''", "{a: 1}"])
def test_inherit_that_is_not_a_path_is_a_config_error(tmp_path, value):
    with pytest.raises(ConfigError, match="inherit must be the path of a YAML file"):
        load_config(_write(tmp_path, "exp.yaml", f"inherit: {value}\n"))


def test_inherit_relative_to_the_file_and_missing_parent_named(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    _write(tmp_path, "base.yaml", "model:\n  num_layers: 7\n")
    child = _write(tmp_path / "a" / "b", "exp.yaml", "inherit: ../../base.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config(child)
    assert (cfg.model.num_layers, cfg.train.steps) == (7, 9)
    orphan = _write(tmp_path / "a", "orphan.yaml", "inherit: nope.yaml\n")
    with pytest.raises(ConfigError) as e:
        load_config(orphan)
    assert f"{tmp_path / 'a' / 'nope.yaml'} (inherited by {orphan})" in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--model.num_layers=null"], "model.num_layers: cannot be null; it takes an integer"),
        (["--optimizer.learning_rate=null"], "optimizer.learning_rate: cannot be null; it takes a number"),
        (["--model.tie_embeddings=null"], "model.tie_embeddings: cannot be null; it takes true or false"),
        (["--data.cache_dir=null"], "data.cache_dir: cannot be null"),
        (["--profile.steps=null"], "profile.steps: cannot be null; it takes a list of integers"),
        (["--model.num_layers=true"], "model.num_layers: got True; it takes an integer"),
        (["--checkpoint.every=yes"], "checkpoint.every: got True"),
        (["--attention.bwd_workspace_mb=true"], "attention.bwd_workspace_mb: got True"),
        (["--model.tie_embeddings=1"], "model.tie_embeddings: got 1; it takes true or false"),
        (["--remat.policy=names", "--remat.names=foo"], "remat.names: got str 'foo'; it takes a list of strings"),
        (["--profile.steps=5"], "profile.steps: got int 5; it takes a list of integers"),
        (["--profile.steps=[true, 8]"], "profile.steps[0]: got True; it takes an integer"),
        (["--train.steps=[3]"], "train.steps: got [3]; it takes an integer"),
        (["--model.head_dim=None"], "model.head_dim: got 'None'; it takes an integer or null"),
        (["--run_dir.x=3"], "run_dir is a single value, not a section"),
        (["--model.num_layers.x=3"], "model.num_layers is a single value, not a section"),
        (["--model..num_layers=3"], "empty key in 'model..num_layers'"),
        (["--attention.impl=XLA"], "did you mean 'xla'?"),
        (["--data.path="], "data.path: must not be empty"),
        (["--run_dir="], "run_dir: must not be empty"),
    ],
)
def test_values_of_the_wrong_kind_are_refused_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("run_dir: 017\n", "run_dir: got int 15 (YAML read it as a number or a boolean; quote it)"),
        ("data:\n  path: 5\n", "data.path: got int 5"),
        ("mesh:\n  coordinator_address: 1:20\n", "mesh.coordinator_address: got int 80"),  # YAML 1.1 base 60
        ("mesh:\n  rules: on\n", "mesh.rules: got bool True"),
        ("model:\n  num_layers:\n", "model.num_layers: cannot be null"),
        ("remat:\n  names: [a, {b: 1}]\n", "remat.names[1]"),
    ],
)
def test_yaml_values_of_the_wrong_kind_are_refused(tmp_path, text, needle):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "c.yaml", text))
    assert needle in str(e.value), str(e.value)


def test_yaml_1_1_numbers_and_booleans(tmp_path):
    # PyYAML reads `3e-4` (no dot) as a string; number fields still take it
    path = _write(
        tmp_path,
        "c.yaml",
        "optimizer:\n  learning_rate: 3e-4\n  eps: 1.0e-6\ntrain:\n  steps: 1_000\n"
        "model:\n  tie_embeddings: yes\nlogging:\n  tensorboard: off\n  progress: on\n",
    )
    cfg = load_config(path)
    assert (cfg.optimizer.learning_rate, cfg.optimizer.eps, cfg.train.steps) == (0.0003, 1e-6, 1000)
    assert (cfg.model.tie_embeddings, cfg.logging.tensorboard, cfg.logging.progress) == (True, False, True)


def test_string_fields_take_the_override_text_as_written():
    cfg = load_config(
        None,
        ["--run_dir=017", "--mesh.coordinator_address=1:20", "--data.path=a #b", "--data.cache_dir=true"],
    )
    assert (cfg.run_dir, cfg.mesh.coordinator_address, cfg.data.path, cfg.data.cache_dir) == ("017", "1:20", "a #b", "true")
    cfg = load_config(None, ["--run_dir=x", "--data.path=null", "--run_dir=~"])  # null unsets an optional one
    assert (cfg.run_dir, cfg.data.path) == (None, None)


def test_repeated_overrides_last_wins_and_sections_merge():
    assert load_config(None, ["--model.num_layers=3", "--model.num_layers=5"]).model.num_layers == 5
    cfg = load_config(None, ["--model.num_layers=3", "--model={hidden_size: 64}"])
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (3, 64)
    cfg = load_config(None, ["--model={hidden_size: 64, num_layers: 3}", "--model.num_layers=6"])
    assert (cfg.model.num_layers, cfg.model.hidden_size) == (6, 64)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["--optimizer.eps=0"], "optimizer.eps: must be a positive finite number"),
        (["--optimizer.eps=-1e-8"], "optimizer.eps"),
        (["--optimizer.learning_rate=.inf"], "optimizer.learning_rate: must be a positive finite number"),
        (["--model.init_std=.inf"], "model.init_std"),
        (["--model.rope_theta=.inf"], "model.rope_theta"),
        (["--train.seed=-1"], "train.seed: must be in [0, 2**63)"),
        (["--model.rope_scaling_factor=0.5"], "model.rope_scaling_factor: must be 0 (off) or a finite factor >= 1"),
        (["--model.rope_scaling_factor=8", "--model.rope_low_freq_factor=4"], "need 0 < low < high"),
        (["--model.rope_scaling_factor=8", "--model.rope_low_freq_factor=0"], "need 0 < low < high"),
        (["--model.rope_scaling_factor=8", "--model.rope_original_max_len=0"], "model.rope_original_max_len"),
    ],
)
def test_numeric_domains_checked_at_load(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value), str(e.value)


def test_rope_fields_unchecked_when_scaling_is_off():
    cfg = load_config(None, ["--model.rope_low_freq_factor=4", "--model.rope_original_max_len=0"])
    assert cfg.model.rope_scaling_factor == 0


@pytest.mark.parametrize("name", PRESETS + ["../tiny_corpus"])
def test_dump_yaml_round_trips(tmp_path, name):
    from scaling.config import dump_yaml

    overrides = [
        "--run_dir=017", "--data.path=1:20", "--mesh.coordinator_address=10.0.0.1:1234", "--profile.steps=[5, 8]",
        "--remat.policy=names", "--remat.names=['yes', '1', attn]", "--optimizer.learning_rate=3e-4", "--train.seed=12345678901",
    ]
    for ovs in ([], overrides):
        cfg = load_config(f"configs/models/{name}.yaml", ovs)
        path = _write(tmp_path, "config.yaml", dump_yaml(cfg))
        assert load_config(path) == cfg
