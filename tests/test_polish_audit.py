"""Open points of earlier audits of data, optim and the attention API, each against an independent
reference: file lists and byte counts written out by hand, float64 numpy norms and attention."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaling.data as D
from scaling import attention
from scaling.config import AttentionImpl, OptimizerConfig, Schedule, load_config
from scaling.kernels import attention_reference
from scaling.optim import global_norm, make_optimizer
from test_attention_api_audit import _numpy_attention, _qkv

TINY = "configs/models/tiny.yaml"


def _byte_cfg(root, cache):
    return load_config(TINY, [f"--data.path={root}", f"--data.cache_dir={cache}", "--data.tokenizer=byte",
                              "--model.vocab_size=300", "--train.seq_len=16", "--train.batch_size=2"])


def _documents(store) -> list[str]:
    """The byte-tokenized stream split at EOS, decoded (every document ends with one)."""
    tokens = np.asarray(store.tokens)
    ends = np.flatnonzero(tokens == store.eos_id)
    return [bytes(p[:-1].tolist()).decode("utf-8") for p in np.split(tokens, ends + 1)[:-1]]


def _linked_corpus(tmp_path):
    """corpus/ of links: a folder linked twice, a link to the corpus itself (a cycle), a linked
    file and a file of its own. Returns the corpus and the texts it should be read as."""
    texts = {"one/a.txt": "alpha " * 30, "one/sub/b.md": "beta " * 30, "two/c.txt": "gamma " * 30, "own.txt": "delta " * 30}
    for rel, text in texts.items():
        where = (tmp_path / "datasets" if rel != "own.txt" else tmp_path / "corpus") / rel
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(text)
    corpus = tmp_path / "corpus"
    os.symlink(tmp_path / "datasets" / "one", corpus / "ds1")
    os.symlink(tmp_path / "datasets" / "one", corpus / "ds2")  # the same dataset again: read once
    os.symlink(corpus, corpus / "loop")  # cycles: must end (two of them double the walk per level)
    os.symlink(corpus, tmp_path / "datasets" / "one" / "sub" / "up")
    os.symlink(tmp_path / "datasets" / "two" / "c.txt", corpus / "c.txt")
    os.symlink(tmp_path / "datasets" / "one" / "a.txt", corpus / "again.txt")  # a file met twice: read once
    return corpus, texts


def test_symlinked_dataset_folders_are_read_once_and_a_cycle_ends(tmp_path, monkeypatch):
    """os.walk did not follow links, so a corpus folder of links to datasets lost every linked
    folder (here one file of four), silently. Followed now; a folder or file linked twice and the
    links back to the corpus are read once, as the first path of a sorted walk (a folder's files
    before its subfolders)."""
    corpus, texts = _linked_corpus(tmp_path)
    walk, visited = os.walk, []

    def counted_walk(*args, **kwargs):  # a walk that loops fails here, not by hanging
        for entry in walk(*args, **kwargs):
            visited.append(entry[0])
            assert len(visited) < 50, visited[-5:]
            yield entry

    monkeypatch.setattr(os, "walk", counted_walk)
    want = [corpus / "again.txt", corpus / "c.txt", corpus / "ds1" / "sub" / "b.md", corpus / "own.txt"]
    assert D.text_files(corpus) == want
    store = D.build_token_store(_byte_cfg(corpus, tmp_path / "cache"), log=lambda m: None)
    assert sorted(_documents(store)) == sorted(texts.values())


def test_a_changed_or_retargeted_linked_file_is_a_new_cache_entry(tmp_path):
    """The key reads a linked file's own size and mtime (through the link), and its real path: a
    link to a file or a folder moved to a copy of the same sizes and mtimes (rsync -a, cp -p) but
    other text would have kept the old tokens."""
    corpus, texts = _linked_corpus(tmp_path)
    cache, quiet = tmp_path / "cache", (lambda m: None)
    first = D.build_token_store(_byte_cfg(corpus, cache), log=quiet)
    (tmp_path / "datasets" / "one" / "a.txt").write_text("changed " * 30)  # inside a linked folder
    second = D.build_token_store(_byte_cfg(corpus, cache), log=quiet)
    assert second.directory != first.directory and "changed " * 30 in _documents(second)
    old = tmp_path / "datasets" / "two" / "c.txt"
    new = tmp_path / "datasets" / "two" / "copy.txt"
    new.write_text("GAMMA " * 30)  # same size, same mtime, other text
    os.utime(new, ns=(old.stat().st_atime_ns, old.stat().st_mtime_ns))
    (corpus / "c.txt").unlink()
    os.symlink(new, corpus / "c.txt")
    third = D.build_token_store(_byte_cfg(corpus, cache), log=quiet)
    assert third.directory != second.directory
    assert "GAMMA " * 30 in _documents(third) and texts["two/c.txt"] not in _documents(third)
    # a linked folder moved to a copy of it (same names, sizes and mtimes), one file's text changed
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "x.txt").write_text("version one " * 20)
    shutil.copytree(tmp_path / "v1", tmp_path / "v2")  # (copy2: the mtimes too)
    (tmp_path / "v2" / "x.txt").write_text("version two " * 20)
    os.utime(tmp_path / "v2" / "x.txt", ns=(0, (tmp_path / "v1" / "x.txt").stat().st_mtime_ns))
    (tmp_path / "c2").mkdir()
    os.symlink(tmp_path / "v1", tmp_path / "c2" / "ds")
    before = D.build_token_store(_byte_cfg(tmp_path / "c2", cache), log=quiet)
    (tmp_path / "c2" / "ds").unlink()
    os.symlink(tmp_path / "v2", tmp_path / "c2" / "ds")
    after = D.build_token_store(_byte_cfg(tmp_path / "c2", cache), log=quiet)
    assert after.directory != before.directory and _documents(after) == ["version two " * 20]


def test_a_broken_link_is_named_and_the_rest_is_read(tmp_path):
    """A link to an unmounted dataset was skipped without a word."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("alpha " * 30)
    os.symlink(tmp_path / "gone", corpus / "ds")
    logs: list[str] = []
    assert D.text_files(corpus, log=logs.append) == [corpus / "a.txt"]
    assert logs == [f"data: 1 broken symlink(s) under data.path={str(corpus)!r} left out "
                    f"(first: {corpus / 'ds'} -> {tmp_path / 'gone'})"]


