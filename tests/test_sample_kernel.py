"""scaling.kernels.sample (interpret mode) against decode.sample, its sort-based reference: the same
token from the same key and the same log-prob, over peaked, flat and tied rows, with its
rejection loop and with the bisection it falls back to; and the decoder's sampler option.
(A token is discrete, so there is no gradient to test.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaling import decode
from scaling.kernels import sample as ks
from scaling.config import DType, ModelConfig
from scaling.model import build_model

CFG = ModelConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48,
                  init_std=0.3, compute_dtype=DType.float32)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40]]

V = 300  # (not a multiple of the kernel's chunk: the padding is masked)
# How a row is spread over programs: one (the default off the GPU), 3 of 2 chunks of 64 (the last
# split one chunk), 5 of one chunk of 64 each (the last part padding). Interpret mode runs a row's
# splits one after another, through the same exchange of partials as on the GPU, without its barrier.
LAYOUTS = [dict(), dict(chunk=64, splits=3), dict(chunk=64, splits=5)]


def rows(seed: int, ties: bool):
    """Eight rows from near-uniform to nearly one-hot; ties: logits on a grid of 0.25."""
    rng = np.random.default_rng(seed)
    scale = np.array([0.01, 0.1, 0.3, 1, 2, 3, 8, 20])[:, None]
    lg = rng.normal(size=(8, V)) * scale
    if ties:
        lg = np.round(lg * 4) / 4
    keys = decode._row_keys(jax.random.key(seed), jnp.arange(8, dtype=jnp.int32))
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    return jnp.asarray(lg, jnp.float32), keys, noise


@pytest.mark.parametrize("top_k,top_p,temperature,ties", [
    (None, None, 0.7, False),  # temperature alone: the first candidate
    (5, None, 1.0, True),  # top-k: ties with the k-th are kept
    (None, 0.8, 1.3, False),
    (None, 0.05, 1.0, True),  # top-p keeping one or a few tokens
    (20, 0.6, 0.9, True),  # both: the k-th value by bisection, then top-p over the top-k set
    (V, 0.99, 1.0, False),  # k = V keeps everything
])
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=["one", "3x2"])
def test_kernel_draws_the_reference_token(top_k, top_p, temperature, ties, layout):
    logits, keys, noise = rows(top_k or 7, ties)
    sampling = decode.Sampling(greedy=False, top_k=top_k, use_top_p=top_p is not None)
    want_tok, want_lp = decode.sample(logits, keys, jnp.float32(temperature), jnp.float32(top_p or 1.0), sampling)
    # max_candidates 0: every row whose first candidate is rejected takes the bisection
    for max_candidates in (8, 0):
        tok, lp = ks.sample_rows(logits, noise, temperature, top_p or 1.0, top_k=top_k,
                                 use_top_p=top_p is not None, max_candidates=max_candidates, **layout)
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
        np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), atol=1e-6, rtol=0)


@pytest.mark.parametrize("top_k,top_p", [(20, 0.6), (None, 0.8)])
def test_one_chunk_a_program_with_padding(top_k, top_p):
    """LAYOUTS' third: 5 programs of one chunk each, the last part padding (the rest of the
    masks: test_kernel_draws_the_reference_token, with one and three programs)."""
    test_kernel_draws_the_reference_token(top_k, top_p, 0.9, True, LAYOUTS[2])


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=["one", "3x2"])
def test_rejections_happen_and_both_paths_agree(layout):
    """A flat row with k = 3: the first candidates are mostly outside the top 3, so the loop rejects
    (the default cap) or searches the threshold (cap 0), and both land on the reference's token."""
    logits, keys, noise = rows(11, False)
    flat = jnp.broadcast_to(logits[1], logits.shape)  # (scale 0.1: near-uniform)
    sampling = decode.Sampling(greedy=False, top_k=3)
    want, _ = decode.sample(flat, keys, jnp.float32(1.0), jnp.float32(1.0), sampling)
    first = np.asarray(jnp.argmax(flat + noise, axis=-1))
    assert np.sum(first != np.asarray(want)) >= 4  # most rows' first candidate is rejected
    for cap in (0, 1, 8):
        tok, _ = ks.sample_rows(flat, noise, 1.0, 1.0, top_k=3, max_candidates=cap, **layout)
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))


