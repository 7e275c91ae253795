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