def test_bytes_that_are_not_utf8_are_counted_and_the_first_file_named(tmp_path):
    """Invalid UTF-8 became U+FFFD silently. The text is still decoded as before; a log line says
    how many bytes in how many files, naming the first (counted in bytes: a truncated 3-byte
    character is 2 bytes but one U+FFFD)."""
    root = tmp_path / "docs"
    root.mkdir()
    raw = {"a.txt": "caf\u00e9 au lait ".encode("latin-1") * 3,  # 3 lone 0xe9 bytes
           "b.txt": "valid caf\u00e9 \ufffd text ".encode() * 3,  # valid, U+FFFD spelt out included
           "c.txt": b"\xff\xfe header " + b"words " * 10 + b"\xe2\x82"}  # 2 bytes + a truncated char (2)
    for name, data in raw.items():
        (root / name).write_bytes(data)
    logs: list[str] = []
    docs = D.read_documents(D.text_files(root), log=logs.append)
    assert docs == [data.decode("utf-8", errors="replace") for data in raw.values()]
    assert logs == [f"data: 2 of 3 files are not valid UTF-8; 7 bytes were replaced by U+FFFD (first: {root / 'a.txt'})"]
    logs.clear()
    D.build_token_store(_byte_cfg(root, tmp_path / "cache"), log=logs.append)
    assert any("7 bytes were replaced by U+FFFD" in m for m in logs), logs


@pytest.mark.parametrize("dtype,big", [(jnp.bfloat16, 1.0), (jnp.float16, 300.0)])
def test_clip_norm_of_half_precision_grads_is_float32(dtype, big):
    """The global clip norm of bf16 grads was summed and rounded in bf16 (0.26% off here) and the
    grads divided in bf16; f16 grads with an entry of 300 squared it to inf and clipped the step
    to zeros. The clipped grads are read back through Adam with b1 = b2 = 0 and a huge eps
    (update = -lr g / (|g| + eps)): each must be the float64 clip rounded once to the grads'
    dtype, up to the float32 norm's own error (1e-5: XLA's f32 sums, unoptimised, are 1.6e-6 off)."""
    rng = np.random.default_rng(0)
    g64 = [rng.standard_normal(s) * (1 + i) for i, s in enumerate([(64, 48), (48,), (3, 32, 16)])]
    g64[1][0] = big
    grads = [jnp.asarray(x, dtype) for x in g64]
    given = [np.asarray(x, np.float64) for x in grads]  # the grads as given, in float64
    norm = np.sqrt(sum((x * x).sum() for x in given))
    np.testing.assert_allclose(float(global_norm(grads)), norm, rtol=1e-5)
    assert global_norm(grads).dtype == jnp.float32
    clip, eps = 1.0, 1e6
    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=0, schedule=Schedule.constant, b1=0.0, b2=0.0, eps=eps,
                          weight_decay=0.0, clip_norm=clip)
    params = [jnp.zeros(x.shape, jnp.float32) for x in grads]
    tx = make_optimizer(cfg, 10)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    fi = jnp.finfo(dtype)
    for u, x in zip(updates, given):
        exact = x * clip / norm
        got = -np.asarray(u, np.float64) * (eps + np.abs(exact))
        # the spacing of `dtype` at each value (subnormals included): a correct rounding is within half of it
        ulp = np.maximum(float(fi.eps) * 2.0 ** np.floor(np.log2(np.maximum(np.abs(exact), float(fi.tiny)))),
                         float(fi.tiny) * float(fi.eps))
        excess = np.abs(got - exact) - (ulp / 2 + 1e-5 * np.abs(exact))
        assert excess.max() <= 0, f"{(excess > 0).sum()} of {x.size} clipped grads are not the f64 clip rounded once"


