"""HF Llama interop against golden fixtures from transformers (scripts/make_hf_fixtures.py).

torch / transformers are not in this environment: the fixtures hold transformers' logits and
greedy tokens; the one test that needs transformers live runs only where it imports.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import decode
from scaling.interop import hf

FIXTURES = Path(__file__).parent / "fixtures" / "hf_tiny"
VARIANTS = ("plain", "tied")


@pytest.fixture(scope="module", params=VARIANTS)
def loaded(request):
    d = FIXTURES / request.param
    cfg, model = hf.load(d)
    return d, cfg, model


def test_config_mapping():
    cfg, _ = hf.load(FIXTURES / "tied")
    assert cfg.tie_embeddings and cfg.head_dim == 32 and cfg.hidden_size == 64 and cfg.num_kv_heads == 2
    assert (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len) == (8.0, 1.0, 4.0, 32)
    plain, _ = hf.load(FIXTURES / "plain")
    assert not plain.tie_embeddings and plain.head_dim is None and plain.resolved_head_dim == 16
    assert plain.rope_scaling_factor == 0.0


def test_logits_match_transformers(loaded):
    d, cfg, model = loaded
    tokens = jnp.asarray(np.load(d / "tokens.npy"))
    want = np.load(d / "logits.npy")
    got = np.asarray(jax.jit(lambda t: model(t))(tokens))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(loaded):
    d, cfg, model = loaded
    n = json.loads((d / "meta.json").read_text())["prompt_len"]
    prompts = np.load(d / "tokens.npy")[:, :n].tolist()
    want = np.load(d / "greedy.npy").tolist()
    got = decode.generate(model, prompts, len(want[0]))
    assert got == want


def test_save_then_load_roundtrip(loaded, tmp_path):
    d, cfg, model = loaded
    hf.save(cfg, model, tmp_path / "out")
    cfg2, model2 = hf.load(tmp_path / "out")
    assert cfg2 == cfg
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), hf.nnx.state(model, hf.nnx.Param), hf.nnx.state(model2, hf.nnx.Param))
    assert all(jax.tree.leaves(same))
    # The same tensor names and shapes as transformers' own save_pretrained.
    ours = {k: v.shape for k, v in hf.read_safetensors(tmp_path / "out" / "model.safetensors").items()}
    theirs = {k: v.shape for k, v in hf.read_safetensors(d / "model.safetensors").items()}
    assert ours == theirs


def test_sharded_checkpoint_and_bf16(tmp_path):
    """A sharded (index.json) bf16 checkpoint loads, and bf16 weights round-trip exactly."""
    src = FIXTURES / "plain"
    cfg, model = hf.load(src, param_dtype="bfloat16")
    out = tmp_path / "bf16"
    hf.save(cfg, model, out)
    tensors = hf.read_safetensors(out / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(out / "config.json", sharded / "config.json")
    for fname, keys in shards.items():
        hf.write_safetensors(sharded / fname, {k: tensors[k] for k in keys})
    weight_map = {k: f for f, ks in shards.items() for k in ks}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg2, model2 = hf.load(sharded)
    assert cfg2.param_dtype.value == "bfloat16"
    a = jax.tree.leaves(jax.tree.map(np.asarray, hf.nnx.state(model, hf.nnx.Param)))
    b = jax.tree.leaves(jax.tree.map(np.asarray, hf.nnx.state(model2, hf.nnx.Param)))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_rejects_unsupported(tmp_path):
    d = tmp_path / "bias"
    shutil.copytree(FIXTURES / "plain", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    with pytest.raises(hf.HFFormatError, match="attention_bias"):
        hf.load(d)
    with pytest.raises(hf.HFFormatError, match="config.json"):
        hf.load(tmp_path)


def test_save_loads_in_transformers(tmp_path):
    """Our save -> transformers' from_pretrained -> the same logits (only where torch exists;
    run by hand through `scripts/make_hf_fixtures.py --verify DIR` otherwise)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, model = hf.load(FIXTURES / "tied")
    hf.save(cfg, model, tmp_path)
    tokens = np.load(FIXTURES / "tied" / "tokens.npy")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = theirs(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), want, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------- tokenizer

TEXTS = ["def main(argv):\n    return 0\n", "héllo wörld ✓ 日本語", "  tabs\tand  spaces  ", "", "x" * 40]


def _tiny_model(vocab_size):
    from flax import nnx

    from scaling.config import ModelConfig
    from scaling.model import Transformer

    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
                      max_seq_len=64, param_dtype="float32", compute_dtype="float32")
    return cfg, Transformer(cfg, rngs=nnx.Rngs(params=0))


