"""KV-cached decoding against recomputing the whole sequence, ragged batches, sampling, errors,
and the flash-decoding kernel (Pallas interpret mode on the CPU) against its reference.

One tiny f32 model and one Decoder (one (batch, cache length) bucket) serve most tests, so
the prefill and the decode chunk compile once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import decode
from scaling.config import DType, ModelConfig
from scaling import layers
from scaling.kernels.decode_attention import (
    DecodeBlockSizes,
    decode_attention,
    decode_attention_fused,
    decode_attention_grouped,
    decode_attention_reference,
)
from scaling.model import build_model

CFG = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
                  init_std=0.3, compute_dtype=DType.float32)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40]]
NEW = 10
MAX_LEN = 64


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=1)


@pytest.fixture(scope="module")
def decoder(model):
    return decode.Decoder(model, max_batch=4, max_len=MAX_LEN, attention="xla", chunk=4)


@pytest.fixture(scope="module")
def greedy(decoder):
    return decoder.generate(PROMPTS, NEW)


def test_cached_decode_equals_full_recompute(model, greedy):
    """The model over prompt + new tokens, no cache (right-padded into one batch: causal
    attention keeps the padding out of every real position)."""
    seqs = [p + t for p, t in zip(PROMPTS, greedy.tokens)]
    width = max(map(len, seqs))
    batch = jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)
    logp = np.asarray(jax.nn.log_softmax(model(batch).astype(jnp.float32), axis=-1))  # [B, T, V]
    for i, (prompt, toks, lps) in enumerate(zip(PROMPTS, greedy.tokens, greedy.logprobs)):
        assert len(toks) == NEW
        rows = np.arange(len(prompt) - 1, len(prompt) + NEW - 1)
        np.testing.assert_array_equal(np.argmax(logp[i, rows], -1), toks)  # greedy = argmax of the uncached model
        np.testing.assert_allclose(lps, logp[i, rows, toks], atol=2e-5, rtol=0)


def test_ragged_batch_equals_each_prompt_alone(decoder, greedy):
    for prompt, toks, lps in zip(PROMPTS, greedy.tokens, greedy.logprobs):
        alone = decoder.generate([prompt], NEW)  # batch bucket 1: a second compile of the same code
        assert alone.tokens[0] == toks
        np.testing.assert_allclose(alone.logprobs[0], lps, atol=2e-5, rtol=0)


def test_padding_rows_change_nothing(model, greedy):
    """min_batch pads rows (the GPU default pads batch 1 to 8); the real rows' tokens and
    log-probs must be those of the unpadded decoder, sampled ones included."""
    padded = decode.Decoder(model, max_len=MAX_LEN, attention="xla", chunk=4, min_batch=8)
    out = padded.generate(PROMPTS, NEW)
    assert out.tokens == greedy.tokens
    np.testing.assert_allclose(np.concatenate(out.logprobs), np.concatenate(greedy.logprobs), atol=2e-5, rtol=0)
    plain = decode.Decoder(model, max_len=MAX_LEN, attention="xla", chunk=4, min_batch=1)
    kw = dict(temperature=1.0, top_k=20, seed=5)
    assert padded.generate(PROMPTS, NEW, **kw).tokens == plain.generate(PROMPTS, NEW, **kw).tokens
    with pytest.raises(ValueError, match="min_batch"):
        decode.Decoder(model, min_batch=3)


def test_prefill_in_row_groups_equals_one_call(model, greedy):
    """A token budget of 16 prefills the 16-token bucket one row a call (4 calls for 3 prompts
    padded to 4 rows); tokens and log-probs are those of one call, sampled ones included."""
    assert [decode.prefill_rows_per_call(b, t, n) for b, t, n in
            [(4, 16, 16), (4, 16, 40), (64, 2048, 16384), (64, 2048, 10**9), (8, 4096, 1000), (1, 16, 1)]] \
        == [1, 2, 8, 64, 1, 1]
    calls = []
    rows_of = decode._prefill_rows
    grouped = decode.Decoder(model, max_batch=4, max_len=MAX_LEN, attention="xla", chunk=4, prefill_tokens=16)
    try:
        decode._prefill_rows = lambda w, c, tok, *a, **k: calls.append(tok.shape) or rows_of(w, c, tok, *a, **k)
        out = grouped.generate(PROMPTS, NEW)
    finally:
        decode._prefill_rows = rows_of
    assert calls == [(1, 16)] * 4
    assert out.tokens == greedy.tokens
    np.testing.assert_allclose(np.concatenate(out.logprobs), np.concatenate(greedy.logprobs), atol=2e-5, rtol=0)
    kw = dict(temperature=1.0, top_k=20, seed=5)
    one = decode.Decoder(model, max_batch=4, max_len=MAX_LEN, attention="xla", chunk=4)
    assert grouped.generate(PROMPTS, NEW, **kw).tokens == one.generate(PROMPTS, NEW, **kw).tokens
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="prefill_tokens must be an int >= 1"):
            decode.Decoder(model, prefill_tokens=bad)


def test_stop_tokens_per_row_and_cache_limit(decoder, greedy):
    # Stop row 0 at its third token; other rows go on unless they produce it too.
    stop = greedy.tokens[0][2]
    out = decoder.generate(PROMPTS, NEW, stop_tokens=[stop])
    for ref, got in zip(greedy.tokens, out.tokens):
        cut = ref.index(stop) + 1 if stop in ref else NEW
        assert got == ref[:cut]
    assert out.tokens[0][-1] == stop
    # A cache of 16 positions: a prompt of 11 tokens can add at most 16 - 11 + 1 = 6.
    short = decoder.generate(PROMPTS[1:2], NEW, max_len=16)
    assert short.tokens[0] == greedy.tokens[1][:6]


def test_sampling_is_seeded_and_reproducible(decoder, greedy):
    kw = dict(temperature=1.0, top_k=20, top_p=0.9)
    a = decoder.generate(PROMPTS, NEW, seed=3, **kw)
    b = decoder.generate(PROMPTS, NEW, seed=3, **kw)
    c = decoder.generate(PROMPTS, NEW, seed=4, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert decoder.generate(PROMPTS, NEW, temperature=1.0, top_k=1).tokens == greedy.tokens  # top-1 is greedy


def test_sample_top_k_top_p_support():
    """Sampled tokens stay inside the top-k set and the top-p nucleus."""
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.1, 0.06, 0.04]] * 256))
    keys = jax.random.split(jax.random.key(0), 256)
    sampling = decode.Sampling(greedy=False, top_k=2)
    toks, _ = decode.sample(logits, keys, jnp.float32(1.0), jnp.float32(1.0), sampling)
    assert set(np.asarray(toks).tolist()) == {0, 1}
    sampling = decode.Sampling(greedy=False, use_top_p=True)
    toks, _ = decode.sample(logits, keys, jnp.float32(1.0), jnp.float32(0.85), sampling)
    assert set(np.asarray(toks).tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.85 <= 0.9


def test_greedy_sample_log_prob_against_float64():
    """Greedy's log-prob (from the row's max and sum, no [B, V] log-softmax) against float64, with
    logits far from 0 (the max shift keeps exp finite)."""
    logits = jax.random.normal(jax.random.key(1), (3, 1000)) * 4 + jnp.asarray([[0.0], [900.0], [-900.0]])
    toks, lps = decode.sample(logits, None, jnp.float32(1.0), jnp.float32(1.0), decode.Sampling())
    ref = np.asarray(logits, np.float64)
    ref = ref - ref.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(toks), ref.argmax(-1))
    np.testing.assert_allclose(np.asarray(lps), ref[np.arange(3), ref.argmax(-1)], atol=1e-5, rtol=0)


def test_generate_api_and_errors(model, decoder, monkeypatch):
    toks, lps = decode.generate(model, PROMPTS[:1], 3, return_logprobs=True, max_len=MAX_LEN)
    assert len(toks[0]) == 3 and len(lps[0]) == 3

    def no_compile(*a, **k):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(decode, "_prefill_rows", no_compile)
    monkeypatch.setattr(decode, "_decode_chunk", no_compile)
    cases = [
        ([[]], "empty"),
        ([[1, 2], [1, 97]], "outside the vocabulary"),
        ([[-1]], "outside the vocabulary"),
        ([list(range(1, 70))], "longer than the cache"),
        ([[1]] * 5, "max_batch=4"),
        ([], "non-empty"),
    ]
    for prompts, msg in cases:
        with pytest.raises(ValueError, match=msg):
            decoder.generate(prompts, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([[1]], 0)
    with pytest.raises(ValueError, match="top_p"):
        decoder.generate([[1]], 2, temperature=1.0, top_p=0.0)
    # (JAX would keep a seed's low 32 bits: 2**32 would silently draw seed 0's tokens)
    for seed in (-1, 2**32, 1.5, True):
        with pytest.raises(ValueError, match=r"seed=.* must be an int in \[0, 2\*\*32\)"):
            decoder.generate([[1]], 2, temperature=1.0, seed=seed)
    with pytest.raises(ValueError, match="longer than the cache"):
        decode.generate(model, [list(range(1, 20))], 2, max_len=8)
    # stream validates at the call, before the caller has its generator (the CLI prints the prompt then)
    with pytest.raises(ValueError, match="top_p"):
        decoder.stream([[1]], 2, temperature=1.0, top_p=1.5)


# ------------------------------------------------------------------------------ kernel


def test_decode_kernel_interpret_matches_reference():
    """GQA (2 query heads per KV head), f32; bf16 and the real shapes are checked on the GPU
    by experiments/bench_decode.py --check."""
    b, n, kh, h, s, dtype, tol = 3, 4, 2, 16, 64, jnp.float32, 1e-5
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, n, h), dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), dtype)
    lengths = jnp.asarray([1, 23, 64], jnp.int32)  # one position, a partial tile, the whole cache
    blocks = DecodeBlockSizes(block_s=16, min_programs=12)  # 2 splits of 2 tiles: exercises the combine
    out = decode_attention(q, k, v, lengths, blocks=blocks, interpret=True).astype(jnp.float32)
    ref = decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), lengths)
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert err < tol
    # NaN in tiles past a row's length must not matter: the kernel never reads them.
    k2 = k.at[0, 16:].set(jnp.nan)
    v2 = v.at[0, 16:].set(jnp.nan)
    out2 = decode_attention(q, k2, v2, lengths, blocks=blocks, interpret=True).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(out2[0]), np.asarray(out[0]))
    # q in the kernel's own tile layout [B, K, 16, H]: rows past the group are never used (NaN here).
    g = n // kh
    q_grouped = jnp.full((b, kh, 16, h), jnp.nan, dtype).at[:, :, :g].set(q.reshape(b, kh, g, h))
    out3 = decode_attention_grouped(q_grouped, k, v, lengths, num_heads=n, blocks=blocks, interpret=True)
    np.testing.assert_array_equal(np.asarray(out3, np.float32), np.asarray(out))
    with pytest.raises(ValueError, match=r"must be \[B, K, 16, H\]"):
        decode_attention_grouped(q.reshape(b, kh, g, h), k, v, lengths, num_heads=n)


@pytest.mark.parametrize("s,block_s,min_programs", [(64, 16, 12), (48, 16, 12), (64, 16, 1)])
def test_grouped_kernel_combines_in_kernel(s, block_s, min_programs):
    """tickets: the last program of each (row, KV head) merges the splits (2 and 3 splits, and a
    single one); equal to the XLA combine's result and the f32 reference, and again on a second
    call that starts from the first call's counters."""
    b, n, kh, h = 3, 8, 2, 16
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (b, n, h), jnp.float32)
    k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32)
    v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32)
    lengths = jnp.asarray([1, 23, s], jnp.int32)
    blocks = DecodeBlockSizes(block_s=block_s, min_programs=min_programs)
    g = n // kh
    q_grouped = jnp.zeros((b, kh, 16, h), jnp.float32).at[:, :, :g].set(q.reshape(b, kh, g, h))
    plain = decode_attention_grouped(q_grouped, k, v, lengths, num_heads=n, blocks=blocks, interpret=True)
    ref = decode_attention_reference(q, k, v, lengths)
    tickets = jnp.zeros((b, kh, 1), jnp.int32)
    for call in range(2):
        out, tickets = decode_attention_grouped(q_grouped, k, v, lengths, num_heads=n, blocks=blocks, interpret=True,
                                                tickets=tickets)
        np.testing.assert_allclose(np.asarray(out), np.asarray(plain), rtol=1e-6, atol=1e-6)
        assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-5
    splits = {(64, 12): 2, (48, 12): 3, (64, 1): 1}[(s, min_programs)]
    np.testing.assert_array_equal(np.asarray(tickets), 2 * splits)  # each call adds its splits to every counter
    with pytest.raises(ValueError, match="not a power of two"):
        decode_attention_grouped(jnp.zeros((1, 2, 16, h)), k[:1], v[:1], lengths[:1], num_heads=6, tickets=tickets[:1])
    with pytest.raises(ValueError, match="tickets"):
        decode_attention_grouped(q_grouped, k, v, lengths, num_heads=n, tickets=jnp.zeros((b, kh), jnp.int32))


