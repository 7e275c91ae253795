import numpy as np
import pytest

from scaling.config import load_config
from scaling.data import Batches, ByteTokenizer, build_token_store, make_dataset, unigram_entropy


def corpus_cfg(cache, *extra):
    return load_config(
        "configs/tiny_corpus.yaml",
        [f"--data.cache_dir={cache}", "--data.max_corpus_mb=1", "--train.batch_size=4", "--train.seq_len=32", *extra],
    )


def test_packing_and_tokenizer_roundtrip(corpus_cache):
    cfg = corpus_cfg(corpus_cache)
    store = build_token_store(cfg, log=lambda m: None)
    toks = np.asarray(store.tokens)
    assert toks.max() < cfg.model.vocab_size
    # Documents are separated by EOS; a stdlib module's text decodes back exactly.
    eos = np.flatnonzero(toks == store.eos_id)
    assert len(eos) > 10 and eos[-1] == len(toks) - 1
    from scaling.data import load_tokenizer

    tok = load_tokenizer(store.tokenizer_path)
    first_doc = toks[: eos[0]]
    text = tok.decode(first_doc)
    assert tok.encode(text) == first_doc.tolist()
    assert "def " in text or "import" in text or '"""' in text
    # Second load is the cached memmap, identical.
    again = build_token_store(cfg, log=lambda m: pytest.fail("re-tokenized a cached corpus"))
    np.testing.assert_array_equal(np.asarray(again.tokens), toks)


def test_windows_are_contiguous_and_shifted(corpus_cache):
    cfg = corpus_cfg(corpus_cache)
    data = make_dataset(cfg, log=lambda m: None)
    b = data.train.batch(0)
    assert b.shape == (4, 33) and b.dtype == np.int32
    tokens = np.asarray(data.train.tokens)
    for row in b:  # every row is a contiguous slice of the token stream at a window boundary
        starts = [w * 32 for w in range(data.train.num_windows) if np.array_equal(tokens[w * 32 : w * 32 + 33], row)]
        assert starts


def test_determinism_resume_and_process_split():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = Batches(tokens, 16, 8, seed=3)
    b = Batches(tokens, 16, 8, seed=3)
    batches = [next(a) for _ in range(5)]
    for x in batches:
        np.testing.assert_array_equal(x, next(b))
    c = Batches(tokens, 16, 8, seed=4)
    assert not np.array_equal(c.batch(0), batches[0])
    # Resume from the saved position reproduces the rest of the sequence.
    r = Batches(tokens, 16, 8, seed=3)
    r.restore(a.state())
    np.testing.assert_array_equal(next(r), a.batch(5))
    # Two processes' rows concatenate to the global batch.
    p0 = Batches(tokens, 16, 8, seed=3, process_index=0, process_count=2)
    p1 = Batches(tokens, 16, 8, seed=3, process_index=1, process_count=2)
    np.testing.assert_array_equal(np.concatenate([p0.batch(2), p1.batch(2)]), batches[2])
    # One epoch visits every window once.
    e = Batches(tokens, 16, 1, seed=0)
    firsts = sorted(int(e.batch(i)[0, 0]) for i in range(e.num_windows))
    assert firsts == [16 * w for w in range(e.num_windows)]


def test_byte_tokenizer_and_entropy():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    uniform = np.arange(256).repeat(4)
    assert unigram_entropy(uniform, 256) == pytest.approx(np.log(256))


def test_synthetic_is_deterministic():
    cfg = load_config("configs/models/tiny.yaml", ["--data.source=synthetic", "--train.batch_size=4", "--train.seq_len=8"])
    d1, d2 = make_dataset(cfg), make_dataset(cfg)
    np.testing.assert_array_equal(d1.train.batch(7), d2.train.batch(7))
    assert d1.train.batch(7).max() < cfg.model.vocab_size


def test_bad_data_path(tmp_path):
    cfg = load_config("configs/models/tiny.yaml", [f"--data.path={tmp_path}/missing"])
    with pytest.raises(ValueError, match="does not exist"):
        make_dataset(cfg)