def test_byte_tokenizer_as_hf_matches_ours():
    """The HF file written for the byte tokenizer against our pure-Python UTF-8 tokenizer."""
    from scaling.data import ByteTokenizer

    ours, theirs = ByteTokenizer(), hf.byte_tokenizer_as_hf()
    rng = np.random.default_rng(0)
    texts = TEXTS + ["".join(chr(c) for c in rng.integers(0, 0x3000, size=50)) for _ in range(20)]
    for text in texts:
        assert theirs.encode(text).ids == ours.encode(text) == list(text.encode("utf-8"))
    for _ in range(50):  # any byte sequence, invalid UTF-8 and the EOS id included
        ids = [int(i) for i in rng.integers(0, 257, size=int(rng.integers(1, 30)))]
        assert theirs.decode(ids) == ours.decode(ids)


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_save_with_tokenizer_is_a_generate_ready_directory(tmp_path, kind):
    """save(..., tokenizer=run's tokenizer.json) -> the generate CLI's loader reads the model, the
    same token ids and the EOS stop token back."""
    from scaling.data import BPETokenizer, ByteTokenizer
    from scaling.generate_cli import load_any

    tok = BPETokenizer.train(TEXTS * 3 + ["the quick brown fox jumps over the lazy dog"] * 5, 300) if kind == "bpe" \
        else ByteTokenizer()
    tok_file = tmp_path / "tokenizer.json"
    tok.save(tok_file)
    cfg, model = _tiny_model(tok.vocab_size + 3)
    out = hf.save(cfg, model, tmp_path / "hf", tokenizer=tok_file)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.eos_id
    model2, tok2, stops = load_any(out)
    assert stops == [tok.eos_id]
    for text in TEXTS + ["the lazy fox"]:
        ids = tok.encode(text)
        assert tok2.encode(text) == ids
        assert tok2.decode(ids + [tok.eos_id]) == tok.decode(ids + [tok.eos_id])
    tokens = jnp.asarray([tok.encode("the quick brown fox")], jnp.int32)
    np.testing.assert_array_equal(np.asarray(model2(tokens)), np.asarray(model(tokens)))


def test_save_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path):
    from scaling.data import ByteTokenizer

    cfg, model = _tiny_model(200)
    with pytest.raises(ValueError, match="257 tokens.*vocab_size 200"):
        hf.save(cfg, model, tmp_path / "hf", tokenizer=ByteTokenizer())
    assert not (tmp_path / "hf").exists()  # refused before anything is written


def test_saved_tokenizer_loads_in_transformers(tmp_path):
    """AutoTokenizer on our saved directory: the same ids and EOS (only where transformers exists)."""
    transformers = pytest.importorskip("transformers")
    from scaling.data import BPETokenizer

    tok = BPETokenizer.train(TEXTS * 3, 280)
    cfg, model = _tiny_model(tok.vocab_size)
    out = hf.save(cfg, model, tmp_path, tokenizer=tok)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token_id == tok.eos_id and theirs.bos_token_id is None
    for text in TEXTS:
        assert theirs(text)["input_ids"] == tok.encode(text)


# ---------------------------------------------------------- real layouts, bad directories


def _variant(tmp_path, name, src="plain", config=None, tensors=None, config_text=None):
    """A copy of fixture `src` with config.json (a dict -> dict edit, or raw text) and the tensors
    (a dict -> dict edit) changed."""
    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((FIXTURES / src / "config.json").read_text())
    if config_text is None:
        config_text = json.dumps(config(cfg) if config else cfg)
    (d / "config.json").write_text(config_text)
    t = hf.read_safetensors(FIXTURES / src / "model.safetensors")
    hf.write_safetensors(d / "model.safetensors", tensors(t) if tensors else t)
    return d


def _transformers_4(cfg):
    """The fixture's transformers-5 config in 4.x's layout: rope_theta and rope_scaling at the top
    (null without scaling), torch_dtype for dtype, as Llama 2 / 3.x, TinyLlama and Mistral ship."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def _logits_match(d, src):
    _, model = hf.load(d)
    got = np.asarray(model(jnp.asarray(np.load(FIXTURES / src / "tokens.npy"))))
    np.testing.assert_allclose(got, np.load(FIXTURES / src / "logits.npy"), atol=1e-4, rtol=0)


def test_config_layouts_of_real_families(tmp_path):
    """transformers 4.x's layout (llama3 scaling under rope_scaling, with "rope_type" or the older
    "type"), Mistral without a sliding window, rotary inv_freq buffers and a tied checkpoint that
    keeps lm_head.weight: each against transformers' logits."""
    _logits_match(_variant(tmp_path, "v4_plain", config=_transformers_4), "plain")
    _logits_match(_variant(tmp_path, "v4_llama3", "tied", config=_transformers_4), "tied")

    def older_type_key(cfg):
        cfg = _transformers_4(cfg)
        cfg["rope_scaling"]["type"] = cfg["rope_scaling"].pop("rope_type")
        return cfg

    _logits_match(_variant(tmp_path, "v4_type", "tied", config=older_type_key), "tied")
    def mistral(cfg):
        return {**_transformers_4(cfg), "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                "sliding_window": None, "head_dim": None}

    _logits_match(_variant(tmp_path, "mistral", config=mistral), "plain")

    def inv_freq(t):
        return {**t, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32) for i in range(2)}}

    _logits_match(_variant(tmp_path, "inv_freq", tensors=inv_freq), "plain")

    def tied_head(t):
        return {**t, "lm_head.weight": t["model.embed_tokens.weight"]}

    _logits_match(_variant(tmp_path, "tied_head", "tied", tensors=tied_head), "tied")
    # (transformers 5 writes dtype, 4.x torch_dtype: a null dtype beside torch_dtype had read as float32)
    d = _variant(tmp_path, "dtype_null", config=lambda c: {**c, "dtype": None, "torch_dtype": "float16"})
    assert hf.load(d)[0].param_dtype.value == "float16"


