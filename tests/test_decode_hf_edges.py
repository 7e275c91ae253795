"""Decode's and HF interop's user-facing edges, each against a reference from outside the
code under test: transformers' golden logits and its own config.json (tests/fixtures/hf_tiny),
and greedy tokens recomputed by the model's uncached forward pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import decode
from scaling.config import DType, ModelConfig
from scaling.interop import hf
from scaling.model import build_model

FIXTURES = Path(__file__).parent / "fixtures" / "hf_tiny"


def _golden_logits_match(d: Path, model) -> None:
    """The model's logits against transformers' for the plain fixture."""
    tokens = jnp.asarray(np.load(FIXTURES / "plain" / "tokens.npy"))
    np.testing.assert_allclose(np.asarray(model(tokens)), np.load(FIXTURES / "plain" / "logits.npy"), atol=1e-4, rtol=0)


def _stale_shards(d: Path) -> None:
    """A sharded checkpoint of other weights (the fixture's, negated) with its index, in d."""
    tensors = {k: -v for k, v in hf.read_safetensors(FIXTURES / "plain" / "model.safetensors").items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:9], "model-00002-of-00002.safetensors": names[9:]}
    for fname, keys in shards.items():
        hf.write_safetensors(d / fname, {k: tensors[k] for k in keys})
    weight_map = {k: f for f, ks in shards.items() for k in ks}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ------------------------------------------------------------------------------- HF files


def test_model_safetensors_is_read_before_an_index_beside_it(tmp_path):
    """transformers' from_pretrained takes model.safetensors where it is there, whatever index lies
    beside it; we had taken the index's shards, a model other than the one transformers loads."""
    d = tmp_path / "both"
    shutil.copytree(FIXTURES / "plain", d)
    _stale_shards(d)
    _, model = hf.load(d)
    _golden_logits_match(d, model)
    (d / "model.safetensors").unlink()  # (the index alone is still read: the negated weights)
    _, shards_only = hf.load(d)
    assert not np.allclose(np.asarray(shards_only(jnp.asarray(np.load(d / "tokens.npy")))), np.load(d / "logits.npy"))


def test_save_over_a_sharded_checkpoint_leaves_no_stale_shards(tmp_path):
    """save() into a directory holding an earlier sharded save: the index and its shards go (tools
    that follow an index, as vLLM does, would load them instead), other files stay."""
    d = tmp_path / "out"
    d.mkdir()
    _stale_shards(d)
    (d / "notes.txt").write_text("mine")
    (d / "adapter.safetensors").write_bytes((FIXTURES / "plain" / "model.safetensors").read_bytes())
    cfg, model = hf.load(FIXTURES / "plain")
    hf.save(cfg, model, d)
    assert sorted(p.name for p in d.iterdir()) == ["adapter.safetensors", "config.json", "model.safetensors",
                                                    "notes.txt"]
    _golden_logits_match(d, hf.load(d)[1])


def test_saved_config_leaves_transformers_no_token_id_defaults(tmp_path):
    """transformers' LlamaConfig fills a config.json without bos/eos ids with 1 and 2 (its own save
    of the fixtures, made without them, holds those), so its generate stopped our saved models at
    token 2. Every key of transformers' config.json is in ours (the rope keys in 4.x's spelling),
    the token ids as null, and with a tokenizer eos is its EOS and bos still null."""
    from scaling.data import ByteTokenizer
    from scaling.generate_cli import _hf_stop_ids

    theirs = json.loads((FIXTURES / "plain" / "config.json").read_text())
    assert (theirs["bos_token_id"], theirs["eos_token_id"]) == (1, 2)  # (the defaults that would apply)
    cfg, model = hf.load(FIXTURES / "plain")
    hf.save(cfg, model, tmp_path / "plain")
    ours = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert set(theirs) - set(ours) <= {"transformers_version", "rope_parameters", "pad_token_id"}
    assert theirs["pad_token_id"] is None  # (pad: null is LlamaConfig's default, so absent is the same)
    assert (ours["bos_token_id"], ours["eos_token_id"]) == (None, None)
    assert _hf_stop_ids(tmp_path / "plain") == []  # (our CLI: no stop either)
    vocab = ByteTokenizer().vocab_size
    cfg257 = ModelConfig(vocab_size=vocab, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=24,
                         compute_dtype=DType.float32)
    hf.save(cfg257, build_model(cfg257, seed=0), tmp_path / "tok", tokenizer=ByteTokenizer())
    ours = json.loads((tmp_path / "tok" / "config.json").read_text())
    assert (ours["bos_token_id"], ours["eos_token_id"]) == (None, ByteTokenizer.eos_id)


