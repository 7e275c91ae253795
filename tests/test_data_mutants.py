"""The data loader against references written from its documented definitions.

scaling/data.py's docstrings define the data: documents joined with EOS and cut into windows of
seq_len + 1 tokens, consecutive windows sharing one token (window w is tokens[w*S : w*S + S + 1]);
a held-out tail of the token stream is the eval split; batch i of the training loader holds the
windows at flat positions [i*B, (i+1)*B) of the concatenated per-epoch permutations perm_e,
seeded by (seed, e), and process p of P takes rows [p*B/P, (p+1)*B/P). The references below
rebuild those windows with plain numpy loops, so a loader that resumed at the wrong place, reused
an epoch's order, or let a window into both splits disagrees with them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import scaling.data as D
from scaling.config import ConfigError, load_config

TINY = "configs/models/tiny.yaml"


# ----------------------------------------------------------------- references


def reference_windows(tokens: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Every window of seq_len + 1 tokens starting at a multiple of seq_len that fits."""
    out, start = [], 0
    while start + seq_len + 1 <= len(tokens):
        out.append(np.asarray(tokens[start : start + seq_len + 1], np.int64))
        start += seq_len
    return out


def reference_order(num_windows: int, seed: int, positions: int) -> list[int]:
    """The first `positions` window ids of the concatenated per-epoch permutations."""
    order: list[int] = []
    epoch = 0
    while len(order) < positions:
        order += np.random.default_rng((seed, epoch)).permutation(num_windows).tolist()
        epoch += 1
    return order[:positions]


def reference_batch(tokens, seq_len, global_batch, seed, index, process_index=0, process_count=1) -> np.ndarray:
    windows = reference_windows(tokens, seq_len)
    order = reference_order(len(windows), seed, (index + 1) * global_batch)
    rows = global_batch // process_count
    first = index * global_batch + process_index * rows
    return np.stack([windows[w] for w in order[first : first + rows]])


# Eight windows' worth of tokens exactly: 8*S tokens hold only 7 windows of S + 1, and a batch of
# 3 straddles each epoch boundary (7 is prime to 3), so many epochs are covered in a few batches.
S, B, SEED = 4, 3, 11
TOKENS = np.random.default_rng(5).integers(0, 1000, 8 * S).astype(np.uint16)


def test_batches_equal_the_documented_windows_over_several_epochs():
    assert len(reference_windows(TOKENS, S)) == 7
    loader = D.Batches(TOKENS, S, B, SEED)
    assert loader.num_windows == 7
    for i in range(12):  # 36 rows: five epochs and a part
        np.testing.assert_array_equal(next(loader), reference_batch(TOKENS, S, B, SEED, i), err_msg=f"batch {i}")


def test_each_epoch_visits_every_window_once_in_a_new_order():
    """Independent of the RNG: epoch e's rows are a permutation of all windows, and no two of
    the first four epochs share one order (a loader that reused epoch 0's order overfits it)."""
    windows = [tuple(w) for w in reference_windows(TOKENS, S)]
    loader = D.Batches(TOKENS, S, 7, SEED)  # one batch = one epoch
    epochs = [[tuple(row) for row in loader.batch(e)] for e in range(4)]
    for rows in epochs:
        assert sorted(rows) == sorted(windows)
    assert len({tuple(rows) for rows in epochs}) == 4


@pytest.mark.parametrize("process_count", [1, 3])
def test_resume_at_every_step_continues_the_uninterrupted_sequence(process_count):
    """A loader restored at step k (its state through JSON, as a checkpoint's meta stores it)
    yields batches k, k+1, ... of the definition, whichever epoch k falls in and whatever the
    process count; so does one restored after it had already walked into another epoch."""
    total, gb = 10, 3  # gb: the global batch; 3 processes take one row each
    for k in range(total):
        state = json.loads(json.dumps({"next_index": k}))
        parts = []
        for p in range(process_count):
            loader = D.Batches(TOKENS, S, gb, SEED, process_index=p, process_count=process_count)
            for _ in range(5):
                next(loader)  # its permutation cache now holds another epoch
            loader.restore(state)
            parts.append([next(loader) for _ in range(k, total)])
            assert loader.state() == {"next_index": total, "next_row": total * gb}
        for i, step in enumerate(range(k, total)):
            got = np.concatenate([part[i] for part in parts])
            np.testing.assert_array_equal(got, reference_batch(TOKENS, S, gb, SEED, step), err_msg=f"resumed at {k}, batch {step}")