@pytest.mark.parametrize("n,kh,h,dtype,tol", [(8, 2, 32, jnp.float32, 1e-5), (4, 4, 16, jnp.float32, 1e-5),
                                                (8, 1, 64, jnp.float32, 1e-5), (8, 2, 32, jnp.bfloat16, 2e-2)])
def test_fused_decode_kernel_matches_rope_scatter_and_reference(n, kh, h, dtype, tol):
    """The fused kernel (RoPE + cache write + attention) against the unfused math in plain
    jnp: layers.apply_rope, a scatter into the cache, and the reference attention."""
    b, s = 3, 128
    ks = jax.random.split(jax.random.key(n * h + kh), 4)
    qkv = jax.random.normal(ks[0], (b, n + 2 * kh, h), dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), dtype)
    pos = jnp.asarray([0, 37, s - 1], jnp.int32)  # first slot, mid-tile, last slot
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    rows = jnp.arange(b)
    q_r = layers.apply_rope(qkv[:, None, :n], pos[:, None], inv_freq)[:, 0]
    k_new = layers.apply_rope(qkv[:, None, n : n + kh], pos[:, None], inv_freq)[:, 0]
    k_r = k.at[rows, pos].set(k_new)
    v_r = v.at[rows, pos].set(qkv[:, n + kh :])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    out_r = decode_attention_reference(f32(q_r), f32(k_r), f32(v_r), pos + 1)
    angles = pos[:, None].astype(jnp.float32) * inv_freq
    blocks = DecodeBlockSizes(block_s=16, min_programs=24)  # several splits and tiles per row
    out, k2, v2 = decode_attention_fused(qkv, pos, jnp.cos(angles), jnp.sin(angles), k, v, num_heads=n,
                                         blocks=blocks, interpret=True)
    np.testing.assert_array_equal(np.asarray(f32(v2)), np.asarray(f32(v_r)))
    np.testing.assert_allclose(np.asarray(f32(k2)), np.asarray(f32(k_r)), atol=tol, rtol=0)
    err = float(jnp.linalg.norm(f32(out) - out_r) / jnp.linalg.norm(out_r))
    assert err < tol


