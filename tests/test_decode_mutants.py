"""Tests that kill mutants of scaling/decode.py and scaling/kernels/sample.py which
test_decode.py and test_sample_kernel.py let through (a mutation-testing spot check).

Each one checks the decoder against a reference that does not share its code:
- the model's own uncached forward pass over the decoded sequence (teacher-forced), in f32,
  one prompt at a time;
- a sampler written in numpy from the definitions (softmax(logits / T), the top k with ties
  kept, then the smallest prefix of the sorted tokens whose mass reaches top_p, and every token
  tied with its last), drawing by Gumbel-max with the noise of the key the Decoder documents:
  fold_in(fold_in(key(seed), row), n) for row `row`'s n-th new token;
- hand-built logits and noise whose draw and exchange count are known by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import decode
from scaling.config import DType, ModelConfig
from scaling.kernels import sample as ks
from scaling.model import build_model

CFG = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
                  init_std=0.3, compute_dtype=DType.float32)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40]]
NEW = 10
MAX_LEN = 64
WIDTH = 80  # every reference forward pass is right-padded to this width (one compile; causal: padding unseen)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=1)


@pytest.fixture(scope="module")
def decoder(model):
    return decode.Decoder(model, max_batch=4, max_len=MAX_LEN, attention="xla", chunk=4)


@pytest.fixture(scope="module")
def forward(model):
    """seq -> the model's f32 logits [len(seq), V] from one uncached pass over the sequence alone."""
    fn = jax.jit(lambda t: model(t).astype(jnp.float32))

    def run(seq):
        assert len(seq) <= WIDTH
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, : len(seq)] = seq
        return np.asarray(fn(jnp.asarray(padded)))[0, : len(seq)]
    return run


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _uncached_greedy(forward, prompt, new):
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(np.argmax(forward(seq)[-1])))
    return seq[len(prompt):]


def _kept(z, top_k, top_p):
    """The set the sampler draws from, by definition (float64): the top k (ties with the k-th kept),
    then the sorted tokens while the mass before each is below top_p, with every token tied to the
    last of those."""
    z = np.asarray(z, np.float64)
    keep = np.ones(z.shape, bool)
    if top_k is not None:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p is not None:
        zs = np.sort(np.where(keep, z, -np.inf))[::-1]
        p = np.exp(zs - zs[0])
        p /= p.sum()
        last = int(np.sum(np.cumsum(p) - p < top_p)) - 1
        keep &= z >= zs[last]
    return keep


def _reference_draw(logits_v, temperature, top_k, top_p, key):
    """Gumbel-max over the kept set: argmax(z + g) with g = gumbel(key, (V,)), z = logits / T in f32."""
    z = (np.asarray(logits_v, np.float32) / np.float32(temperature)).astype(np.float32)
    noise = np.asarray(jax.random.gumbel(key, z.shape, jnp.float32))
    return int(np.argmax(np.where(_kept(z, top_k, top_p), z + noise, -np.inf)))


