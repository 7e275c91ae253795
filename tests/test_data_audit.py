"""Edge cases of scaling/data.py found in an audit: text that spells the EOS token, chunked
tokenization with progress, cache keys of files rewritten quickly, crashes while a damaged cache is
rebuilt, token files and text files given to the wrong data.source, and out-of-range process ids.
References are plain Python over the files' text."""

from __future__ import annotations

import os

import numpy as np
import pytest

import scaling.data as D
from scaling.config import ConfigError, load_config

TINY = "configs/models/tiny.yaml"


def _cfg(root, cache, *extra):
    return load_config(TINY, [f"--data.path={root}", f"--data.cache_dir={cache}", "--train.seq_len=16", "--train.batch_size=2", *extra])


def _write_docs(root, texts):
    root.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (root / f"d{i:02d}.txt").write_text(text)
    return root


def _pieces(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    """The stream split at EOS (every document ends with one)."""
    ends = np.flatnonzero(tokens == eos)
    assert len(ends) and ends[-1] == len(tokens) - 1
    return np.split(tokens, ends + 1)[:-1]


def _documents_in_cache_order(texts):
    """The documented order: non-blank files sorted by name, then shuffled with DATA_SEED."""
    order = np.random.default_rng(D.DATA_SEED).permutation(len(texts))
    return [texts[i] for i in order]


def test_a_document_that_spells_the_eos_token_stays_one_document(tmp_path):
    """A corpus of ML code holds the string "<|eos|>" (this repo's data.py does). The BPE matched it
    as the special token: an EOS mid-document, and decoding the stream lost the text."""
    texts = [f"doc {i} " + "words and more words " * 20 for i in range(6)]
    texts[2] = 'EOS = "<|eos|>"  # the end-of-document marker\n' + texts[2]
    root = _write_docs(tmp_path / "docs", texts)
    store = D.build_token_store(_cfg(root, tmp_path / "cache", "--model.vocab_size=300"), log=lambda m: None)
    tok = D.load_tokenizer(store.tokenizer_path)
    pieces = _pieces(np.asarray(store.tokens), store.eos_id)
    assert len(pieces) == len(texts)
    assert sorted(tok.decode(p[:-1]) for p in pieces) == sorted(texts)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_a_corpus_is_encoded_in_chunks_with_progress_lines(tmp_path, monkeypatch, tokenizer):
    """A large corpus was encoded in one call (its ids as Python lists, ~30 bytes a token) with no
    line between "tokenizing N files" and the end. Chunked now, a progress line per chunk; the
    tokens are the documents' own encodings, each followed by EOS, in the documented order."""
    texts = [f"document {i:02d} " + "lorem ipsum dolor " * (3 + i) for i in range(12)]
    root = _write_docs(tmp_path / "docs", texts)
    monkeypatch.setattr(D, "ENCODE_CHUNK_CHARS", 150)  # a few documents a chunk
    logs: list[str] = []
    store = D.build_token_store(_cfg(root, tmp_path / "cache", f"--data.tokenizer={tokenizer}", "--model.vocab_size=300"),
                                log=logs.append)
    progress = [m for m in logs if "documents (" in m]
    assert len(progress) >= 3, logs
    assert progress[-1].startswith("data: tokenized 12/12 documents (100% of the text")
    tok = D.load_tokenizer(store.tokenizer_path)
    want = [t for doc in _documents_in_cache_order(texts) for t in (*tok.encode(doc), store.eos_id)]
    np.testing.assert_array_equal(np.asarray(store.tokens), want)
    assert len(store.split("train")) == int(len(want) * 0.95)


def test_a_file_rewritten_within_one_second_is_tokenized_again(tmp_path):
    """The cache key held whole-second mtimes: a file rewritten at the same size within the
    same second (a data-prep script run twice) kept training on the old text."""
    root = _write_docs(tmp_path / "docs", ["aaaa " * 40])
    cfg = _cfg(root, tmp_path / "cache", "--data.tokenizer=byte", "--model.vocab_size=300")
    second = 1_700_000_000 * 10**9
    os.utime(root / "d00.txt", ns=(second + 1000, second + 1000))
    first = np.asarray(D.build_token_store(cfg, log=lambda m: None).tokens).copy()
    (root / "d00.txt").write_text("bbbb " * 40)  # same size
    os.utime(root / "d00.txt", ns=(second + 2000, second + 2000))
    again = np.asarray(D.build_token_store(cfg, log=lambda m: None).tokens)
    assert bytes(first[:-1].astype(np.uint8)) == b"aaaa " * 40
    assert bytes(again[:-1].astype(np.uint8)) == b"bbbb " * 40


def test_a_crash_while_rebuilding_a_damaged_cache_does_not_leave_it_marked_complete(tmp_path, monkeypatch):
    """meta.json (the completion mark) stayed while a damaged entry was rebuilt, and
    tokenizer.json was written in place: a crash mid-write left a half tokenizer.json under a
    complete-looking entry, used by the next run and failing only in `generate`."""
    root = _write_docs(tmp_path / "docs", [f"text {i} " * 30 for i in range(5)])
    cfg = _cfg(root, tmp_path / "cache", "--model.vocab_size=300")
    store = D.build_token_store(cfg, log=lambda m: None)
    tokens = np.asarray(store.tokens).copy()
    store.tokenizer_path.unlink()  # damaged: rebuilt on the next call

    def crash(self, path):
        path.write_text(self.tok.to_str()[:100])  # half a file, then the process dies
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(D.BPETokenizer, "save", crash)
        with pytest.raises(KeyboardInterrupt):
            D.build_token_store(cfg, log=lambda m: None)
    assert not [p.name for p in store.directory.iterdir() if p.name.endswith(".tmp")]  # no litter
    logs: list[str] = []
    again = D.build_token_store(cfg, log=logs.append)
    assert any("tokenizing" in m for m in logs), logs  # rebuilt, not taken as complete
    D.load_tokenizer(again.tokenizer_path)
    np.testing.assert_array_equal(np.asarray(again.tokens), tokens)


def test_a_cache_with_an_unreadable_tokenizer_is_rebuilt(tmp_path):
    """A half-written tokenizer.json (left by the old in-place write) counted as present."""
    root = _write_docs(tmp_path / "docs", [f"text {i} " * 30 for i in range(5)])
    cfg = _cfg(root, tmp_path / "cache", "--model.vocab_size=300")
    store = D.build_token_store(cfg, log=lambda m: None)
    store.tokenizer_path.write_text(store.tokenizer_path.read_text()[:100])
    logs: list[str] = []
    again = D.build_token_store(cfg, log=logs.append)
    assert any("damaged (tokenizer.json unreadable" in m for m in logs), logs
    assert D.load_tokenizer(again.tokenizer_path).vocab_size <= 300


def test_token_files_and_text_files_given_to_the_wrong_source_are_refused(tmp_path):
    """data.source=text (the default) on a nanoGPT train.bin trained a BPE on its bytes; tokens
    on a .txt read its bytes as uint16 ids (ASCII pairs are < 32,640: all pass a GPT-2 range
    check). Both name data.source and its values."""
    np.random.default_rng(0).integers(0, 50000, 2000).astype(np.uint16).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", np.arange(2000, dtype=np.uint16))
    (tmp_path / "corpus.txt").write_text("The quick brown fox jumps over the lazy dog. " * 100)
    for name in ("train.bin", "train.npy"):
        with pytest.raises(ConfigError, match=rf"data.path=.*{name}' is a token file .* set data.source=tokens "
                                              r".*\(data.source: text, tokens or synthetic\)"):
            D.make_dataset(_cfg(tmp_path / name, tmp_path / "cache"), log=lambda m: None)
    text_as_tokens = load_config(TINY, ["--data.source=tokens", f"--data.path={tmp_path / 'corpus.txt'}",
                                        "--model.vocab_size=50304", "--train.seq_len=16"])
    with pytest.raises(ConfigError, match=r"corpus.txt' is a text file \(.txt\), .* set data.source=text"):
        D.make_dataset(text_as_tokens, log=lambda m: None)
    # The documented pairs still work.
    assert D.make_dataset(_cfg(tmp_path / "corpus.txt", tmp_path / "cache", "--data.tokenizer=byte",
                               "--model.vocab_size=300"), log=lambda m: None).train.num_windows > 0
    as_tokens = ["--data.source=tokens", "--model.vocab_size=50304", "--train.seq_len=16", "--train.batch_size=2"]
    for name in ("train.bin", "train.npy"):
        cfg = load_config(TINY, [*as_tokens, f"--data.path={tmp_path / name}"])
        assert D.make_dataset(cfg, log=lambda m: None).train.num_windows == int(2000 * 0.95 - 1) // 16


@pytest.mark.parametrize("index, count", [(2, 2), (-1, 2), (0, 0)])
def test_a_process_index_outside_the_process_count_is_refused(tmp_path, index, count):
    """A launcher passing a 1-based rank (index == count) got the next batch's rows: windows
    that another process trains on too, with no error."""
    tokens = np.arange(1000, dtype=np.uint16)
    with pytest.raises(D.DataError, match=r"process_index=.* must be an integer in \[0, process_count="):
        D.Batches(tokens, 8, 4, 0, process_index=index, process_count=count)
    with pytest.raises(D.DataError, match=r"process_index=.* must be an integer in \[0, process_count="):
        D.SyntheticBatches(np.zeros(0), 8, 4, 0, index, count, vocab_size=16)
    np.save(tmp_path / "t.npy", tokens)
    cfg = load_config(TINY, ["--data.source=tokens", f"--data.path={tmp_path / 't.npy'}", "--train.seq_len=8",
                             "--train.batch_size=4", "--data.eval_fraction=0.2"])
    with pytest.raises(D.DataError, match=r"process_index="):
        D.make_dataset(cfg, process_index=index, process_count=count, log=lambda m: None)


def test_a_raw_bin_of_uint32_ids_for_a_uint16_vocabulary_is_refused(tmp_path):
    """GPT-2 ids saved as uint32 (a common pipeline's dtype) and read as uint16 for
    model.vocab_size=50304: (id, 0) pairs, all in range, so the model trained on them silently."""
    ids = np.random.default_rng(0).integers(0, 50257, 3000)
    ids.astype(np.uint32).tofile(tmp_path / "u32.bin")
    ids.astype(np.uint16).tofile(tmp_path / "u16.bin")
    args = ["--data.source=tokens", "--model.vocab_size=50304", "--train.seq_len=16", "--train.batch_size=2"]
    with pytest.raises(ConfigError, match=r"u32.bin': every second uint16 is 0, as in uint32 ids; a raw .bin holds uint16 "
                                          r"ids when model.vocab_size=50304 <= 65536"):
        D.make_dataset(load_config(TINY, [*args, f"--data.path={tmp_path / 'u32.bin'}"]), log=lambda m: None)
    data = D.make_dataset(load_config(TINY, [*args, f"--data.path={tmp_path / 'u16.bin'}"]), log=lambda m: None)
    np.testing.assert_array_equal(np.asarray(data.train.tokens), ids[: int(3000 * 0.95)])


def test_one_corpus_by_a_relative_an_absolute_or_a_home_path_is_one_cache_entry(tmp_path, monkeypatch):
    """`data.path` is resolved before it names and keys the cache: a relative and an absolute
    path to the same folder had two entries, `data.path=.` named its entry "-<key>", and
    `~/corpus` was not found. The tokens are the same whichever way the folder is named."""
    home = tmp_path / "home"
    corpus = home / "corpus"
    corpus.mkdir(parents=True)
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"document {i} " * 40)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(corpus)
    cache = tmp_path / "cache"
    stores = []
    for given in (str(corpus), ".", "~/corpus", "../corpus"):
        cfg = load_config(None, ["--data.tokenizer=byte", "--model.vocab_size=257", f"--data.path={given}",
                                 f"--data.cache_dir={cache}"])
        stores.append(D.build_token_store(cfg, log=lambda m: None))
    assert len({s.directory for s in stores}) == 1 and stores[0].directory.name.startswith("corpus-")
    assert all(np.array_equal(np.asarray(s.tokens), np.asarray(stores[0].tokens)) for s in stores)
    assert [p.name for p in cache.iterdir()] == [stores[0].directory.name]