def kept_f64(z32, top_k, top_p):
    """The reference's kept set in float64 from a sort: the top k (ties with the k-th kept), then
    the sorted prefix whose mass before each token is below top_p (renormalised over the top k),
    and every token at least as large as its last."""
    z = z32.astype(np.float64)
    keep = np.ones_like(z, bool)
    if top_k is not None:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p is not None:
        zs = np.sort(np.where(keep, z, -np.inf))[::-1]
        p = np.exp(zs - zs[0])
        p /= p.sum()
        last = np.sum(np.cumsum(p) - p < top_p) - 1
        keep &= z >= zs[last]
    return keep


@pytest.mark.parametrize("top_k,top_p", [(3, None), (6, None), (None, 0.3), (None, 0.7), (6, 0.5)])
@pytest.mark.parametrize("layout", [dict(), dict(chunk=16, splits=2)], ids=["one", "2x1"])
def test_boundary_tokens_against_a_float64_sort(top_k, top_p, layout):
    """24 tokens on a grid of logits (ties at every boundary) and 128 draws of noise: the tokens
    at the edge of the kept set are drawn often, so a wrong membership test shows."""
    rng = np.random.default_rng(5)
    logits = np.round(rng.normal(size=24) * 4) / 4
    z32 = (logits / 1.1).astype(np.float32)
    noise = np.asarray(jax.random.gumbel(jax.random.key(1), (128, 24), jnp.float32))
    keep = kept_f64(z32, top_k, top_p)
    want = np.argmax(np.where(keep, noise + z32, -np.inf), axis=-1)  # (y in f32, as categorical adds)
    tok, _ = ks.sample_rows(jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (128, 24)), jnp.asarray(noise), 1.1,
                            top_p or 1.0, top_k=top_k, use_top_p=top_p is not None, **layout)
    edge = np.min(z32[keep])
    assert np.sum(z32[want] == edge) >= 3  # (the edge is drawn)
    np.testing.assert_array_equal(np.asarray(tok), want)


def test_candidates_tied_in_z_plus_noise_go_by_index():
    """Token 0 (z 1, noise 1) and token 1 (z 2, noise 0) tie at y = 2, token 0 first. With k = 1
    token 0 is rejected; the next candidate is the tied token 1, not the next smaller y."""
    logits = jnp.asarray([[1.0, 2.0, 1.5, 0.0]])
    noise = jnp.asarray([[1.0, 0.0, 0.25, 0.0]])
    tok, lp = ks.sample_rows(logits, noise, 1.0, 1.0, top_k=1)
    assert int(tok[0]) == 1
    np.testing.assert_allclose(float(lp[0]), float(jax.nn.log_softmax(logits[0])[1]), atol=1e-6)


@pytest.mark.parametrize("chunk,splits", [(ks.CHUNK, 1), (64, 2)])
def test_a_tie_across_chunks_goes_to_the_first_index(chunk, splits):
    """Two equal largest z + g, in the first and the second chunk of a row (with 2 splits: in the
    two programs' partials): argmax's first, with its own log-prob (logit 2 + noise 1 against
    logit 3 + noise 0)."""
    v = chunk + chunk // 2  # (two chunks: with 2 splits, one each)
    if splits > 1:
        assert ks.plan_splits(1, v, chunk, programs=splits) == (2, 1)
    logits = jnp.zeros((1, v)).at[0, 10].set(2.0).at[0, chunk + 7].set(3.0)
    noise = jnp.zeros((1, v)).at[0, 10].set(1.0)
    for top_k in (None, 2):
        tok, lp = ks.sample_rows(logits, noise, 1.0, 1.0, top_k=top_k, chunk=chunk, splits=splits)
        assert int(tok[0]) == 10
        np.testing.assert_allclose(float(lp[0]), float(jax.nn.log_softmax(logits[0])[10]), atol=1e-6)


@pytest.mark.parametrize("chunk,splits", [(ks.CHUNK, 1), (256, 3)])
def test_rows_of_several_chunks(chunk, splits):
    """A row over two chunks (or three splits), its largest logits in the second: the running sums
    rescaled as the max moves (the log-probs and top-p's total), within a program and across."""
    v = chunk + 500
    rng = np.random.default_rng(3)
    lg = rng.normal(size=(4, v)) * np.array([[0.5], [1], [2], [4]])
    lg[:, chunk + 10: chunk + 20] += 6.0  # (the mass in the second chunk)
    logits = jnp.asarray(lg, jnp.float32)
    keys = decode._row_keys(jax.random.key(4), jnp.arange(4, dtype=jnp.int32))
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
    for top_p in (None, 0.5):
        sampling = decode.Sampling(greedy=False, use_top_p=top_p is not None)
        want_tok, want_lp = decode.sample(logits, keys, jnp.float32(0.9), jnp.float32(top_p or 1.0), sampling)
        tok, lp = ks.sample_rows(logits, noise, 0.9, top_p or 1.0, use_top_p=top_p is not None, max_candidates=0,
                                 chunk=chunk, splits=splits)
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok))
        np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), atol=1e-5, rtol=0)


