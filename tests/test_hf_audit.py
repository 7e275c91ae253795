"""HF interop and the generate CLI as a user meets them, each case against a reference outside the
code under test: text known by construction (a one-layer "successor" model whose greedy next
token depends on the last token alone, as in test_hf_mutants), the `tokenizers` library's own
decoders, and safetensors files written byte by byte from the format's spec."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from scaling import decode
from scaling.interop import hf
from test_hf_mutants import _successor_tensors

FIXTURES = Path(__file__).parent / "fixtures" / "hf_tiny"
# (successor a -> "✓" (three bytes) -> EOS; ids are byte values, EOS 256)
CHECK = {0x61: 0xE2, 0xE2: 0x9C, 0x9C: 0x93, 0x93: 256}


CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 257, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "torch_dtype": "float32", "eos_token_id": 256}


def _byte_fallback_tokenizer(path):
    """Llama 2's decoder chain (ByteFallback + Fuse) over a vocabulary of byte tokens "<0xNN>" at id
    NN, "a" as a word of its own at 0x61 and "<|eos|>" at 256: a character missing from the
    vocabulary is spelled in byte tokens, and a partial one decodes to one U+FFFD per byte."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256) if b != 0x61}
    tok = Tokenizer(models.BPE(vocab={**vocab, "a": 0x61, "<|eos|>": 256}, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    # (the library's own behaviour the test stands on)
    assert tok.encode("a✓").ids == [0x61, 0xE2, 0x9C, 0x93] and tok.decode([0x61, 0xE2, 0x9C]) == "a\ufffd\ufffd"
    tok.save(str(path))


def _hf_dir(tmp_path, successor=CHECK, name="succ"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    hf.write_safetensors(d / "model.safetensors", _successor_tensors(successor=successor))
    _byte_fallback_tokenizer(d / "tokenizer.json")
    return d


def test_cli_streams_a_character_a_byte_fallback_decoder_spells_in_bytes(tmp_path, capsys):
    """One token a chunk, "✓" as three byte tokens: after two of them the decoder gives two U+FFFD.
    The CLI held back one, printed the other, and the whole character never came (it printed
    "a\ufffd"). By construction the text is "a✓", then EOS."""
    from scaling.generate_cli import main

    d = _hf_dir(tmp_path)
    assert main(["--checkpoint", str(d), "--prompt", "a", "--chunk", "1", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert out.out == "a✓\n" and "[4 tokens" in out.err


def test_ctrl_c_while_streaming_ends_the_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the first chunk: `python -m scaling generate` exits 130 saying "interrupted";
    the streamed text ends with its own newline (the message had run on after it, on one line)."""
    from scaling import __main__ as cli

    d = _hf_dir(tmp_path, {0x61: 0x62, 0x62: 0x63})  # "a" -> "b" -> "c"

    def stream(self, prompts, max_new_tokens, **kw):
        yield [(0, [0x62], [0.0])]
        raise KeyboardInterrupt

    monkeypatch.setattr(decode.Decoder, "stream", stream)
    monkeypatch.setattr(sys, "argv", ["scaling", "generate", "--checkpoint", str(d), "--prompt", "a"])
    assert cli._run() == 130
    out = capsys.readouterr()
    assert out.out == "ab\n" and out.err.endswith("interrupted\n")


@pytest.mark.parametrize("flag,value,msg", [
    ("--max-new-tokens", "0", "--max-new-tokens: max_new_tokens=0 must be an int >= 1"),
    ("--max-new-tokens", "-3", "--max-new-tokens: max_new_tokens=-3 must be an int >= 1"),
    ("--temperature", "nan", "--temperature: temperature=nan must be a finite number >= 0 (0 is greedy)"),
    ("--temperature", "-1", "--temperature: temperature=-1.0 must be a finite number >= 0 (0 is greedy)"),
    ("--top-k", "0", r"--top-k: top_k=0 must be an int in [1, vocab_size]"),
    ("--top-p", "0", "--top-p: top_p=0.0 must be in (0, 1]"),
    ("--top-p", "1.5", "--top-p: top_p=1.5 must be in (0, 1]"),
    ("--seed", "-1", "--seed: seed=-1 must be an int in [0, 2**32)"),
    ("--max-len", "0", "--max-len: max_len=0 must be an int >= 1"),
    ("--chunk", "0", "--chunk: chunk=0 must be an int >= 1"),
    ("--layers", "fast", "--layers: layers='fast': allowed ['xla', 'pallas', 'pallas_tma', 'auto', 'megakernel']"),
    ("--sampler", "sort", "--sampler: sampler must be one of ('auto', 'xla', 'pallas'), got 'sort'"),
    ("--prefill-tokens", "0", "--prefill-tokens: prefill_tokens must be an int >= 1, got 0"),
])
def test_cli_flags_are_checked_before_the_model_loads(monkeypatch, capsys, flag, value, msg):
    """Each refused value is named by its flag with what it may be, before the checkpoint is read
    (they had been found after the model loaded: minutes for a large one)."""
    from scaling import generate_cli

    def no_load(*a, **k):
        raise AssertionError("loaded the model before checking the flags")

    monkeypatch.setattr(generate_cli, "load_any", no_load)
    assert generate_cli.main(["--checkpoint", "/nonexistent", "--prompt", "a", flag, value]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == f"error: {msg}\n"


def test_cli_names_an_unreadable_tokenizer_before_the_weights(tmp_path, capsys, monkeypatch):
    """tokenizer.json that `tokenizers` cannot parse: an error naming the file (it had been the
    library's bare Exception as a traceback, after the weights were read)."""
    from scaling.generate_cli import main

    d = _hf_dir(tmp_path)
    (d / "tokenizer.json").write_text("{oops")

    def no_load(*a, **k):
        raise AssertionError("read the weights before the tokenizer")

    monkeypatch.setattr(hf, "load", no_load)
    assert main(["--checkpoint", str(d), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {d / 'tokenizer.json'}: cannot read it as a tokenizers file (")


def _raw_safetensors(path, tensors: dict[str, tuple[str, list[int], bytes]]):
    """A safetensors file from the format's spec: u64 header size, JSON header, the data."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_fp8_and_quantized_checkpoints_are_named(tmp_path):
    """An FP8 tensor (F8_E4M3, as FP8 checkpoints ship) had raised numpy's AttributeError from the
    safetensors library; a config.json with quantization_config is refused before any tensor is read."""
    f = tmp_path / "model.safetensors"
    _raw_safetensors(f, {"w": ("F8_E4M3", [2, 2], bytes(4))})
    with pytest.raises(hf.HFFormatError) as e:
        hf.read_safetensors(f)
    assert str(e.value).startswith(f"{f}: holds tensors of a dtype numpy cannot read (")
    assert "allowed: F16, BF16, F32" in str(e.value)
    _raw_safetensors(f, {"w": ("F16", [2], bytes(4))})  # (the same writer, a dtype that reads)
    assert hf.read_safetensors(f)["w"].tolist() == [0.0, 0.0]
    fp8 = {**CONFIG, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    with pytest.raises(hf.HFFormatError, match=r"quantization_config \(quant_method='fp8'\): quantized checkpoints "
                                               r"are not supported; allowed: none"):
        hf.config_from_hf(fp8)


@pytest.mark.parametrize("edit,msg", [
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
     "model_type='qwen2' is not a Llama-family model; allowed: 'llama', 'mistral'"),
    ({"attention_bias": True}, "attention_bias=true is not supported .*; allowed: false"),
])
def test_refused_configs_name_what_is_allowed(edit, msg):
    with pytest.raises(hf.HFFormatError, match=msg):
        hf.config_from_hf({**CONFIG, **edit})


def test_decoder_int_options_take_numpy_ints_and_refuse_bools():
    """prefill_tokens and megakernel_short_reach: True had been taken as 1 and numpy's ints refused,
    unlike every other int option. Refused before the Decoder touches the model's weights (a
    stand-in without any refuses as a real one would)."""
    import types

    import jax.numpy as jnp

    from scaling.config import ModelConfig

    decode.check_decoder_options(prefill_tokens=np.int64(64), megakernel_short_reach=np.int32(3))
    model = types.SimpleNamespace(cfg=ModelConfig(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2,
                                                  num_kv_heads=1, mlp_dim=16), compute_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"prefill_tokens must be an int >= 1, got True"):
        decode.Decoder(model, prefill_tokens=True)
    with pytest.raises(ValueError, match=r"megakernel_short_reach must be an int >= 0 \(0: off\), got True"):
        decode.Decoder(model, megakernel_short_reach=True)
    with pytest.raises(ValueError, match=r"top_k=17 must be an int in \[1, vocab_size=16\]"):
        decode.check_sampling(1, top_k=17, vocab_size=16)

def _tied_variant(tmp_path, name, edit, config=None):
    """The tied fixture (transformers' save: the embedding alone) with its tensors edited."""
    d = tmp_path / name
    shutil.copytree(FIXTURES / "tied", d)
    t = edit(hf.read_safetensors(d / "model.safetensors"))
    hf.write_safetensors(d / "model.safetensors", t)
    if config:
        (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **config}))
    return d


def _params(d):
    return hf.nnx.to_pure_dict(hf.nnx.state(hf.load(d)[1], hf.nnx.Param))


def test_tied_checkpoints_load_as_transformers_5_loads_them(tmp_path):
    """As transformers 5.24 reads a tied config.json's checkpoint (checked there by hand): the
    matrix under lm_head.weight alone is the embedding too (it had been refused as missing its
    embedding); a head that is not the embedding leaves the two untied, so it is refused until
    config.json says untied (it had loaded tied, silently another model), and then the head is
    read. Against the unedited fixture's load, whose logits are transformers' (test_hf_interop)."""
    import jax

    want = _params(FIXTURES / "tied")
    embed = "model.embed_tokens.weight"
    head_only = _tied_variant(tmp_path, "head_only", lambda t: {("lm_head.weight" if k == embed else k): v
                                                                  for k, v in t.items()})
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, _params(head_only), want)))

    def negated_head(t):
        return {**t, "lm_head.weight": -t[embed]}

    with pytest.raises(hf.HFFormatError, match=r"tie_word_embeddings=true, but lm_head.weight is not "
                                               r"model.embed_tokens.weight .*allowed: tie_word_embeddings=false"):
        hf.load(_tied_variant(tmp_path, "differ", negated_head))
    untied = _params(_tied_variant(tmp_path, "untied", negated_head, config={"tie_word_embeddings": False}))
    np.testing.assert_array_equal(untied.pop("head_dv"), -want["embed"]["table_vd"].T)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, untied, want)))


@pytest.mark.parametrize("kw,msg", [
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
    (dict(prompts=[[16]], max_new_tokens=2), r"prompt 0 has token id 16 outside the vocabulary \[0, 16\)"),
    (dict(prompts=[[1]], max_new_tokens=2, top_p=2.0), r"top_p=2.0 must be in \(0, 1\]"),
    (dict(prompts=[[1]], max_new_tokens=2, stop_tokens=3), r"stop_tokens must be a list of token ids, got 3"),
])
def test_generate_checks_its_call_before_laying_out_the_weights(monkeypatch, kw, msg):
    """decode.generate built its Decoder (the weights re-laid-out, op by op compiled) before the
    call's arguments were looked at; Decoder.generate's own checks came only then."""
    import types

    import jax.numpy as jnp

    from scaling.config import ModelConfig

    def no_layout(*a, **k):
        raise AssertionError("laid the weights out before checking the call")

    monkeypatch.setattr(decode, "prepare_weights", no_layout)
    model = types.SimpleNamespace(cfg=ModelConfig(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2,
                                                  num_kv_heads=1, mlp_dim=16), compute_dtype=jnp.float32)
    with pytest.raises(ValueError, match=msg):
        decode.generate(model, **kw)


@pytest.mark.parametrize("text", ["{oops", "[1, 2]", '{"model": {}}'])
def test_cli_names_a_run_directorys_unreadable_tokenizer(tmp_path, capsys, monkeypatch, text):
    """A run directory's tokenizer.json that is not JSON (json's message had named no file), a JSON
    list (an AttributeError traceback) or JSON that `tokenizers` refuses (its bare Exception as a
    traceback): an error naming the file, before the checkpoint is read."""
    from scaling import checkpoint
    from scaling.config import dump_yaml, load_config
    from scaling.generate_cli import main

    (tmp_path / "config.yaml").write_text(dump_yaml(load_config(None, [])))
    (tmp_path / "tokenizer.json").write_text(text)

    def no_read(*a, **k):
        raise AssertionError("read the checkpoint before the tokenizer")

    monkeypatch.setattr(checkpoint, "load_params", no_read)
    assert main(["--checkpoint", str(tmp_path), "--prompt", "a"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'tokenizer.json'}: cannot read it as a tokenizer (")


def test_save_given_a_whole_config_names_the_argument(tmp_path):
    """`save(cfg, model, path)` with the whole Config (the README had shown it so) failed with
    "'Config' object has no attribute 'vocab_size'" from deep inside; it now says to pass .model,
    before anything is written."""
    from scaling.config import load_config

    cfg = load_config(None, ["--model.num_layers=1", "--model.hidden_size=32", "--model.num_heads=2",
                             "--model.num_kv_heads=1", "--model.mlp_dim=64", "--model.vocab_size=300"])
    with pytest.raises(TypeError, match=r"model_config: got a whole Config; pass its \.model"):
        hf.save_params(cfg, {}, tmp_path / "out")
    with pytest.raises(TypeError, match="model_config: takes a ModelConfig, got dict"):
        hf.save_params({"vocab_size": 300}, {}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_save_cut_short_leaves_no_config_json(tmp_path, monkeypatch):
    """config.json had been written before the weights: a save that failed in the weights (a full
    disk) left a directory that loaders took as whole, beside the previous save's weights (another
    model's) or none. Now config.json is removed first and written last."""
    from scaling.config import load_config
    from scaling.model import build_model

    cfg = load_config(None, ["--model.num_layers=1", "--model.hidden_size=32", "--model.num_heads=2",
                             "--model.num_kv_heads=1", "--model.mlp_dim=64", "--model.vocab_size=300"]).model
    model = build_model(cfg, seed=0)
    out = tmp_path / "hf"
    hf.save(cfg, model, out)
    first = json.loads((out / "config.json").read_text())
    assert first["num_hidden_layers"] == 1

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "write_safetensors", full_disk)
    with pytest.raises(OSError, match="No space left"):
        hf.save(cfg, model, out)
    assert not (out / "config.json").exists()
    with pytest.raises(hf.HFFormatError):
        hf.load(out)
    monkeypatch.undo()
    hf.save(cfg, model, out)  # a save that completes writes it again
    assert json.loads((out / "config.json").read_text()) == first