@pytest.mark.parametrize("case,msg", [
    # a transposed projection has the right size: it had loaded silently (logits off by ~4)
    ("k_transposed", r"model.layers.0.self_attn.k_proj.weight is \(64, 32\), config.json gives \(32, 64\)"),
    ("gate_transposed", r"model.layers.1.mlp.gate_proj.weight is \(64, 128\), config.json gives \(128, 64\)"),
    ("q_short_layer1", r"model.layers.1.self_attn.q_proj.weight is \(32, 64\)"),  # (numpy's "cannot reshape")
    ("norm_shape", r"model.layers.1.input_layernorm.weight is \(65,\)"),  # (numpy's "same shape")
    ("no_norm", r"missing from the checkpoint: model.layers.1.input_layernorm.weight"),  # (a KeyError)
    ("no_head", r"missing from the checkpoint: lm_head.weight \(config.json's tie_word_embeddings is false\)"),
    ("extra_layer", r"would not read \(config.json: 2 layers, no biases\): model.layers.2."),  # (ignored)
    ("bias", r"would not read .*model.layers.0.self_attn.q_proj.bias"),  # (ignored)
    ("gqa_as_mha", r"k_proj.weight is \(32, 64\), config.json gives \(64, 64\)"),  # (numpy's "cannot reshape")
])
def test_tensors_that_do_not_match_the_config_are_named(tmp_path, case, msg):
    def edit(name, fn):
        return lambda t: {**t, name: fn(t[name])}

    tensors = {
        "k_transposed": edit("model.layers.0.self_attn.k_proj.weight", lambda w: w.T.copy()),
        "gate_transposed": edit("model.layers.1.mlp.gate_proj.weight", lambda w: w.T.copy()),
        "q_short_layer1": edit("model.layers.1.self_attn.q_proj.weight", lambda w: w[:32].copy()),
        "norm_shape": edit("model.layers.1.input_layernorm.weight", lambda w: np.ones(65, w.dtype)),
        "no_norm": lambda t: {k: v for k, v in t.items() if k != "model.layers.1.input_layernorm.weight"},
        "no_head": lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"},
        "extra_layer": lambda t: {**t, **{k.replace("layers.1.", "layers.2."): v for k, v in t.items() if ".1." in k}},
        "bias": lambda t: {**t, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)},
    }.get(case)
    config = (lambda c: {k: v for k, v in c.items() if k != "num_key_value_heads"}) if case == "gqa_as_mha" else None
    with pytest.raises(hf.HFFormatError, match=msg):
        hf.load(_variant(tmp_path, case, tensors=tensors, config=config))


def test_broken_files_are_named(tmp_path):
    d = _variant(tmp_path, "not_json", config_text="{not json")
    with pytest.raises(hf.HFFormatError, match=r"not_json/config.json is not valid JSON"):
        hf.load(d)
    with pytest.raises(hf.HFFormatError, match=r"holds a JSON list, not an object"):
        hf.load(_variant(tmp_path, "a_list", config_text="[1, 2]"))
    with pytest.raises(hf.HFFormatError, match=r"needs num_attention_heads \(a positive int; got None\)"):
        hf.load(_variant(tmp_path, "no_heads", config=lambda c: {k: c[k] for k in c if k != "num_attention_heads"}))

    def no_factor(cfg):
        return {**cfg, "rope_parameters": {k: v for k, v in cfg["rope_parameters"].items() if k != "factor"}}

    with pytest.raises(hf.HFFormatError, match="rope_type='llama3' without its factor"):
        hf.load(_variant(tmp_path, "no_factor", "tied", config=no_factor))
    # a sharded directory: its index not JSON, without a weight_map, naming a shard that is not there
    tensors = hf.read_safetensors(FIXTURES / "plain" / "model.safetensors")
    names = sorted(tensors)
    for case, index in (("index_text", "{oops"), ("no_map", json.dumps({"metadata": {}})),
                        ("no_shard", json.dumps({"weight_map": {**{n: "a.safetensors" for n in names[:3]},
                                                                **{n: "b.safetensors" for n in names[3:]}}}))):
        s = tmp_path / case
        s.mkdir()
        shutil.copy(FIXTURES / "plain" / "config.json", s / "config.json")
        hf.write_safetensors(s / "a.safetensors", {n: tensors[n] for n in names[:3]})
        (s / "model.safetensors.index.json").write_text(index)
        msg = {"index_text": "index.json is not valid JSON", "no_map": "index.json has no weight_map",
               "no_shard": "index.json names shard b.safetensors, which is not in"}[case]
        with pytest.raises(hf.HFFormatError, match=msg):
            hf.load(s)