@pytest.mark.parametrize("old_b, new_b", [(4, 6), (6, 4), (3, 3)])
def test_a_resume_with_another_batch_size_continues_after_the_last_window_trained_on(old_b, new_b):
    """The state was a batch index alone: a run resumed with batch size B_new started at window
    next_index * B_new and skipped (or repeated) windows. It carries on at the flat position
    after the last window of the old run now, batches of B_new from there."""
    windows = reference_windows(TOKENS, S)
    old = D.Batches(TOKENS, S, old_b, SEED)
    for _ in range(3):
        next(old)
    new = D.Batches(TOKENS, S, new_b, SEED)
    new.restore(json.loads(json.dumps(old.state())))
    first = 3 * old_b
    order = reference_order(len(windows), SEED, first + 2 * new_b)
    for i in range(2):
        want = np.stack([windows[w] for w in order[first + i * new_b : first + (i + 1) * new_b]])
        np.testing.assert_array_equal(next(new), want, err_msg=f"batch {i} after the resume")
    # A checkpoint from before next_row was kept: next_index batches of the current size.
    legacy = D.Batches(TOKENS, S, new_b, SEED)
    legacy.restore({"next_index": 3})
    np.testing.assert_array_equal(next(legacy), reference_batch(TOKENS, S, new_b, SEED, 3))
    with pytest.raises(D.DataError, match=r"next_row must be an integer >= 0"):
        legacy.restore({"next_index": 3, "next_row": -2})


def test_a_bad_loader_state_is_refused_naming_it():
    """A float index was truncated (3.7 -> batch 3) and a negative one failed inside numpy's RNG."""
    loader = D.Batches(TOKENS, S, B, SEED)
    for bad in ({"next_index": 3.7}, {"next_index": -1}, {"next_index": "3"}, {"next_index": True}, {}, None):
        with pytest.raises(D.DataError, match=r"next_index must be an integer >= 0"):
            loader.restore(bad)
    loader.restore({"next_index": np.int64(4)})
    np.testing.assert_array_equal(next(loader), reference_batch(TOKENS, S, B, SEED, 4))


def test_too_short_and_indivisible_loaders_are_refused():
    with pytest.raises(D.DataError, match=r"8 tokens are fewer than one sequence of train.seq_len=8 \+ 1"):
        D.Batches(np.arange(8), 8, 1, 0)
    with pytest.raises(D.DataError, match=r"train.batch_size=3 is not divisible by the 2 processes"):
        D.Batches(TOKENS, S, 3, 0, process_index=0, process_count=2)


# ------------------------------------------------------------ train / held-out


def _tokens_cfg(path, *extra):
    return load_config(TINY, ["--data.source=tokens", f"--data.path={path}", *extra])


def _positions(rows: np.ndarray) -> set[int]:
    return set(np.asarray(rows).ravel().tolist())