def test_decoder_fused_attention_equals_xla():
    """Head dim 16 (the kernel's smallest), GQA 2, ragged prompts, decoded end to end."""
    import dataclasses

    model = build_model(dataclasses.replace(CFG, hidden_size=64), seed=2)
    ref = decode.Decoder(model, max_len=MAX_LEN, attention="xla", chunk=4).generate(PROMPTS, NEW)
    out = decode.Decoder(model, max_len=MAX_LEN, attention="fused", chunk=4).generate(PROMPTS, NEW)
    assert out.tokens == ref.tokens
    np.testing.assert_allclose(np.concatenate(out.logprobs), np.concatenate(ref.logprobs), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="fused"):
        decode.Decoder(build_model(CFG), attention="fused")  # head_dim 8: below the kernel's 16


# ---------------------------------------------------------------------------------- CLI


def _byte_tokenizer_json(path):
    """A byte-level BPE with no merges: 256 ids, one per byte (the HF fixture's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


def test_cli_hf_directory_streams_text(tmp_path, capsys):
    import shutil
    from pathlib import Path

    from scaling.generate_cli import main

    d = tmp_path / "hf"
    shutil.copytree(Path(__file__).parent / "fixtures" / "hf_tiny" / "plain", d)
    _byte_tokenizer_json(d / "tokenizer.json")
    assert main(["--checkpoint", str(d), "--prompt", "hello", "--max-new-tokens", "5", "--no-stop"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("hello") and len(out.out.strip()) > len("hello")
    assert "5 tokens" in out.err and "layers xla" in out.err  # (the CPU's steps)
    assert main(["--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert main(["--checkpoint", str(d), "--prompt", "x", "--layers", "fast"]) == 2
    assert "layers='fast': allowed ['xla', 'pallas', 'pallas_tma', 'auto', 'megakernel']" in capsys.readouterr().err
    # the sampler kernel draws the XLA sampler's tokens, here through the CLI, prefilled a row a call
    args = ["--checkpoint", str(d), "--prompt", "hello", "--prompt", "abc", "--max-new-tokens", "4", "--no-stop",
            "--temperature", "0.9", "--top-p", "0.8", "--seed", "3"]
    assert main(args) == 0
    want = capsys.readouterr().out
    assert main(args + ["--sampler", "pallas", "--prefill-tokens", "16"]) == 0
    assert capsys.readouterr().out == want
    assert main(args + ["--sampler", "sort"]) == 2
    assert "sampler must be one of ('auto', 'xla', 'pallas'), got 'sort'" in capsys.readouterr().err
    assert main(args + ["--prefill-tokens", "0"]) == 2
    assert "prefill_tokens must be an int >= 1, got 0" in capsys.readouterr().err
    # one prompt streams, but a bad argument is reported before the prompt is echoed
    assert main(["--checkpoint", str(d), "--prompt", "hello", "--temperature", "1", "--top-p", "1.5"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "top_p=1.5 must be in (0, 1]" in out.err


def test_cli_run_directory(tmp_path, capsys):
    """A run directory as train() leaves it: config.yaml, tokenizer.json, an Orbax checkpoint."""
    from scaling.checkpoint import Checkpointer
    from scaling.config import dump_yaml, load_config, to_dict
    from scaling.generate_cli import main
    from scaling.train import init_state, make_setup

    overrides = ["--model.vocab_size=257", "--model.hidden_size=32", "--model.num_layers=1", "--model.num_heads=2",
                 "--model.num_kv_heads=1", "--model.mlp_dim=32", "--data.tokenizer=byte", "--mesh.fsdp=1",
                 "--mesh.data=-1", "--checkpoint.async_save=false"]
    cfg = load_config(None, overrides)
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg))
    (tmp_path / "tokenizer.json").write_text('{"kind": "byte"}')
    ckpt = Checkpointer(tmp_path, cfg.checkpoint)
    ckpt.save(1, init_state(make_setup(cfg)), {"loader": {}, "config": to_dict(cfg)}, force=True)
    ckpt.close()
    assert main(["--checkpoint", str(tmp_path), "--prompt", "ab", "--prompt", "xyz", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "=== 'ab'" in out and "=== 'xyz'" in out
    # --step names the steps there are (was Orbax's "Directory does not exist"), and where it cannot apply says so
    assert main(["--checkpoint", str(tmp_path), "--prompt", "ab", "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "--step 7: no complete checkpoint of that step" in err and "have [1]" in err
    assert main(["--checkpoint", str(tmp_path), "--prompt", "ab", "--step", "1", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    export = tmp_path / "export"
    from scaling.checkpoint import export_params

    export_params(tmp_path, export)
    assert main(["--checkpoint", str(export), "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["--checkpoint", str(export), "--prompt", "ab", "--step", "1"]) == 2
    assert "is an export (params/, one step)" in capsys.readouterr().err
    assert not (export / "checkpoints").exists()  # (the refused restore used to create it)


@pytest.mark.parametrize("n,kh,h,dtype,tol", [(32, 4, 16, jnp.float32, 1e-5), (8, 8, 64, jnp.bfloat16, 2e-2)])
def test_rotated_decode_kernel_matches_scatter_and_reference(n, kh, h, dtype, tol):
    """decode_attention_rotated (q/k/v already rotated: cache write + tensor-core attention)
    against a scatter into the cache and the reference attention in plain jnp. MHA and GQA 8;
    each group's 16-row q tile reads the heads after it (the last one's reach the v heads)."""
    from scaling.kernels.decode_attention import decode_attention_rotated

    b, s = 3, 128
    ks = jax.random.split(jax.random.key(n * h + kh + 1), 4)
    qkv = jax.random.normal(ks[0], (b, n + 2 * kh, h), dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), dtype)
    pos = jnp.asarray([0, 37, s - 1], jnp.int32)  # first slot, mid-tile, last slot
    rows = jnp.arange(b)
    k_r = k.at[rows, pos].set(qkv[:, n : n + kh])
    v_r = v.at[rows, pos].set(qkv[:, n + kh :])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    out_r = decode_attention_reference(f32(qkv[:, :n]), f32(k_r), f32(v_r), pos + 1)
    blocks = DecodeBlockSizes(block_s=16, min_programs=24)  # several splits and tiles per row
    out, k2, v2 = decode_attention_rotated(qkv, pos, k, v, num_heads=n, blocks=blocks, interpret=True)
    np.testing.assert_array_equal(np.asarray(f32(k2)), np.asarray(f32(k_r)))
    np.testing.assert_array_equal(np.asarray(f32(v2)), np.asarray(f32(v_r)))
    err = float(jnp.linalg.norm(f32(out) - out_r) / jnp.linalg.norm(out_r))
    assert err < tol
    from scaling.kernels.decode_attention import rotated_supported

    assert "run past" in rotated_supported(4, 4, 16) and rotated_supported(32, 8, 64) is None  # the 1b's heads


@pytest.mark.parametrize("mk_ppr", [0, 2])
def test_first_tokens_call_lays_out_the_cache_and_reduces_done(mk_ppr):
    """`_first_tokens` (the prefill's last call: first tokens, the megakernel's cache layout, the
    done flags) against its parts called apart: `sample` and `_advance` on the same logits,
    `megakernel_cache` on the same cache (ppr 2: paired positions), `all` on the state's flags."""
    shape, n_layers = (1, 8, 2, 4), 2
    cache = decode._empty_cache(shape=shape, layers=n_layers, dtype=jnp.bfloat16)
    assert all(a.shape == shape and not a.any() for a in cache["k"] + cache["v"]) and len(cache["k"]) == n_layers
    key = jax.random.key(9)
    cache = jax.tree.map(lambda a: jax.random.normal(key, a.shape).astype(a.dtype), cache)
    want_kv = decode.megakernel_cache(cache, mk_ppr)["kv"] if mk_ppr else None
    logits = jax.random.normal(jax.random.key(1), (1, 11))
    lengths, done = jnp.asarray([4]), jnp.asarray([False])
    params = {"temperature": jnp.float32(1.0), "top_p": jnp.float32(1.0), "stop_ids": jnp.full((8,), -1, jnp.int32),
              "max_new": jnp.int32(1), "max_len": jnp.int32(8), "key": jax.random.key_data(jax.random.key(0))}
    sampling = decode.Sampling(greedy=True, top_k=None, use_top_p=False)
    state, tok, lp, all_done = decode._first_tokens(logits, lengths, done, params, cache if mk_ppr else None,
                                                    sampling=sampling, mk_ppr=mk_ppr)
    want_tok = int(jnp.argmax(logits[0]))
    assert tok.tolist() == [want_tok] and state["pos"].tolist() == [4] and state["count"].tolist() == [1]
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[0, want_tok][None], rtol=1e-6)
    assert bool(all_done) and state["done"].tolist() == [True]  # (max_new 1: done after the first token)
    if mk_ppr:
        np.testing.assert_array_equal(np.asarray(state["cache"]["kv"], np.float32), np.asarray(want_kv, np.float32))
    else:  # (the caller keeps the prefill's cache: no copy of it)
        assert "cache" not in state