def test_float_keys_keep_the_order():
    x = jnp.asarray([-jnp.inf, -3e38, -1.0, -1e-30, 0.0, 1e-30, 1.0, 3e38, jnp.inf], jnp.float32)
    keys = np.asarray(ks._key(x))
    assert np.all(np.diff(keys) > 0) and keys[0] == ks.KEY_OF_MINUS_INF
    np.testing.assert_array_equal(np.asarray(ks._value(ks._key(x))), np.asarray(x))
    assert int(ks._key(jnp.float32(jnp.inf))) == ks.KEY_OF_PLUS_INF
    # the radix search's pivots beyond the infinities (NaN bit patterns) read as the infinities
    beyond = jnp.asarray([-(2**31), ks.KEY_OF_MINUS_INF - 1, ks.KEY_OF_PLUS_INF + 1, 2**31 - 1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(ks._value_clamped(beyond)), [-np.inf, -np.inf, np.inf, np.inf])


def test_chunk_plan_gives_a_program_its_share_of_the_row_in_one_chunk():
    """plan_chunk: the row's share of a program rounded up to a power of two in [CHUNK, MAX_CHUNK],
    16 warps at MAX_CHUNK (the settings measured fastest on an H200)."""
    assert ks.plan_chunk(1, 128256, programs=132) == (1024, 8)  # 126 programs of 1 chunk
    assert ks.plan_chunk(1, 32000, programs=132) == (1024, 8)  # (never below CHUNK)
    assert ks.plan_chunk(8, 32000, programs=132) == (2048, 8)  # 16 programs a row, 2000 tokens each
    assert ks.plan_chunk(8, 128256, programs=132) == (8192, 16)
    assert ks.plan_chunk(64, 128256, programs=132) == (8192, 16)  # (2 programs a row: 8 chunks each)
    for b, v in ((1, 32000), (8, 32000), (8, 128256), (5, 5000)):
        chunk, _ = ks.plan_chunk(b, v, programs=132)
        splits, per = ks.plan_splits(b, v, chunk, programs=132)
        assert per == 1 and b * splits <= 132  # one chunk a program where the row's share fits one


def test_split_plan_keeps_every_program_resident():
    """Up to (SMs // batch) programs a row, never a split without a chunk."""
    assert ks.plan_splits(1, 128256, 1024, programs=132) == (126, 1)  # 126 chunks, one each
    assert ks.plan_splits(8, 128256, 1024, programs=132) == (16, 8)
    assert ks.plan_splits(64, 128256, 1024, programs=132) == (2, 63)
    assert ks.plan_splits(200, 128256, 1024, programs=132) == (1, 126)
    assert ks.plan_splits(3, 300, 64, programs=132) == (5, 1)
    for b, v, c in ((1, 32000, 1024), (5, 5000, 256), (33, 128256, 1024), (2, 1000, 16)):
        s, per = ks.plan_splits(b, v, c, programs=132)
        n_chunks = -(-v // c)
        assert b * s <= 132 and (s - 1) * per < n_chunks <= s * per


def test_auto_sampler_takes_the_kernel_where_it_was_measured_faster():
    """On a GPU for top-k or top-p; never for temperature alone nor off the GPU; "xla" and
    "pallas" as they say."""
    runs = decode.sample_kernel_runs
    assert runs("auto", top_k=None, use_top_p=True, backend="gpu")
    assert runs("auto", top_k=50, use_top_p=True, backend="gpu")
    assert runs("auto", top_k=50, use_top_p=False, backend="gpu")
    assert not runs("auto", top_k=None, use_top_p=False, backend="gpu")  # (temperature alone)
    assert not runs("auto", top_k=50, use_top_p=True, backend="cpu")
    assert runs("pallas", top_k=50, use_top_p=False, backend="cpu")
    assert not runs("xla", top_k=None, use_top_p=True, backend="gpu")


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=["one", "3x2"])
def test_counters_count_the_exchanges(layout):
    """return_counters: a row's exchanges times its splits (interpret mode counts the arrivals as
    the GPU's barrier does). Temperature alone: 1 (statistics and the first candidate). Flat rows
    with k = 3: 2 where the first candidate is in the top 3; where it lies DEEP_RANK k or more
    deep, the candidates end there: 1 + 1 + 8 radix rounds + 1 for the largest z + g above the
    k-th = 11."""
    splits = layout.get("splits", 1)
    logits, keys, noise = rows(11, False)
    _, _, counters = ks.sample_rows(logits, noise, 0.9, 1.0, return_counters=True, **layout)
    np.testing.assert_array_equal(np.asarray(counters), splits)
    flat = jnp.broadcast_to(logits[1], logits.shape)
    sampling = decode.Sampling(greedy=False, top_k=3)
    want, _ = decode.sample(flat, keys, jnp.float32(1.0), jnp.float32(1.0), sampling)
    tok, _, counters = ks.sample_rows(flat, noise, 1.0, 1.0, top_k=3, return_counters=True, **layout)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
    z = np.asarray(flat[0])
    first = np.asarray(jnp.argmax(flat + noise, axis=-1))
    rank = np.array([np.sum(z > z[f]) for f in first])
    counters = np.asarray(counters) // splits
    np.testing.assert_array_equal(counters[rank < 3], 2)
    deep = rank >= ks.DEEP_RANK * 3
    assert deep.sum() >= 4
    np.testing.assert_array_equal(counters[deep], 11)


def test_bad_input_is_refused():
    logits, _, noise = rows(0, False)
    with pytest.raises(ValueError, match="splits=2 must be in \\[1, 1\\]"):
        ks.sample_rows(logits, noise, 1.0, 1.0, splits=2)
    with pytest.raises(ValueError, match="chunk=100 must be a power of two"):
        ks.sample_rows(logits, noise, 1.0, 1.0, chunk=100)
    with pytest.raises(ValueError, match="num_warps=3 must be one of 1, 2, 4, 8, 16, 32"):
        ks.sample_rows(logits, noise, 1.0, 1.0, num_warps=3)
    with pytest.raises(ValueError, match="exchange=2 must be one of \\(0, 1\\)"):
        ks.sample_rows(logits, noise, 1.0, 1.0, exchange=2)
    with pytest.raises(ValueError, match="noise must be \\(8, 300\\) like the logits"):
        ks.sample_rows(logits, noise[:, :10], 1.0, 1.0)
    with pytest.raises(ValueError, match="top_k=301 must be in \\[1, 300\\]"):
        ks.sample_rows(logits, noise, 1.0, 1.0, top_k=301)


def test_decoder_sampler_option():
    model = build_model(CFG, seed=1)
    kw = dict(max_batch=4, max_len=64, attention="xla", chunk=4)
    xla, pallas = decode.Decoder(model, **kw), decode.Decoder(model, sampler="pallas", **kw)
    for sampling in (dict(temperature=0.9, top_p=0.9, seed=2), dict(temperature=1.2, top_k=5, seed=3)):
        a, b = xla.generate(PROMPTS, 6, **sampling), pallas.generate(PROMPTS, 6, **sampling)
        assert a.tokens == b.tokens
        np.testing.assert_allclose(np.concatenate(a.logprobs), np.concatenate(b.logprobs), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="sampler must be one of \\('auto', 'xla', 'pallas'\\), got 'sort'"):
        decode.Decoder(model, sampler="sort")


def test_tiny_temperatures_draw_the_argmax_on_the_kernel_too():
    """temperature -> 0 is greedy on the sampler kernel as on the XLA path: logits / T past f32's
    range (+inf for several tokens, which then tie) drew other tokens than the argmax. The
    reference: greedy decoding by the same decoder."""
    model = build_model(CFG, seed=1)
    dec = decode.Decoder(model, sampler="pallas", max_batch=4, max_len=64, attention="xla", chunk=4)
    want = dec.generate(PROMPTS, 5).tokens
    for t, extra in ((1e-38, dict(top_k=5)), (1e-42, dict(top_p=0.9)), (1e-33, dict(top_k=3, top_p=0.5))):
        assert dec.generate(PROMPTS, 5, temperature=t, seed=4, **extra).tokens == want, (t, extra)
