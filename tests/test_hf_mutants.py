"""Mutants of scaling/interop/hf.py and scaling/generate_cli.py that the suite let through, each
killed against a reference that does not come from the code under test:

- transformers' own reading of config.json (LlamaConfig's defaults, `dtype` before `torch_dtype`,
  _compute_llama3_parameters' fallback for original_max_position_embeddings), as checked with
  transformers 5.24 (the fixtures' generator, scripts/make_hf_fixtures.py);
- Meta's Llama 3.1 RoPE scaling (llama-models, `apply_scaling`) written out in float64 numpy;
- hand-built models whose greedy tokens are known by construction (a "successor" model: attention
  and MLP weights zero, so each next token depends on the last token alone), so the CLI's
  printed text is known before it runs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from rope_reference import meta_llama3_inv_freq  # noqa: E402

from scaling.interop import hf

FIXTURES = Path(__file__).parent / "fixtures" / "hf_tiny"

# The minimal Llama config.json: the keys transformers' LlamaConfig has no default for here.
MINIMAL = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
           "num_attention_heads": 4}


# --------------------------------------------------------------------------- config.json in


def test_missing_keys_read_as_transformers_defaults():
    """transformers' LlamaConfig defaults: rope_theta 10000, rms_norm_eps 1e-6,
    max_position_embeddings 2048, tie_word_embeddings false, num_key_value_heads = heads."""
    cfg = hf.config_from_hf(MINIMAL)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_seq_len) == (10000.0, 1e-6, 2048)
    assert cfg.tie_embeddings is False and cfg.num_kv_heads == 4 and cfg.resolved_head_dim == 4
    assert cfg.rope_scaling_factor == 0.0 and cfg.param_dtype.value == "float32"
    # a top-level rope_theta (transformers 4.x) where rope_parameters has none
    assert hf.config_from_hf({**MINIMAL, "rope_theta": 500000.0, "rope_parameters": {"rope_type": "default"}}).rope_theta == 500000.0


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers_5():
    """Both present: transformers 5 takes rope_scaling whole (`rope_scaling or rope_parameters`,
    RotaryEmbeddingConfigMixin.convert_rope_params_to_dict), its theta falling back to the
    top-level rope_theta; we merged the two with rope_parameters winning."""
    both = {**MINIMAL, "rope_theta": 500000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}}
    cfg = hf.config_from_hf(both)
    assert (cfg.rope_scaling_factor, cfg.rope_original_max_len, cfg.rope_theta) == (8.0, 64, 500000.0)
    # rope_scaling null: rope_parameters, with its own theta
    cfg = hf.config_from_hf({**both, "rope_scaling": None})
    assert (cfg.rope_scaling_factor, cfg.rope_theta) == (0.0, 10000.0)
    # the error names the dict that was read
    bad = {**both, "rope_scaling": {**both["rope_scaling"], "factor": 0.5}}
    with pytest.raises(hf.HFFormatError, match=r"rope_scaling\.factor=0.5"):
        hf.config_from_hf(bad)


def test_a_window_spanning_every_position_is_full_attention():
    """sliding_window >= max_position_embeddings masks nothing the model can see (transformers
    keeps keys q - window < k <= q): it loads as the config without it. It had been refused."""
    plain = hf.config_from_hf({**MINIMAL, "max_position_embeddings": 512})
    assert hf.config_from_hf({**MINIMAL, "max_position_embeddings": 512, "sliding_window": 512}) == plain
    assert hf.config_from_hf({**MINIMAL, "max_position_embeddings": 512, "sliding_window": None}) == plain
    with pytest.raises(hf.HFFormatError, match="sliding_window=511 < max_position_embeddings=512"):
        hf.config_from_hf({**MINIMAL, "max_position_embeddings": 512, "sliding_window": 511})


def test_dtype_is_read_before_torch_dtype():
    """transformers 5 reads `dtype` first (torch_dtype is its old name): bf16 here, not f16."""
    cfg = hf.config_from_hf({**MINIMAL, "dtype": "bfloat16", "torch_dtype": "float16"})
    assert cfg.param_dtype.value == "bfloat16"


@pytest.mark.parametrize("rope", [
    # Llama 3.1 8B's config.json (transformers 4.x layout)
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    # other factors in transformers 5's layout
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 2.0,
                         "high_freq_factor": 8.0, "original_max_position_embeddings": 256}},
])
def test_llama3_frequencies_follow_metas_reference(rope):
    from scaling.layers import rope_frequencies

    hfc = {**MINIMAL, "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072, **rope}
    cfg = hf.config_from_hf(hfc)
    r = {**rope.get("rope_scaling", {}), **rope.get("rope_parameters", {})}
    theta = rope.get("rope_theta", r.get("rope_theta"))
    head_dim = 128
    want, bands = meta_llama3_inv_freq(theta, head_dim, r["factor"], r["low_freq_factor"], r["high_freq_factor"],
                                       r["original_max_position_embeddings"])
    assert set(bands) == {"kept", "divided", "blended"}  # every branch of the formula is exercised
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg), np.float64), want, rtol=2e-6)


def test_llama3_missing_factors_and_length():
    """Missing low/high factors: Meta's constants (1 and 4, apply_scaling); a missing
    original_max_position_embeddings: max_position_embeddings, as transformers'
    _compute_llama3_parameters falls back to (it had been 8192, another model than transformers')."""
    cfg = hf.config_from_hf({**MINIMAL, "max_position_embeddings": 512, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor) == (8.0, 1.0, 4.0)
    assert cfg.rope_original_max_len == 512


@pytest.mark.parametrize("edit,msg", [
    ({"sliding_window": 4096, "max_position_embeddings": 32768},  # Mistral 7B v0.1
     "sliding_window=4096 < max_position_embeddings=32768: sliding-window attention is not supported"),
    ({"sliding_window": 0}, r"sliding_window=0; allowed: a positive int, or null"),
    ({"sliding_window": "4096"}, r"sliding_window='4096'; allowed: a positive int, or null"),
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type='gemma' is not a Llama-family"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh': only silu"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"hidden_size": 18}, "hidden_size=18 is not a multiple of num_attention_heads=4, and no head_dim"),
    # values that had been taken as they were (a model transformers would not build, or another one)
    ({"num_key_value_heads": -2}, r"num_key_value_heads=-2; allowed: a positive int"),
    ({"head_dim": 7}, r"head_dim=7; allowed: a positive even int"),
    ({"head_dim": "16"}, r"head_dim='16'; allowed"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings='false'; allowed: true or false"),
    ({"max_position_embeddings": None}, r"max_position_embeddings=None; allowed: a positive int"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps=0; allowed: a positive finite number"),
    ({"rope_scaling": [8.0]}, r"rope_scaling=\[8.0\]; allowed: an object, or null"),
    # factor 0 had turned the scaling off (transformers divides by it); factor < 1 is not llama3's
    ({"rope_scaling": {"rope_type": "llama3", "factor": 0.0}}, r"rope_scaling.factor=0.0; allowed: a number >= 1"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
     r"rope_parameters.low_freq_factor/high_freq_factor=\(4.0, 4.0\); allowed: numbers with 0 < low < high"),
])
def test_configs_the_model_does_not_compute_are_refused(edit, msg):
    with pytest.raises(hf.HFFormatError, match=msg):
        hf.config_from_hf({**MINIMAL, **edit})


def test_bad_directory_and_dtype_arguments_are_named(tmp_path):
    with pytest.raises(hf.HFFormatError, match="nope: no such directory"):
        hf.load(tmp_path / "nope")
    (tmp_path / "d" / "config.json").mkdir(parents=True)  # (had been a bare IsADirectoryError)
    with pytest.raises(hf.HFFormatError, match=r"d/config.json: cannot read it"):
        hf.load(tmp_path / "d")
    for bad in ("fp8", "auto"):  # (had been "'fp8' is not a valid DType"; auto had loaded)
        with pytest.raises(ValueError, match=rf"param_dtype='{bad}'; allowed: float32, bfloat16, float16"):
            hf.load(FIXTURES / "plain", param_dtype=bad)


# --------------------------------------------------------------------------- config.json out


def _tiny(**kw):
    from scaling.config import ModelConfig
    from scaling.model import Transformer

    cfg = ModelConfig(**{**dict(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=24,
                                max_seq_len=64, param_dtype="float32", compute_dtype="float32"), **kw})
    return cfg, Transformer(cfg, rngs=nnx.Rngs(params=0))


def test_saved_config_json_holds_the_models_values(tmp_path):
    """Values other than the fixtures' (theta 1e4, eps 1e-5, original length 32) reach config.json
    under transformers' key names, and read back."""
    cfg, model = _tiny(rope_theta=500000.0, norm_eps=1e-6, max_seq_len=256, rope_scaling_factor=4.0,
                       rope_low_freq_factor=2.0, rope_high_freq_factor=8.0, rope_original_max_len=64)
    hf.save(cfg, model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["rope_theta"], written["rms_norm_eps"], written["max_position_embeddings"]) == (500000.0, 1e-6, 256)
    assert written["rope_scaling"] == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                                       "high_freq_factor": 8.0, "original_max_position_embeddings": 64}
    assert (written["num_attention_heads"], written["num_key_value_heads"], written["head_dim"]) == (2, 1, 8)
    assert (written["tie_word_embeddings"], written["torch_dtype"], written["dtype"]) == (False, "float32", "float32")
    assert dataclasses.replace(hf.load(tmp_path)[0], compute_dtype=cfg.compute_dtype) == cfg  # (not in config.json)


def test_saved_safetensors_carry_format_pt(tmp_path):
    """transformers refuses a safetensors file whose metadata lacks format "pt" (load_state_dict:
    "does not contain the valid metadata")."""
    from safetensors import safe_open

    cfg, model = _tiny()
    hf.save(cfg, model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    assert not list(tmp_path.glob("*.tmp"))


def test_float16_save_and_bad_dtypes(tmp_path):
    """dtype="float16": each tensor is numpy's f32 -> f16 rounding of the model's, config.json says
    float16 and the loaded model holds f16 weights."""
    src = FIXTURES / "plain"
    cfg, model = hf.load(src)
    hf.save(cfg, model, tmp_path / "f16", dtype="float16")
    want = hf.read_safetensors(src / "model.safetensors")
    got = hf.read_safetensors(tmp_path / "f16" / "model.safetensors")
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == np.float16
        np.testing.assert_array_equal(got[name], w.astype(np.float16))
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["torch_dtype"] == "float16"
    cfg16, model16 = hf.load(tmp_path / "f16")
    assert cfg16.param_dtype.value == "float16"
    assert {a.dtype for a in jax.tree.leaves(nnx.state(model16, nnx.Param))} == {np.dtype(np.float16)}
    for bad in ("fp8", np.int8, "float64"):
        with pytest.raises(ValueError, match="cannot save weights as that; allowed: float32, bfloat16, float16"):
            hf.save(cfg, model, tmp_path / "bad", dtype=bad)
    assert not (tmp_path / "bad").exists()


def test_tokenizer_files_for_transformers(tmp_path):
    """A tokenizer exactly as large as the vocabulary is accepted (257 = 256 bytes + EOS), and the
    files transformers' AutoTokenizer / generate read say: EOS 256 stops and pads, no BOS."""
    from scaling.data import ByteTokenizer

    cfg, model = _tiny(vocab_size=257, max_seq_len=96)
    hf.save(cfg, model, tmp_path, tokenizer=ByteTokenizer())
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 256, "pad_token_id": 256}
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (tc["eos_token"], tc["pad_token"], tc["bos_token"], tc["add_bos_token"]) == ("<|eos|>", "<|eos|>", None, False)
    assert tc["model_max_length"] == 96
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == 256


# --------------------------------------------------------------------------- tensors in


def _copy(tmp_path, name, tensors, src="plain"):
    d = tmp_path / name
    d.mkdir()
    shutil.copy(FIXTURES / src / "config.json", d / "config.json")
    for fname, t in tensors.items():
        hf.write_safetensors(d / fname, t)
    return d


def test_index_that_names_tensors_its_shards_lack(tmp_path):
    t = hf.read_safetensors(FIXTURES / "plain" / "model.safetensors")
    d = _copy(tmp_path, "idx", {"a.safetensors": t})
    weight_map = {**{k: "a.safetensors" for k in t}, "model.layers.0.self_attn.rotary_emb.inv_freq": "a.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(hf.HFFormatError, match=r"names tensors its shards lack: \['model.layers.0.self_attn.rotary_emb"):
        hf.load(d)


def test_weights_in_a_file_of_another_name(tmp_path):
    """No model.safetensors and no index: every *.safetensors file is read (here two halves)."""
    t = hf.read_safetensors(FIXTURES / "plain" / "model.safetensors")
    names = sorted(t)
    d = _copy(tmp_path, "other", {"part-a.safetensors": {k: t[k] for k in names[:10]},
                                  "part-b.safetensors": {k: t[k] for k in names[10:]}})
    _, model = hf.load(d)
    tokens = np.load(FIXTURES / "plain" / "tokens.npy")
    np.testing.assert_allclose(np.asarray(model(tokens)), np.load(FIXTURES / "plain" / "logits.npy"), atol=1e-4, rtol=0)


def test_unreadable_safetensors_file_is_named(tmp_path):
    data = (FIXTURES / "plain" / "model.safetensors").read_bytes()
    d = _copy(tmp_path, "cut", {})
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(hf.HFFormatError, match=r"cut/model.safetensors: cannot read safetensors"):
        hf.load(d)


def test_long_lists_of_bad_tensors_are_counted(tmp_path):
    """Five names, then how many more: the plain fixture has 9 tensors a layer; its 10 non-square
    projections (k, v, gate, up, down of 2 layers) transposed are 10 wrong shapes."""
    t = hf.read_safetensors(FIXTURES / "plain" / "model.safetensors")
    no_layer1 = {k: v for k, v in t.items() if ".layers.1." not in k}
    with pytest.raises(hf.HFFormatError, match=r"missing from the checkpoint: (model\.layers\.1\.[\w.]+, ){4}"
                                               r"model\.layers\.1\.[\w.]+ and 4 more$"):
        hf.load(_copy(tmp_path, "no_layer1", {"model.safetensors": no_layer1}))
    wide = ("k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    transposed = {k: (v.T.copy() if any(w in k for w in wide) else v) for k, v in t.items()}
    with pytest.raises(hf.HFFormatError) as e:
        hf.load(_copy(tmp_path, "transposed", {"model.safetensors": transposed}))
    msg = str(e.value)
    assert msg.count("config.json gives") == 5 and msg.endswith("; and 5 more")


def test_integer_weights_are_refused_not_cast(tmp_path):
    """An int8 projection (a quantized checkpoint's codes) was cast to float and loaded as if
    it were the weight; a bool norm too. Refused, naming the tensors and their dtypes."""
    t = hf.read_safetensors(FIXTURES / "plain" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    codes = {**t, q: np.clip(np.round(np.asarray(t[q], np.float32) * 100), -127, 127).astype(np.int8),
             "model.norm.weight": np.ones_like(t["model.norm.weight"], dtype=bool)}
    with pytest.raises(hf.HFFormatError, match=rf"not floating point .*: model.norm.weight \(bool\), {q} \(int8\)$"):
        hf.load(_copy(tmp_path, "int8", {"model.safetensors": codes}))


# --------------------------------------------------------------------------- the generate CLI

SUCCESSOR = {0x61: 0xC3, 0xC3: 0xA9, 0xA9: 0x21, 0x21: 0xE2, 0xE2: 0x9C, 0x9C: 0x93, 0x93: 256}  # "a" -> "é!✓" EOS
OTHERS_NEXT = 0x61  # every other token (EOS included) -> "a"


def _successor_tensors(vocab=257, d=8, successor=None):
    """HF tensors of a 1-layer Llama whose greedy next token is successor[last token] (SUCCESSOR
    by default): attention and MLP weights are zero, so the final hidden state is the last token's
    embedding, a one-hot slot; lm_head gives that slot's successor the only nonzero logit (sqrt(d)
    after the norm)."""
    successor = SUCCESSOR if successor is None else successor
    slots = {tok: i + 1 for i, tok in enumerate(successor)}  # slot 0: every other token
    embed = np.zeros((vocab, d), np.float32)
    head = np.zeros((vocab, d), np.float32)
    for tok in range(vocab):
        embed[tok, slots.get(tok, 0)] = 1.0
    for tok, slot in slots.items():
        head[successor[tok], slot] = 1.0
    head[OTHERS_NEXT, 0] = 1.0
    n, k, h, f = 2, 1, 4, 8
    p = "model.layers.0."
    return {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": np.ones(d, np.float32),
            p + "input_layernorm.weight": np.ones(d, np.float32), p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": np.zeros((n * h, d), np.float32),
            p + "self_attn.k_proj.weight": np.zeros((k * h, d), np.float32),
            p + "self_attn.v_proj.weight": np.zeros((k * h, d), np.float32),
            p + "self_attn.o_proj.weight": np.zeros((d, n * h), np.float32),
            p + "mlp.gate_proj.weight": np.zeros((f, d), np.float32), p + "mlp.up_proj.weight": np.zeros((f, d), np.float32),
            p + "mlp.down_proj.weight": np.zeros((d, f), np.float32)}


SUCCESSOR_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 257, "hidden_size": 8,
                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                    "tie_word_embeddings": False, "torch_dtype": "float32"}


def _byte_tokenizer_eos_not_special(path):
    """Byte-level BPE, id = byte value, and id 256 "<|eos|>" as an ordinary token: decoding prints it,
    so only the CLI's own filtering keeps a stop token out of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in hf._byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab={**vocab, "<|eos|>": 256}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    assert tok.decode([0x61, 256]) == "a<|eos|>"
    tok.save(str(path))


def _successor_hf_dir(tmp_path, name="succ", config_eos=256, generation_eos=None):
    d = tmp_path / name
    d.mkdir()
    cfg = {**SUCCESSOR_CONFIG, **({"eos_token_id": config_eos} if config_eos is not None else {})}
    (d / "config.json").write_text(json.dumps(cfg))
    if generation_eos is not None:
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    hf.write_safetensors(d / "model.safetensors", _successor_tensors())
    _byte_tokenizer_eos_not_special(d / "tokenizer.json")
    return d


def test_cli_streams_whole_characters_and_stops(tmp_path, capsys):
    """One token a chunk: "é" arrives as two bytes and "✓" as three; the text holds a partial
    character back until it is whole (it had printed U+FFFD, then lost the character), and the
    stop token ends the text without being printed. By construction: "a" -> "é!✓" EOS."""
    from scaling.generate_cli import main

    d = _successor_hf_dir(tmp_path)
    base = ["--checkpoint", str(d), "--chunk", "1", "--max-new-tokens", "10"]
    assert main(base + ["--prompt", "a"]) == 0
    out = capsys.readouterr()
    assert out.out == "aé!✓\n" and "[7 tokens" in out.err
    assert main(base + ["--prompt", "a", "--no-stop"]) == 0  # past EOS: "a" again, its text not printed
    assert capsys.readouterr().out == "aé!✓aé\n"
    assert main(base + ["--prompt", "a", "--prompt", "!"]) == 0  # a batch, printed at the end
    assert capsys.readouterr().out == "=== 'a'\naé!✓\n=== '!'\n!✓\n"
    # --max-len 3: a cache of 3 positions holds the prompt and 2 fed-back tokens, so 3 new tokens
    assert main(base + ["--prompt", "a", "--max-len", "3"]) == 0
    out = capsys.readouterr()
    assert out.out == "aé!\n" and "[3 tokens" in out.err
    # ... and says so (the text had ended short without a word)
    assert "note: --max-len 3 leaves room for 3 new tokens after the prompt (1 tokens), fewer than --max-new-tokens 10" in out.err
    assert main(base + ["--prompt", "a", "--max-len", "16"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_cli_seed_picks_the_sampled_tokens(tmp_path, capsys):
    """Sampling at temperature 1 (the successor's probability is e^sqrt(8) / (e^sqrt(8) + 256), about
    6%, so 8 tokens are all but random): the same seed, the same text; another seed, another."""
    from scaling.generate_cli import main

    d = _successor_hf_dir(tmp_path)
    texts = []
    for seed in (1, 2, 1):
        assert main(["--checkpoint", str(d), "--prompt", "a", "--max-new-tokens", "8", "--no-stop",
                     "--temperature", "1", "--seed", str(seed)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[2] != texts[1]


def test_hf_stop_ids_from_both_files(tmp_path, capsys):
    """Stop tokens: generation_config.json's eos_token_id where it sets one (an int or a list), else
    config.json's, as transformers' generate reads them. Here '!' (0x21) also stops: "a" -> "é"."""
    from scaling.generate_cli import load_any, main

    only_config = _successor_hf_dir(tmp_path, "only_config")
    assert load_any(only_config)[2] == [256]
    both = _successor_hf_dir(tmp_path, "both", config_eos=256, generation_eos=[0x21, 256])
    assert load_any(both)[2] == [0x21, 256]
    assert main(["--checkpoint", str(both), "--prompt", "a", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == "aé\n"
    with pytest.raises(ValueError, match=r"--step 3: .* is a Hugging Face directory"):
        load_any(both, step=3)
    (both / "model.safetensors").rename(both / "weights.safetensors")  # any *.safetensors name
    assert load_any(both)[2] == [0x21, 256]
    bad = _successor_hf_dir(tmp_path, "bad_generation", generation_eos=[0x21])
    (bad / "generation_config.json").write_text("{oops")
    assert main(["--checkpoint", str(bad), "--prompt", "a"]) == 2  # (had been "error: Expecting property name ...")
    assert "bad_generation/generation_config.json is not valid JSON" in capsys.readouterr().err
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    assert main(["--checkpoint", str(bad), "--prompt", "a"]) == 2  # (had been a TypeError traceback in sorted)
    assert "generation_config.json: eos_token_id='</s>'; allowed: a token id or a list of them" in capsys.readouterr().err


def test_cli_export_directory_stops_at_the_run_tokenizers_eos(tmp_path, capsys):
    """An export of a run (config.yaml, params/, tokenizer.json of the byte tokenizer): EOS 256 stops."""
    import orbax.checkpoint as ocp

    from scaling.config import dump_yaml, load_config, replace
    from scaling.generate_cli import main

    model_cfg = hf.config_from_hf(SUCCESSOR_CONFIG)
    cfg = load_config(None, ["--data.tokenizer=byte", "--train.seq_len=16", "--mesh.fsdp=1", "--mesh.data=-1"])
    cfg = replace(cfg, model={k: getattr(model_cfg, k) for k in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                                                 "num_kv_heads", "mlp_dim", "max_seq_len", "norm_eps")})
    params = hf.params_from_hf(cfg.model, _successor_tensors())
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "params", jax.tree.map(np.asarray, params))
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    (tmp_path / "tokenizer.json").write_text('{"kind": "byte"}')
    assert main(["--checkpoint", str(tmp_path), "--prompt", "a", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == "aé!✓\n"


def test_continuation_when_the_decoder_rewrites_the_prompts_end():
    """A decoder that cleans up tokenization spaces (" ," -> ","): the prompt "a " and a new ","
    decode together to "a,", which does not start with the prompt's text; the new text is ","."""
    from scaling.generate_cli import continuation

    class CleanupTokenizer:
        words = {1: "a", 2: " ", 3: ","}

        def decode(self, ids):
            return "".join(self.words[i] for i in ids).replace(" ,", ",")

    assert continuation(CleanupTokenizer(), [1, 2], [3]) == ","
    assert continuation(CleanupTokenizer(), [1], [2, 1]) == " a"
