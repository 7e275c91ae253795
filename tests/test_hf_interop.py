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