def test_cli_keeps_the_space_a_sentencepiece_decoder_drops(tmp_path, capsys):
    """A Llama-2-style tokenizer (Metaspace: each word carries its leading '▁', and decoding a
    sequence drops the first one's space): the CLI prints the prompt, then the new tokens as they
    read after it, which the decoder gives only when it sees them after the prompt."""
    import shutil
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from scaling.generate_cli import main
    from scaling.interop import hf

    d = tmp_path / "hf"
    shutil.copytree(Path(__file__).parent / "fixtures" / "hf_tiny" / "plain", d)
    vocab = {"<unk>": 0, **{f"▁w{i}": i for i in range(1, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.save(str(d / "tokenizer.json"))
    prompt = tok.encode("w3 w17").ids
    assert prompt == [3, 17] and tok.decode([5, 6]) == "w5 w6"  # the decoder drops the first space
    _, model = hf.load(d)
    for prompts in (["w3 w17"], ["w3 w17", "w9"]):  # streamed, and a batch printed at the end
        new = decode.generate(model, [tok.encode(p).ids for p in prompts], 6)
        args = ["--checkpoint", str(d), "--max-new-tokens", "6", "--no-stop"]
        assert main(args + [a for p in prompts for a in ("--prompt", p)]) == 0
        out = capsys.readouterr().out
        for p, toks in zip(prompts, new):
            want = p + "".join(f" w{t}" for t in toks)  # every new word after a space
            assert want + "\n" in out


# ------------------------------------------------------------- arguments and edge cases


def _uncached_argmax(model, prompt, new):
    """Greedy tokens by the model's full forward pass over the growing sequence (no cache)."""
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(jnp.argmax(model(jnp.asarray([seq], jnp.int32))[0, -1])))
    return seq[len(prompt):]


def test_tiny_temperature_draws_the_argmax(model, decoder):
    """temperature -> 0 is greedy. logits / T past f32's range had made every logit +-inf: the
    first +inf (not the largest) or, all -inf, token 0 was drawn; a T that rounds to 0 in f32 divided by 0."""
    want = [_uncached_argmax(model, p, 4) for p in PROMPTS]
    for t in (1e-38, 1e-42, 1e-60):
        assert decoder.generate(PROMPTS, 4, temperature=t, seed=1).tokens == want, t
    # `sample` alone at the floor the Decoder applies: rows of all-positive and all-negative logits
    # (which overflowed at T = 1e-38) draw their argmax
    logits = jnp.asarray([[3.0, 5.0, 4.0, 5.5], [-5.0, -3.0, -4.0, -3.5], [40.0, -40.0, 41.0, 0.0]])
    keys = jax.random.split(jax.random.key(0), 3)
    for top_k, use_top_p in ((None, False), (2, False), (None, True)):
        sampling = decode.Sampling(greedy=False, top_k=top_k, use_top_p=use_top_p)
        toks, lps = decode.sample(logits, keys, jnp.float32(decode.MIN_TEMPERATURE), jnp.float32(0.9), sampling)
        np.testing.assert_array_equal(np.asarray(toks), [3, 1, 2])
        np.testing.assert_allclose(np.asarray(lps), np.asarray(jax.nn.log_softmax(logits))[[0, 1, 2], [3, 1, 2]],
                                   atol=1e-6)


def test_arguments_of_the_wrong_kind_raise_at_the_call(model, decoder, monkeypatch):
    """Before anything compiles, and at stream's call, not at its first item."""
    # (a float chunk failed in the trace, a float max_len at the call)
    for kw, msg in ((dict(chunk=2.5), "chunk=2.5 must be an int >= 1"),
                    (dict(max_len=64.0), "max_len=64.0 must be an int >= 1")):
        with pytest.raises(ValueError, match=msg):
            decode.Decoder(model, **kw)
    def no_compile(*a, **k):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(decode, "_prefill_rows", no_compile)
    monkeypatch.setattr(decode, "_decode_chunk", no_compile)
    cases = [
        (dict(max_new_tokens=2.5), "max_new_tokens=2.5 must be an int"),  # (had run 2 steps)
        (dict(max_new_tokens=True), "max_new_tokens=True must be an int"),
        (dict(temperature=float("nan")), "temperature=nan must be a finite number"),  # (had drawn from NaN logits)
        (dict(temperature=float("inf")), "temperature=inf must be a finite number"),  # (top-k/top-p kept every token)
        (dict(temperature="0.5"), "temperature='0.5' must be a finite number"),
        (dict(temperature=1.0, top_k=2.5), r"top_k=2.5 must be an int in \[1, vocab_size=97\]"),  # (in the trace)
        (dict(stop_tokens=5), "stop_tokens must be a list of token ids, got 5"),  # (a TypeError at the first item)
        (dict(stop_tokens=[1.5]), "stop_tokens must be integer token ids"),
        (dict(max_len=0), "max_len=0 must be an int >= 1"),
        (dict(max_len=40.0), "max_len=40.0 must be an int >= 1"),
    ]
    for kw, msg in cases:
        kw = {"max_new_tokens": 3, **kw}
        new = kw.pop("max_new_tokens")
        with pytest.raises(ValueError, match=msg):
            decoder.stream([[1, 2]], new, **kw)
        with pytest.raises(ValueError, match=msg):
            decoder.generate([[1, 2]], new, **kw)
    flat = "a list of token-id lists, one per prompt, not a flat list of ids"
    for prompts, msg in (([1, 2, 3], flat), (np.arange(1, 4), r"2-D \[prompts, tokens\], got shape \(3,\)"),
                         (np.zeros((0, 3), np.int32), "non-empty"), (np.zeros((2, 0), np.int32), "prompt 0 is empty"),
                         (np.full((1, 2), 97), "outside the vocabulary"), ([[1, [2]]], "prompt 0 must be a flat list")):
        with pytest.raises(ValueError, match=msg):
            decoder.stream(prompts, 2)


def test_array_prompts_and_stop_ids(model, decoder):
    """A [prompts, tokens] numpy or jax array is a batch of equal-length prompts (it had been
    refused); stop ids may come as an array, and ids outside the vocabulary, never drawn, change
    nothing (2**40 had overflowed int32)."""
    prompts = np.asarray([[5, 6, 7], [40, 41, 42]], np.int64)
    want = [_uncached_argmax(model, p, 5) for p in prompts.tolist()]
    assert decoder.generate(prompts, 5).tokens == want
    assert decoder.generate(jnp.asarray(prompts, jnp.int32), 5).tokens == want
    assert decode.generate(model, prompts, 5, max_len=MAX_LEN) == want
    assert decoder.generate(prompts, 5, stop_tokens=np.asarray([2**40, -1, 97])).tokens == want
    stop = want[1][1]
    cut = [w[: w.index(stop) + 1] if stop in w else w for w in want]
    assert decoder.generate(prompts, 5, stop_tokens=np.asarray([stop])).tokens == cut


def test_sampled_first_tokens_follow_the_filtered_softmax(model):
    """Many rows of one prompt: the first sampled tokens against softmax(logits / T) restricted to
    the top k and then to the top-p nucleus, from the model's uncached logits (chi-square)."""
    from scipy import stats

    prompt, n, t, k, p = [1, 2, 3], 2048, 1.3, 12, 0.8
    logits = np.asarray(model(jnp.asarray([prompt], jnp.int32))[0, -1], np.float64)
    z = logits / t
    z = np.where(z < np.sort(z)[-k], -np.inf, z)
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    order = np.argsort(-prob)
    keep = order[np.cumsum(prob[order]) - prob[order] < p]
    prob = np.where(np.isin(np.arange(prob.size), keep), prob, 0.0)
    prob /= prob.sum()
    dec = decode.Decoder(model, max_len=MAX_LEN, attention="xla")
    out = dec.generate([prompt] * n, 1, temperature=t, top_k=k, top_p=p, seed=0)
    first = np.asarray([toks[0] for toks in out.tokens])
    counts = np.bincount(first, minlength=CFG.vocab_size)
    assert counts[prob == 0].sum() == 0
    assert 3 <= (prob > 0).sum() < k  # (top-p cut inside the top k)
    assert stats.chisquare(counts[prob > 0], prob[prob > 0] * n).pvalue > 1e-3
    logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    np.testing.assert_allclose([lp[0] for lp in out.logprobs], logp[first], atol=2e-5)