@pytest.mark.parametrize("impl", [AttentionImpl.xla, AttentionImpl.auto])
def test_xla_core_keeps_float64_under_x64(impl):
    """Under jax_enable_x64 the xla core (so `auto` off GPU) computed float64 inputs' scores and
    output in f32 (1e-7 off); now in float64, like the reference, against float64 numpy."""
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in _qkv(b=2, t=6, s=6, h=4, kv=2, d=8))
        seg = jnp.asarray([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]], jnp.int32)
        for causal, ids in ((True, None), (False, seg)):
            out = attention.attention_core(impl)(q, k, v, causal=causal, segment_ids=ids)
            assert out.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(out), _numpy_attention(q, k, v, causal=causal, q_seg=ids, kv_seg=ids),
                                       atol=1e-12, rtol=0)


@pytest.mark.parametrize("core", [attention.xla_attention, attention.pallas_attention, attention.auto_attention,
                                  attention_reference], ids=["xla", "pallas", "auto", "reference"])
@pytest.mark.parametrize("ids", [[[0, 0, 1, 1], [0, 1, 1, 1]], ([0, 0, 1, 1], [0, 1, 1, 1]), [[0, 0, 1, 1]], 3])
def test_segment_ids_that_are_not_arrays_are_refused_naming_them(core, ids):
    """A nested list of ids (B=2) was read as a (q, kv) pair and refused as "q_segment_ids must
    have shape [B, T]=(2, 4), got None"; a bare int read the same."""
    q, k, v = _qkv(b=2, t=4, s=4)
    with pytest.raises(TypeError, match=r"segment_ids must be None, one integer array \[B, T\] or a \(q \[B, T\], "
                                        r"kv \[B, S\]\) pair of arrays, got (a list of list|a tuple of list|int)"):
        core(q, k, v, causal=True, segment_ids=ids)


def test_weight_decay_of_a_bare_matrix():
    """make_optimizer on one array (no dict around it: a quick experiment) failed in decay_mask with
    an IndexError (the path has no key). A matrix is decayed: zero grads leave p (1 - lr wd)."""
    lr, wd = 0.1, 0.5
    cfg = OptimizerConfig(learning_rate=lr, warmup_steps=0, schedule=Schedule.constant, weight_decay=wd)
    p = jnp.asarray(np.arange(6.0).reshape(2, 3), jnp.float32)
    tx = make_optimizer(cfg, 10)
    updates, _ = tx.update(jnp.zeros_like(p), tx.init(p), p)
    np.testing.assert_allclose(np.asarray(optax.apply_updates(p, updates)), np.arange(6.0).reshape(2, 3) * (1 - lr * wd),
                               rtol=1e-6)


def test_suffixes_are_matched_in_any_case(tmp_path):
    """README.TXT and notes.Md were left out of a corpus without a word, and ids.NPY was read as a
    raw .bin: its header as ids, int64 ids as uint16 pairs."""
    root = tmp_path / "docs"
    root.mkdir()
    for name in ("A.TXT", "b.Md", "c.txt", "d.dat"):
        (root / name).write_text(f"{name} " * 20)
    assert D.text_files(root) == [root / "A.TXT", root / "b.Md", root / "c.txt"]
    ids = np.arange(500, dtype=np.int64) % 300
    np.save(tmp_path / "ids.npy", ids)
    os.replace(tmp_path / "ids.npy", tmp_path / "ids.NPY")
    cfg = load_config(TINY, [f"--data.path={tmp_path / 'ids.NPY'}", "--data.source=tokens", "--model.vocab_size=300"])
    np.testing.assert_array_equal(np.asarray(D.load_token_file(cfg).tokens), ids)
    with pytest.raises(D.DataError, match=r"ids.NPY' is a token file \(.NPY\), but data.source=text"):
        D.text_files(tmp_path / "ids.NPY")