def test_no_window_is_in_both_splits_and_held_out_windows_count_once(tmp_path):
    """Tokens equal to their positions, so a window's tokens name the positions it reads. The
    last train window ends exactly at the token before the held-out tail (321 = 40*8 + 1), the
    tightest case: one token more on either side would put a position in both splits."""
    n, s, b = 642, 8, 4
    np.save(tmp_path / "t.npy", np.arange(n, dtype=np.uint16))
    cfg = _tokens_cfg(tmp_path / "t.npy", f"--train.seq_len={s}", f"--train.batch_size={b}", "--data.eval_fraction=0.5")
    data = D.make_dataset(cfg, log=lambda m: None)
    eval_start = 321
    assert abs((n - eval_start) - n * 0.5) < 1  # the held-out share of the tokens

    train_windows = reference_windows(np.arange(eval_start), s)
    held_windows = reference_windows(np.arange(eval_start, n), s)
    assert data.train.num_windows == len(train_windows) == 40 and train_windows[-1][-1] == eval_start - 1
    seen = set()
    for i in range(len(train_windows) // b):
        seen |= _positions(data.train.batch(i))
    assert seen == set(range(eval_start))  # one epoch of train reads exactly the train split
    # Eval walks the tail in order from its start; its batches (as train._evaluate takes them,
    # windows // B of them) hold each held-out window once.
    assert data.eval.num_windows == len(held_windows) == 40
    rows = np.concatenate([data.eval.batch(i) for i in range(len(held_windows) // b)])
    np.testing.assert_array_equal(rows, np.stack(held_windows))
    assert not _positions(rows) & seen


def test_held_out_refusal_counts_whole_windows(tmp_path):
    """A tail of exactly B*S tokens holds B - 1 windows of S + 1: one eval batch would wrap and
    count a window twice, so it is refused; B - 1 is one batch. With batch size 1 a single
    held-out window is an eval batch (not dropped)."""
    np.save(tmp_path / "t.npy", np.arange(256, dtype=np.uint16))
    args = ["--train.seq_len=16", "--data.eval_fraction=0.5"]  # tail: 128 tokens = 8 * 16 -> 7 windows
    with pytest.raises(ConfigError, match=r"holds 7 windows of train.seq_len=16 \+ 1, fewer than one eval batch of train.batch_size=8"):
        D.make_dataset(_tokens_cfg(tmp_path / "t.npy", *args, "--train.batch_size=8"), log=lambda m: None)
    data = D.make_dataset(_tokens_cfg(tmp_path / "t.npy", *args, "--train.batch_size=7"), log=lambda m: None)
    assert data.eval.num_windows == 7 and len(_positions(data.eval.batch(0))) == 7 * 16 + 1
    np.save(tmp_path / "one.npy", np.arange(40, dtype=np.uint16))  # tail: 20 tokens -> one window of 17
    data = D.make_dataset(_tokens_cfg(tmp_path / "one.npy", *args, "--train.batch_size=1"), log=lambda m: None)
    assert data.eval is not None and data.eval.num_windows == 1
    np.testing.assert_array_equal(data.eval.batch(0)[0], np.arange(20, 37))


def test_train_seed_orders_the_windows(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(1000, dtype=np.uint16))
    firsts = []
    for seed in (0, 1):
        cfg = _tokens_cfg(tmp_path / "t.npy", "--train.seq_len=8", "--train.batch_size=4", f"--train.seed={seed}")
        loader = D.make_dataset(cfg, log=lambda m: None).train
        np.testing.assert_array_equal(loader.batch(3), reference_batch(np.asarray(loader.tokens), 8, 4, seed, 3))
        firsts.append(loader.batch(0).tolist())
    assert firsts[0] != firsts[1]


def test_processes_rows_of_both_splits_make_the_global_batch(tmp_path):
    """Each of 2 processes builds its half of every train and eval batch; together they are the
    one-process batch (an eval split each process read from its start would repeat rows)."""
    np.save(tmp_path / "t.npy", np.arange(1000, dtype=np.uint16))
    cfg = _tokens_cfg(tmp_path / "t.npy", "--train.seq_len=8", "--train.batch_size=4", "--data.eval_fraction=0.2")
    whole = D.make_dataset(cfg, log=lambda m: None)
    parts = [D.make_dataset(cfg, process_index=p, process_count=2, log=lambda m: None) for p in (0, 1)]
    for i in (0, 3):
        np.testing.assert_array_equal(np.concatenate([d.train.batch(i) for d in parts]), whole.train.batch(i))
        np.testing.assert_array_equal(np.concatenate([d.eval.batch(i) for d in parts]), whole.eval.batch(i))
    np.testing.assert_array_equal(whole.eval.batch(1)[:, 0], 800 + 8 * np.arange(4, 8))

# ----------------------------------------------------------------- token files


def test_range_error_names_the_position_in_the_whole_file(monkeypatch):
    """The file is read in chunks; the reported position is the file's, not the chunk's."""
    monkeypatch.setattr(D, "RANGE_CHECK_CHUNK", 100)
    tokens = np.arange(1000) % 50
    tokens[357] = 99
    with pytest.raises(D.DataError, match=r"token id 99 at position 357 is outside \[0, model.vocab_size=50\)"):
        D.check_token_range(tokens, 50, "x")
    tokens[357] = 0
    tokens[400] = 50  # a chunk's first token
    with pytest.raises(D.DataError, match=r"token id 50 at position 400 "):
        D.check_token_range(tokens, 50, "x")


def test_raw_bin_of_a_65536_token_vocabulary_is_uint16(tmp_path):
    """Ids 0..65535 fit in uint16, nanoGPT's format for such a vocabulary."""
    ids = np.array([0, 65535, 7, 3] * 50, np.uint16)
    ids.tofile(tmp_path / "v.bin")
    cfg = _tokens_cfg(tmp_path / "v.bin", "--model.vocab_size=65536", "--train.seq_len=8", "--train.batch_size=2")
    np.testing.assert_array_equal(np.asarray(D.load_token_file(cfg).tokens), ids)


def test_a_token_array_that_is_not_flat_is_refused(tmp_path):
    np.save(tmp_path / "2d.npy", np.zeros((2, 50), np.uint16))
    with pytest.raises(ConfigError, match=r"2d.npy': expected a flat token array, got shape \(2, 50\)"):
        D.make_dataset(_tokens_cfg(tmp_path / "2d.npy"), log=lambda m: None)

# ---------------------------------------------------------------- text corpora


def _byte_corpus(tmp_path, n_docs=20):
    root = tmp_path / "docs"
    root.mkdir()
    docs = {f"d{i:02d}.txt": f"document {i:02d} " + "xyz " * (5 + i) for i in range(n_docs)}
    for name, text in docs.items():
        (root / name).write_text(text)
    return root, docs


def _byte_cfg(root, cache, *extra):
    return load_config(TINY, [f"--data.path={root}", f"--data.cache_dir={cache}", "--data.tokenizer=byte",
                              "--model.vocab_size=300", "--train.seq_len=16", *extra])


def test_byte_corpus_is_shuffled_documents_each_ended_by_eos(tmp_path):
    root, docs = _byte_corpus(tmp_path)
    store = D.build_token_store(_byte_cfg(root, tmp_path / "cache"), log=lambda m: None)
    toks = np.asarray(store.tokens)
    assert store.eos_id == 256 and toks[-1] == 256
    ends = np.flatnonzero(toks == 256)
    starts = np.concatenate([[0], ends[:-1] + 1])
    pieces = [bytes(toks[a:b].astype(np.uint8)).decode() for a, b in zip(starts, ends)]
    assert sorted(pieces) == sorted(docs.values())
    assert pieces != [docs[k] for k in sorted(docs)]  # shuffled: the tail is not the last files
    # The held-out tail is the eval_fraction share of the tokens.
    assert abs(len(store.split("eval")) - 0.05 * len(toks)) < 1
    assert len(store.split("train")) + len(store.split("eval")) == len(toks)


def test_eval_fraction_change_is_a_new_cache_entry(tmp_path):
    """The split is stored in the cache's meta: a changed data.eval_fraction must not reuse it."""
    root, _ = _byte_corpus(tmp_path)
    a = D.build_token_store(_byte_cfg(root, tmp_path / "cache"), log=lambda m: None)
    b = D.build_token_store(_byte_cfg(root, tmp_path / "cache", "--data.eval_fraction=0.5"), log=lambda m: None)
    n = len(a.tokens)
    assert len(b.tokens) == n and a.directory != b.directory
    assert abs(len(a.split("eval")) - 0.05 * n) < 1 and abs(len(b.split("eval")) - 0.5 * n) < 1


def test_default_corpus_is_a_sorted_prefix_within_the_cap():
    files = D.default_corpus_files(0.05)
    sizes = [p.stat().st_size for p in files]
    assert files and files == sorted(files) and sum(sizes) <= 0.05e6
    every = D.default_corpus_files(1e9)
    assert every[: len(files)] == files  # a prefix: stops at the first file that would not fit
    assert sum(sizes) + every[len(files)].stat().st_size > 0.05e6


def test_byte_decode_drops_eos_and_entropy_ignores_unseen_ids():
    tok = D.ByteTokenizer()
    assert tok.decode([104, 105, 256, 33]) == "hi!"
    # H = -(2/3 ln 2/3 + 1/3 ln 1/3) for ids {0, 0, 1} in a vocabulary of 5 (three unseen ids).
    assert D.unigram_entropy(np.array([0, 0, 1]), 5) == pytest.approx(np.log(3) - 2 / 3 * np.log(2), rel=1e-12)


# ------------------------------------------------------------------- synthetic


def test_synthetic_process_rows_eval_stream_and_id_range():
    cfg = load_config(TINY, ["--data.source=synthetic", "--train.batch_size=6", "--train.seq_len=8", "--model.vocab_size=4"])
    whole = D.make_dataset(cfg)
    parts = [D.make_dataset(cfg, process_index=p, process_count=3) for p in range(3)]
    for i in (0, 5):
        np.testing.assert_array_equal(np.concatenate([d.train.batch(i) for d in parts]), whole.train.batch(i))
    assert not np.array_equal(whole.eval.batch(0), whole.train.batch(0))  # held-out draws, not train's
    ids = np.concatenate([whole.train.batch(i).ravel() for i in range(10)])
    assert set(ids.tolist()) == {0, 1, 2, 3}  # uniform over the whole vocabulary
