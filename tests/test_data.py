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


def _tokens_cfg(path, *extra):
    return load_config("configs/models/tiny.yaml", ["--data.source=tokens", f"--data.path={path}", "--train.seq_len=16",
                                                    "--train.batch_size=2", *extra])


def test_token_files_npy_and_bin_read_the_same_tokens(tmp_path):
    ids = np.random.default_rng(0).integers(0, 1024, 5000).astype(np.uint16)
    np.save(tmp_path / "t.npy", ids)
    ids.tofile(tmp_path / "t.bin")  # nanoGPT's raw format: uint16 when the vocabulary fits
    for name in ("t.npy", "t.bin"):
        data = make_dataset(_tokens_cfg(tmp_path / name), log=lambda m: None)
        np.testing.assert_array_equal(np.asarray(data.train.tokens), ids[: int(5000 * 0.95)])


def test_token_file_ids_are_range_checked_whole(tmp_path):
    """An id >= vocab_size anywhere in the file (not only in its first million tokens), a
    negative id, or float 'ids' are refused before training, naming data.path."""
    from scaling.config import ConfigError

    late = np.random.default_rng(0).integers(0, 1024, 1_100_000).astype(np.uint16)
    late[1_050_000] = 1024
    late.tofile(tmp_path / "late.bin")
    with pytest.raises(ConfigError, match=r"data.path=.*late.bin.*token id 1024 at position 1,050,000 is outside \[0, model.vocab_size=1024\)"):
        make_dataset(_tokens_cfg(tmp_path / "late.bin"))
    np.save(tmp_path / "neg.npy", np.array([5, 7, -1, 3] * 100, np.int32))
    with pytest.raises(ConfigError, match=r"neg.npy.*token id -1 at position 2"):
        make_dataset(_tokens_cfg(tmp_path / "neg.npy"))
    np.save(tmp_path / "float.npy", np.linspace(0, 1, 400, dtype=np.float32))
    with pytest.raises(ConfigError, match=r"float.npy.*expected integer token ids, got dtype float32"):
        make_dataset(_tokens_cfg(tmp_path / "float.npy"))


def test_empty_malformed_and_short_data_name_the_field(tmp_path):
    from scaling.config import ConfigError

    (tmp_path / "empty.bin").write_bytes(b"")
    np.save(tmp_path / "empty.npy", np.zeros(0, np.uint16))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")  # 1.5 uint16 tokens
    (tmp_path / "empty.txt").write_text("  \n")
    np.save(tmp_path / "short.npy", np.arange(16, dtype=np.uint16))  # train split 15 < seq_len + 1
    (tmp_path / "short.txt").write_text("tiny")
    cases = [
        (_tokens_cfg(tmp_path / "empty.bin"), r"data.path=.*empty.bin' holds no tokens"),
        (_tokens_cfg(tmp_path / "empty.npy"), r"data.path=.*empty.npy' holds no tokens"),
        (_tokens_cfg(tmp_path / "odd.bin"), r"data.path=.*odd.bin': 3 bytes is not a whole number of uint16 tokens"),
        (_tokens_cfg(tmp_path / "short.npy"), r"data.path=.*short.npy': the training split has 15 tokens .* train.seq_len=16 \+ 1"),
        (_tokens_cfg(tmp_path), r"data.path=.* is not a file"),
    ]
    for text in ("empty.txt", "short.txt"):
        cfg = load_config("configs/models/tiny.yaml", [f"--data.path={tmp_path / text}", "--data.tokenizer=byte",
                                                       f"--data.cache_dir={tmp_path / 'cache'}", "--train.seq_len=16"])
        cases.append((cfg, {"empty.txt": r"empty.txt': every file is empty", "short.txt": r"short.txt': the training split has 4 tokens"}[text]))
    for cfg, match in cases:
        with pytest.raises(ConfigError, match=match):
            make_dataset(cfg, log=lambda m: None)


def test_data_errors_exit_2_without_traceback(tmp_path, capsys):
    from scaling.__main__ import main

    (tmp_path / "empty.bin").write_bytes(b"")
    rc = main(["train", "--config", "configs/models/tiny.yaml", "--data.source=tokens", f"--data.path={tmp_path / 'empty.bin'}",
               "--train.steps=1", "--run_dir", str(tmp_path / "run"), "--logging.tensorboard=false"])
    assert rc == 2
    assert "empty.bin' holds no tokens" in capsys.readouterr().err


def test_directory_corpus_skips_hidden_folders_and_its_own_cache(tmp_path):
    """data.path at a project-like folder: .git/.venv and hidden files stay out, and so does a
    token cache inside it (its tokenizer.json would change the corpus, so each run re-tokenized)."""
    from scaling.data import build_token_store, text_files

    root = tmp_path / "proj"
    for rel, text in {"a.txt": "alpha beta " * 50, "sub/b.md": "gamma delta " * 50, ".git/c.txt": "x",
                      ".venv/lib/d.py": "y = 1", ".hidden.txt": "z", "sub/.e.py": "w"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    cache = root / "tokcache"
    assert text_files(root, cache) == [root / "a.txt", root / "sub" / "b.md"]
    cfg = load_config("configs/models/tiny.yaml", [f"--data.path={root}", f"--data.cache_dir={cache}",
                                                   "--model.vocab_size=300", "--train.seq_len=16"])
    first = build_token_store(cfg, log=lambda *_: None)
    second = build_token_store(cfg, log=lambda *_: None)
    assert first.directory == second.directory and len(list(cache.iterdir())) == 1
    assert text_files(root, cache) == [root / "a.txt", root / "sub" / "b.md"]


def test_held_out_split_smaller_than_one_batch_is_refused(tmp_path):
    """12 held-out windows against a batch of 16: one eval batch wrapped around the split and
    counted windows 0-3 twice in the eval loss. Refused now, naming the fields; without eval
    (train.eval_every=0) the same data trains."""
    from scaling.config import ConfigError

    # 4,000 tokens at eval_fraction 0.05: an eval split of 200 tokens = 12 windows of 16 + 1.
    np.save(tmp_path / "t.npy", np.arange(4000, dtype=np.uint16) % 1024)
    small = ["--train.batch_size=16"]
    with pytest.raises(ConfigError, match=r"holds 12 windows of train.seq_len=16 \+ 1, fewer than one eval batch of "
                                          r"train.batch_size=16; raise data.eval_fraction, or set train.eval_every=0"):
        make_dataset(_tokens_cfg(tmp_path / "t.npy", *small), log=lambda m: None)
    assert make_dataset(_tokens_cfg(tmp_path / "t.npy", *small, "--train.eval_every=0"), log=lambda m: None).train
    data = make_dataset(_tokens_cfg(tmp_path / "t.npy", "--train.batch_size=12"), log=lambda m: None)
    rows = data.eval.batch(0)[:, 0]  # each window's first token is its position: 12 distinct windows
    assert len(set(rows.tolist())) == 12