def test_save_refuses_a_config_that_is_not_the_models(tmp_path):
    """save(cfg, model) writes cfg as config.json beside the model's weights. A cfg of 8 heads of 4
    for a model of 4 heads of 8 (the same q/o sizes) had saved, and loaded as a model computing
    other logits; a tied cfg for an untied model had dropped its head. Both are refused, nothing
    written; the model's own cfg still saves, and loads back to transformers' logits."""
    import dataclasses

    cfg, model = hf.load(FIXTURES / "plain")  # 4 heads of 16, 2 KV heads, untied
    for bad in (dataclasses.replace(cfg, num_heads=8, num_kv_heads=4, head_dim=8),
                dataclasses.replace(cfg, tie_embeddings=True)):
        with pytest.raises(ValueError, match="the parameters are not those of model_config"):
            hf.save(bad, model, tmp_path / "bad")
        assert not (tmp_path / "bad").exists()
    hf.save(cfg, model, tmp_path / "good")
    _golden_logits_match(tmp_path / "good", hf.load(tmp_path / "good")[1])


# ------------------------------------------------------------------------------ decode API

CFG = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
                  init_std=0.3, compute_dtype=DType.float32)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=1)


def _uncached_argmax(model, prompt, new):
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(jnp.argmax(model(jnp.asarray([seq], jnp.int32))[0, -1])))
    return seq[len(prompt):]


def test_stop_tokens_none_is_no_stop_tokens(model):
    """None, as transformers' eos_token_id=None, means none (it had been refused as 'NoneType')."""
    dec = decode.Decoder(model, max_len=32, attention="xla", chunk=4)
    prompts = [[1, 2, 3], [40]]
    want = [_uncached_argmax(model, p, 5) for p in prompts]
    assert dec.generate(prompts, 5, stop_tokens=None).tokens == want
    assert decode.generate(model, prompts, 5, stop_tokens=None, max_len=32) == want


def test_decoder_arguments_are_checked_at_construction(model, monkeypatch):
    """An integer cache had truncated K/V (refused only by the attention's check at the first decode
    step, after the prefill compiled); a float or zero max_batch had been taken as a bound; a float
    min_batch raised a bare TypeError from `&`. Each now names its argument, before anything runs."""
    def no_compile(*a, **k):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(decode, "_prefill_rows", no_compile)
    monkeypatch.setattr(decode, "prepare_weights", no_compile)
    for bad in (jnp.int8, "int32", "bool", "fp9"):
        with pytest.raises(ValueError, match=r"cache_dtype=.* must be a floating dtype"):
            decode.Decoder(model, cache_dtype=bad)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"max_batch=.* must be an int >= 1, or None"):
            decode.Decoder(model, max_batch=bad)
    for bad in (2.0, 3, 0):
        with pytest.raises(ValueError, match=r"min_batch=.* must be a power of two >= 1"):
            decode.Decoder(model, min_batch=bad)


def test_bfloat16_cache_by_name_on_an_f32_model(model):
    """cache_dtype by its name: the cache is bf16 and the greedy tokens stay the uncached model's
    (its logits are far from ties at this size)."""
    dec = decode.Decoder(model, max_len=32, attention="xla", chunk=4, cache_dtype="bfloat16", max_batch=np.int64(2))
    assert dec.cache_dtype == jnp.bfloat16
    assert dec.generate([[5, 6, 7]], 4).tokens == [_uncached_argmax(model, [5, 6, 7], 4)]


# -------------------------------------------------------------------------------- the CLI


def test_cli_names_a_prompt_that_encodes_to_no_tokens(tmp_path, capsys):
    """An empty --prompt with a tokenizer that adds no BOS: the error names the option and its text
    (it had said "prompt 0 is empty", counting from 0, of a list the user never wrote)."""
    from scaling.generate_cli import main

    d = tmp_path / "hf"
    shutil.copytree(FIXTURES / "plain", d)
    hf.byte_tokenizer_as_hf().save(str(d / "tokenizer.json"))
    for prompts in ([""], ["ab", ""]):
        assert main(["--checkpoint", str(d), "--max-new-tokens", "2"] + [a for p in prompts for a in ("--prompt", p)]) == 2
        out = capsys.readouterr()
        assert out.out == "" and "error: --prompt '' encodes to no tokens" in out.err


def test_weights_file_gets_the_mode_of_the_files_beside_it(tmp_path):
    """safetensors creates its file 0600; an export's config.json is 0666 less the umask. The
    weights get the same mode (a shared model directory had unreadable weights)."""
    import os

    from scaling.interop.hf import write_safetensors

    write_safetensors(tmp_path / "model.safetensors", {"a": np.ones(3, np.float32)})
    (tmp_path / "config.json").write_text("{}")
    mode = lambda name: os.stat(tmp_path / name).st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")