def _row_key(seed, row, n):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), row), n)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature,top_k,top_p,seed", [(1.3, 20, 0.9, 7), (0.8, None, None, 11)])
def test_sampled_tokens_follow_the_documented_keys_and_filters(forward, decoder, temperature, top_k, top_p, seed):
    """Every sampled token of a ragged batch over several chunks is the reference's draw from the
    uncached logits with row r's key for its n-th token (kills: the step count not folded into the
    key, so every step reuses one noise; the seed ignored for one row), and its log-prob is the
    model's."""
    out = decoder.generate(PROMPTS, NEW, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    for r, (prompt, toks, lps) in enumerate(zip(PROMPTS, out.tokens, out.logprobs)):
        assert len(toks) == NEW
        logits = forward(prompt + toks)[len(prompt) - 1: len(prompt) - 1 + NEW]
        want = [_reference_draw(logits[n], temperature, top_k, top_p, _row_key(seed, r, n)) for n in range(NEW)]
        assert toks == want, r
        np.testing.assert_allclose(lps, _log_softmax64(logits)[np.arange(NEW), toks], atol=2e-5, rtol=0)


# ------------------------------------------------------------------------- cache and rows


def test_greedy_fills_the_cache_to_its_last_slot(forward, decoder):
    """A cache of exactly 64 positions (a whole number of KV blocks) filled to the last: 64 - 11 + 1
    tokens, each the uncached model's argmax, log-probs its own (the last step's K/V written one
    slot early went unseen)."""
    prompt = PROMPTS[1]
    out = decoder.generate([prompt], 100, max_len=MAX_LEN)
    toks = out.tokens[0]
    assert len(toks) == MAX_LEN - len(prompt) + 1
    logp = _log_softmax64(forward(prompt + toks)[len(prompt) - 1: len(prompt) - 1 + len(toks)])
    np.testing.assert_array_equal(np.argmax(logp, -1), toks)
    np.testing.assert_allclose(out.logprobs[0], logp[np.arange(len(toks)), toks], atol=2e-5, rtol=0)


ZERO_PROMPTS = [[82], [28]]  # (greedy continuations with token 0, the 5th and the 10th new token)


def test_token_zero_is_generated_and_can_stop(forward, decoder):
    """Token id 0 is an ordinary token: reported when drawn (the host filters finished steps as -1),
    and honoured as a stop id."""
    new = 12
    want = [_uncached_greedy(forward, p, new) for p in ZERO_PROMPTS]
    assert all(0 in w[:-1] for w in want)  # (the precondition: 0 is drawn, before the last token)
    out = decoder.generate(ZERO_PROMPTS, new)
    assert out.tokens == want
    assert [len(lp) for lp in out.logprobs] == [new] * len(want)
    stopped = decoder.generate(ZERO_PROMPTS, new, stop_tokens=[0])
    assert stopped.tokens == [w[: w.index(0) + 1] for w in want]


def test_no_decode_step_runs_once_every_real_row_has_stopped(forward, decoder):
    """Every prompt stops at its first token: the padding row (3 prompts in a bucket of 4) must not
    keep the decode loop going (decode_steps counts the steps run)."""
    firsts = [_uncached_greedy(forward, p, 1)[0] for p in PROMPTS]
    out = decoder.generate(PROMPTS, NEW, stop_tokens=firsts)
    assert out.tokens == [[t] for t in firsts]
    assert out.decode_steps == 0


# ------------------------------------------------------------------------------ kernel


def test_sample_kernel_takes_the_next_candidate_after_a_rejection():
    """Logits 3, 2, 1, 0, ... and noise that puts token 2 first in z + g and token 0 second: with
    k = 2, token 2 (two larger) is rejected and token 0 kept. Three exchanges: the statistics with
    the first candidate, its probe (which finds the second), the second's probe (a candidate order
    that visits the rejected one again ran to the cap and the radix search: 19)."""
    logits = jnp.asarray([[3.0, 2.0, 1.0, 0.0, -1.0, -1.0, -1.0, -1.0]])
    noise = jnp.asarray([[0.0, 0.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0]])  # y: 3, 2, 3.5, 0, -1, ...
    tok, lp, counters = ks.sample_rows(logits, noise, 1.0, 1.0, top_k=2, return_counters=True)
    assert int(tok[0]) == 0
    np.testing.assert_allclose(float(lp[0]), _log_softmax64(logits[0])[0], atol=1e-6)
    assert int(counters[0]) == 3


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sample_kernel_top_p_over_chunks_with_temperature(temperature):
    """One program, two chunks of 16; the row's largest logit in the second chunk, so the first
    chunk's running sums are rescaled to the new max, which for top-p's total is exp((m - m') / T).
    Against the definition's kept set (float64) and 128 Gumbel draws (a rescale without the
    temperature had the wrong total, so a wrong nucleus, with T != 1)."""
    rng = np.random.default_rng(2)
    logits = np.concatenate([np.linspace(0.0, 2.2, 16), rng.uniform(-1.0, 0.5, 16)]).astype(np.float32)
    logits[20] = 3.0
    z32 = (logits / np.float32(temperature)).astype(np.float32)
    noise = np.asarray(jax.random.gumbel(jax.random.key(5), (128, 32), jnp.float32))
    for top_p in (0.6, 0.9):
        keep = _kept(z32, None, top_p)
        assert 2 <= keep.sum() < 31
        want = np.argmax(np.where(keep, noise + z32, -np.inf), axis=-1)
        for cap in (ks.MAX_CANDIDATES, 0):  # (the candidates' test, and the radix search's)
            tok, lp = ks.sample_rows(jnp.broadcast_to(jnp.asarray(logits), (128, 32)), jnp.asarray(noise),
                                     temperature, top_p, use_top_p=True, chunk=16, splits=1, max_candidates=cap)
            np.testing.assert_array_equal(np.asarray(tok), want)
            np.testing.assert_allclose(np.asarray(lp), _log_softmax64(logits)[want], atol=1e-5, rtol=0)


def test_a_temperature_beyond_float32_draws_uniformly_without_overflow(decoder):
    """T above f32's range was cast to inf (with a numpy overflow warning). It is the uniform
    limit: each new token is the argmax of its documented key's Gumbel noise alone."""
    import warnings

    seed, new = 3, 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got,) = decoder.generate([[1, 2, 3]], new, temperature=1e39, seed=seed).tokens
    want = [int(np.argmax(np.asarray(jax.random.gumbel(_row_key(seed, 0, n), (CFG.vocab_size,), jnp.float32))))
            for n in range(new)]
    assert got == want
