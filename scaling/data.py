"""Corpus -> tokens -> packed sequences -> per-process batches.

Text is tokenized once and stored as a flat memory-mapped token file under
`data.cache_dir`, keyed by a hash of the corpus identity and the tokenizer settings.
Documents are joined with EOS separators and cut into windows of seq_len + 1 tokens
(input and shifted target share seq_len of them). A held-out tail of the token stream
is the eval split.

The loader's position is the flat index of the next window in a seeded order of all windows
(per-epoch permutations seeded by (seed, epoch)), so resuming means restoring one integer
(`next_row`; a checkpoint also keeps the batch count). Each process builds only its own rows of
the global batch (multi-host ready).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import os
import re
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from scaling.config import Config, ConfigError, DataSource, TokenizerKind

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".html", ".tex", ".csv"}
TOKEN_SUFFIXES = {".npy", ".bin"}  # what data.source=tokens reads
DATA_SEED = 1234  # document shuffle before packing; part of the cache key
RANGE_CHECK_CHUNK = 1 << 24  # tokens per read when checking a token file's ids
# Characters of text encoded per call when building a token cache: bounds the memory of the ids
# (Python lists, ~30 bytes a token) and gives a progress line per chunk on a large corpus.
ENCODE_CHUNK_CHARS = 1 << 24


class DataError(ConfigError):
    """The data a config points at is missing, empty, malformed or does not fit the model.

    A ConfigError (and so a ValueError): `python -m scaling` prints the message, which names
    the config field, without a traceback and exits 2."""


# --------------------------------------------------------------------------- corpus


def default_corpus_files(max_mb: float) -> list[Path]:
    """The embedded default corpus: this Python's standard-library sources.

    Present on every machine with no download; real text (code and docstrings) with a
    real vocabulary. Files in sorted order, up to `max_mb` megabytes.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    out, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > max_mb * 1e6:
            break
        out.append(p)
        total += size
    if files and not out:  # (else: "every file is empty (0 files)", which points nowhere)
        raise DataError(f"data.max_corpus_mb={max_mb} holds none of the default corpus: its first file, "
                        f"{files[0]}, is {files[0].stat().st_size / 1e6:.3g} MB; raise data.max_corpus_mb")
    return out


def text_files(path: Path, exclude: Path | None = None, log=None) -> list[Path]:
    """A file, or a directory's text files (by suffix, in any case), leaving out hidden files and folders
    (`.git`, `.venv`, ...) and everything under `exclude` (the token cache: its own
    tokenizer.json would otherwise join the corpus and change its key on every run).

    Symlinked folders and files are followed (a corpus folder of links to datasets was read as
    empty). Each real folder and file is read once, the first met in a sorted walk: a link cycle
    ends, and a dataset linked twice is not trained on twice (nor split across train and eval).
    Broken links are left out, and `log` says so."""
    if path.is_file():
        if path.suffix.lower() in TOKEN_SUFFIXES:  # (read as text it trained a BPE on binary garbage)
            raise DataError(f"data.path={str(path)!r} is a token file ({path.suffix}), but data.source=text tokenizes "
                            f"text; set data.source=tokens to train on its ids (data.source: text, tokens or synthetic)")
        return [path]
    if path.is_dir():
        skip = exclude.resolve() if exclude is not None else None
        files, seen_dirs, seen_files, broken = [], set(), set(), []
        for root, dirs, names in os.walk(path, followlinks=True):  # (pruned: a .venv is never walked)
            st = os.stat(root)
            if (st.st_dev, st.st_ino) in seen_dirs:  # a cycle, or a folder already read by another path
                dirs[:] = []
                continue
            seen_dirs.add((st.st_dev, st.st_ino))
            dirs[:] = sorted(x for x in dirs if not x.startswith(".") and (skip is None or Path(root, x).resolve() != skip))
            for n in sorted(names):
                f = Path(root, n)
                if n.startswith("."):
                    continue
                if f.is_symlink() and not f.exists():  # (os.walk lists a dangling link among the files)
                    broken.append(f)
                elif f.suffix.lower() in TEXT_SUFFIXES and f.is_file():  # (README.TXT was skipped silently)
                    fst = f.stat()
                    if (fst.st_dev, fst.st_ino) not in seen_files:
                        seen_files.add((fst.st_dev, fst.st_ino))
                        files.append(f)
        if broken and log is not None:
            log(f"data: {len(broken)} broken symlink(s) under data.path={str(path)!r} left out "
                f"(first: {broken[0]} -> {os.readlink(broken[0])})")
        if files:
            return sorted(files)
        raise DataError(f"data.path={str(path)!r} holds no text files (suffixes {sorted(TEXT_SUFFIXES)})")
    raise DataError(f"data.path={str(path)!r} does not exist")


_ESCAPED_BYTE = re.compile(r"[\udc80-\udcff]")  # what surrogateescape makes of one undecodable byte


def read_documents(files: list[Path], log=None) -> list[str]:
    """Each file's text. Bytes that are not UTF-8 become U+FFFD, and `log` says how many, in how
    many files, naming the first (they had been replaced silently). Valid files are decoded once,
    as before; only a file that fails is read again, to count its bad bytes."""
    docs, bad_files, bad_bytes = [], [], 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            text = p.read_text(encoding="utf-8", errors="replace")
            # surrogateescape maps each undecodable byte to one lone surrogate, which valid UTF-8 never gives
            escaped = p.read_bytes().decode("utf-8", errors="surrogateescape")
            bad_files.append(p)
            bad_bytes += len(escaped) - len(_ESCAPED_BYTE.sub("", escaped))
        if text.strip():
            docs.append(text)
    if bad_files and log is not None:
        log(f"data: {len(bad_files)} of {len(files)} files are not valid UTF-8; {bad_bytes:,} bytes were replaced "
            f"by U+FFFD (first: {bad_files[0]})")
    return docs


# ------------------------------------------------------------------------ tokenizer


class ByteTokenizer:
    """UTF-8 bytes 0..255, EOS = 256."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"kind": "byte"}))


class BPETokenizer:
    """Byte-level BPE from HF `tokenizers` (GPT-2's pre-tokenization), EOS = <|eos|>."""

    EOS = "<|eos|>"

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.token_to_id(self.EOS)
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, docs: list[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[cls.EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(docs, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def save(self, path: Path) -> None:
        self.tok.save(str(path))


def load_tokenizer(path: Path):
    text = Path(path).read_text()
    if json.loads(text).get("kind") == "byte":
        return ByteTokenizer()
    return BPETokenizer.load(Path(path))


# ---------------------------------------------------------------------- token store


@dataclasses.dataclass(frozen=True)
class TokenStore:
    """A tokenized corpus on disk: tokens.bin (flat, memory-mapped) + tokenizer.json."""

    directory: Path
    tokens: np.ndarray  # memmap, 1-D
    eos_id: int
    vocab_size: int
    eval_start: int  # tokens[eval_start:] is the held-out split

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / "tokenizer.json"

    def split(self, name: str) -> np.ndarray:
        return self.tokens[: self.eval_start] if name == "train" else self.tokens[self.eval_start :]


@contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    """A fresh temporary path beside `path` to write; on success it is synced and replaces `path`
    (never a half-written file under the real name), on an error it is removed. Unique per call
    (a uuid: a pid alone repeats across hosts sharing a cache), so no two writers share one."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # on disk before meta.json, written last, says the entry is complete
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    with _atomic_path(path) as tmp:
        tmp.write_bytes(data)


def _corpus_key(cfg: Config, files: list[Path]) -> str:
    d = cfg.data
    h = hashlib.sha256()
    real_dirs: dict[Path, Path] = {}  # (one resolve per folder, not per file: the key is computed every run)
    for p in files:
        st = p.stat()  # (through links: a linked file's own size and mtime)
        # (ns: whole seconds kept a file rewritten at the same size within a second on the old tokens)
        line = f"{p}|{st.st_size}|{st.st_mtime_ns}"
        if p.parent not in real_dirs:
            real_dirs[p.parent] = p.parent.resolve()
        real = p.resolve() if p.is_symlink() else real_dirs[p.parent] / p.name
        if real != p:  # a link moved to another file of the same size and mtime (rsync -a, cp -p) is new text
            line += f"|{real}"
        h.update(f"{line}\n".encode())
    h.update(f"{d.tokenizer.value}|{cfg.model.vocab_size}|{d.eval_fraction}|{DATA_SEED}|v2".encode())
    return h.hexdigest()[:16]


def build_token_store(cfg: Config, log=print) -> TokenStore:
    """Tokenize and pack the text corpus once; later calls memory-map the cached file."""
    d = cfg.data
    # Absolute, `~` expanded: a relative and an absolute path to the same files had two cache
    # entries, `data.path=.` named its entry "-<key>", and "~/corpus" was a missing folder.
    source = None if d.path is None else Path(d.path).expanduser().resolve()
    cache = Path(d.cache_dir).expanduser()
    files = default_corpus_files(d.max_corpus_mb) if source is None else text_files(source, cache, log)
    directory = cache / f"{'stdlib' if source is None else source.name or 'root'}-{_corpus_key(cfg, files)}"
    meta_path = directory / "meta.json"
    damage = _cache_damage(directory) if meta_path.exists() else None
    if damage:
        log(f"data: the token cache {directory} is damaged ({damage}); tokenizing again")
    if not meta_path.exists() or damage:
        directory.mkdir(parents=True, exist_ok=True)
        if damage:  # incomplete while rebuilt: a crash must not leave it marked complete
            meta_path.unlink(missing_ok=True)
        what = f"Python {sys.version.split()[0]} stdlib sources" if d.path is None else d.path
        log(f"data: tokenizing {len(files)} files from {what} into {directory} (once)")
        docs = read_documents(files, log)
        if not docs:
            where = f"data.path={d.path!r}" if d.path is not None else "the default corpus"
            raise DataError(f"{where}: every file is empty or whitespace ({len(files)} files); no text to train on")
        # Shuffle documents so the held-out tail is not one corner of the corpus.
        order = np.random.default_rng(DATA_SEED).permutation(len(docs))
        docs = [docs[i] for i in order]
        if d.tokenizer == TokenizerKind.byte:
            tok = ByteTokenizer()
        else:
            log(f"data: training a byte-level BPE of {cfg.model.vocab_size:,} tokens on {len(docs):,} documents")
            tok = BPETokenizer.train(docs, cfg.model.vocab_size)
            # The text "<|eos|>" inside a document is text: matched as the special token it put a
            # document boundary mid-document, and decoding the stream dropped it.
            tok.tok.encode_special_tokens = True  # (not saved in tokenizer.json)
        if tok.vocab_size > cfg.model.vocab_size:
            raise DataError(f"tokenizer has {tok.vocab_size} tokens > model.vocab_size={cfg.model.vocab_size}")
        dtype = np.uint16 if cfg.model.vocab_size <= 2**16 else np.uint32
        with _atomic_path(directory / "tokenizer.json") as tmp:
            tok.save(tmp)
        with _atomic_path(directory / "tokens.bin") as tmp:
            num_tokens = _encode_to_file(tok, docs, tmp, dtype, log)
        meta = {
            "num_tokens": num_tokens,
            "dtype": np.dtype(dtype).name,
            "eos_id": int(tok.eos_id),
            "vocab_size": int(tok.vocab_size),
            "eval_start": int(num_tokens * (1 - d.eval_fraction)),
            "num_documents": len(docs),
            "source": what,
        }
        _atomic_write_bytes(meta_path, json.dumps(meta, indent=1).encode())  # written last: marks completion
    meta = json.loads(meta_path.read_text())
    tokens = np.memmap(directory / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))
    return TokenStore(directory, tokens, meta["eos_id"], meta["vocab_size"], meta["eval_start"])


def _encode_to_file(tok, docs: list[str], path: Path, dtype, log) -> int:
    """Write the documents' ids, each document followed by EOS, to `path`; return the count.
    A chunk of ENCODE_CHUNK_CHARS at a time, with a progress line per chunk when there are several."""
    total = sum(len(doc) for doc in docs)
    eos = np.array([tok.eos_id], dtype)
    count = done = start = 0
    with open(path, "wb") as f:
        while start < len(docs):
            end, chars = start + 1, len(docs[start])
            while end < len(docs) and chars + len(docs[end]) <= ENCODE_CHUNK_CHARS:
                chars += len(docs[end])
                end += 1
            parts = []
            for ids in tok.encode_batch(docs[start:end]):
                parts += [np.asarray(ids, dtype), eos]
            flat = np.concatenate(parts)
            f.write(flat.tobytes())
            count, done, start = count + flat.size, done + chars, end
            if chars < total:
                log(f"data: tokenized {end:,}/{len(docs):,} documents ({done / max(total, 1):.0%} of the text, "
                    f"{count:,} tokens)")
    return count


def _cache_damage(directory: Path) -> str | None:
    """Why a token cache whose meta.json (written last) exists cannot be used, or None. A file
    truncated or removed since (a full disk, a cleanup) made np.memmap fail with a bare
    "mmap length is greater than file size", or trained on a short stream."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        want = int(meta["num_tokens"]) * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json unreadable: {e}"
    tokens = directory / "tokens.bin"
    if not tokens.is_file() or tokens.stat().st_size != want:
        have = f"{tokens.stat().st_size:,} bytes" if tokens.is_file() else "missing"
        return f"tokens.bin: {have}, meta.json says {want:,}"
    try:  # (a half-written one, from before it was written atomically, failed only in `generate`)
        json.loads((directory / "tokenizer.json").read_text())
    except (OSError, ValueError) as e:
        return f"tokenizer.json unreadable: {e}"
    return None


def load_token_file(cfg: Config) -> TokenStore:
    """A pre-tokenized flat token file: .npy, or raw .bin (uint16 if vocab <= 65536, else uint32).

    Checked before training: an integer array, at least one token, and every id in
    [0, model.vocab_size) (the whole file, read in chunks: an id out of range would index past
    the embedding table, which on an accelerator does not fail but reads a clamped row).
    """
    path = Path(cfg.data.path).expanduser()  # type: ignore[arg-type]
    if not path.is_file():
        raise DataError(f"data.path={str(path)!r} is not a file (data.source=tokens reads one .npy or raw .bin token file)")
    where = f"data.path={str(path)!r}"
    if path.suffix.lower() in TEXT_SUFFIXES:  # (its bytes read as uint16 ids: ASCII pairs all pass a GPT-2 range check)
        raise DataError(f"{where} is a text file ({path.suffix}), but data.source=tokens reads .npy or raw .bin token "
                        f"ids; set data.source=text to tokenize it (data.source: text, tokens or synthetic)")
    if path.suffix.lower() == ".npy":  # (ids.NPY was read as raw ids, its header included)
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{where} is not a readable .npy file ({e})") from e
        if tokens.ndim != 1:
            raise DataError(f"{where}: expected a flat token array, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"{where}: expected integer token ids, got dtype {tokens.dtype}")
    else:
        dtype = np.dtype(np.uint16 if cfg.model.vocab_size <= 2**16 else np.uint32)
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(
                f"{where}: {size} bytes is not a whole number of {dtype.name} tokens; a raw .bin holds "
                f"{dtype.name} ids (uint16 when model.vocab_size <= 65536, else uint32)"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        head = np.asarray(tokens[:RANGE_CHECK_CHUNK])
        # uint32 ids below 65536 read as uint16 are (id, 0) pairs: every one in range, all wrong
        if dtype == np.uint16 and head.size >= 64 and not head[1::2].any():
            raise DataError(
                f"{where}: every second uint16 is 0, as in uint32 ids; a raw .bin holds uint16 ids when "
                f"model.vocab_size={cfg.model.vocab_size} <= 65536 (write it as uint16, or as .npy, which keeps its dtype)"
            )
    if tokens.size == 0:
        raise DataError(f"{where} holds no tokens")
    check_token_range(tokens, cfg.model.vocab_size, where)
    return TokenStore(path.parent, tokens, -1, cfg.model.vocab_size, int(tokens.size * (1 - cfg.data.eval_fraction)))


def check_token_range(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Raise DataError unless every id is in [0, vocab_size); reads the array in chunks."""
    for start in range(0, len(tokens), RANGE_CHECK_CHUNK):
        chunk = np.asarray(tokens[start : start + RANGE_CHECK_CHUNK])
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or hi >= vocab_size:
            bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0]
            raise DataError(
                f"{where}: token id {int(chunk[bad])} at position {start + int(bad):,} is outside "
                f"[0, model.vocab_size={vocab_size})"
            )


# --------------------------------------------------------------------------- batches


@dataclasses.dataclass
class Batches:
    """Deterministic batches of windows from a token array.

    Batch i holds windows perm_e[j] for the flat indices j in [i*B, (i+1)*B) over the
    concatenation of per-epoch permutations perm_e (seeded by (seed, e)). This process
    yields only rows [p*B/P, (p+1)*B/P) of each global batch.

    Iteration goes by flat index (`next_row`), so a run resumed with another batch size
    carries on with the window after the last one it trained on: batch i of the resumed run
    starts at next_row, not at i*B_new (which skipped or repeated windows).
    """

    tokens: np.ndarray
    seq_len: int
    global_batch: int
    seed: int
    process_index: int = 0
    process_count: int = 1
    shuffle: bool = True
    next_index: int = 0  # batches yielded so far
    next_row: int = 0  # flat index of the next batch's first window: the loader's position

    def __post_init__(self):
        self.num_windows = (len(self.tokens) - 1) // self.seq_len
        if self.num_windows < 1:
            raise DataError(f"{len(self.tokens)} tokens are fewer than one sequence of train.seq_len={self.seq_len} + 1")
        _check_processes(self)
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            if not self.shuffle:
                perm = np.arange(self.num_windows)
            else:
                perm = np.random.default_rng((self.seed, epoch)).permutation(self.num_windows)
            self._perm_cache = {epoch: perm}  # keep one epoch: O(windows) memory
        return self._perm_cache[epoch]

    def batch(self, index: int) -> np.ndarray:
        """This process's rows of global batch `index`: int32 [B/P, seq_len + 1]."""
        return self._rows_from(index * self.global_batch)

    def _rows_from(self, first: int) -> np.ndarray:
        """This process's rows of the global batch whose first window has flat index `first`."""
        rows = self.global_batch // self.process_count
        start = first + self.process_index * rows
        out = np.empty((rows, self.seq_len + 1), np.int32)
        for r in range(rows):
            epoch, j = divmod(start + r, self.num_windows)
            w = int(self._perm(epoch)[j])
            out[r] = self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1]
        return out

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        b = self._next_rows()
        self.next_index += 1
        self.next_row += self.global_batch
        return b

    def _next_rows(self) -> np.ndarray:
        return self._rows_from(self.next_row)

    def state(self) -> dict:
        return {"next_index": self.next_index, "next_row": self.next_row}

    def restore(self, state: dict) -> None:
        """Continue where `state` (a checkpoint's meta `loader`) left off: at its next_row, or, in
        a checkpoint from before next_row was kept, at next_index batches of this batch size."""
        index = state.get("next_index") if isinstance(state, dict) else None
        # (int() would truncate 3.7 to 3, and a negative index failed deep inside numpy's RNG)
        if not _count(index):
            raise DataError(f"loader state {state!r}: next_index must be an integer >= 0 (the index of the next batch)")
        row = state.get("next_row", int(index) * self.global_batch)
        if not _count(row):
            raise DataError(f"loader state {state!r}: next_row must be an integer >= 0 (the next window's flat index)")
        self.next_index, self.next_row = int(index), int(row)


def _check_processes(b: Batches) -> None:
    # (a 1-based rank, process_index == process_count, read the next batch's rows: windows that
    # another process also trains on, silently)
    if not (isinstance(b.process_count, numbers.Integral) and b.process_count >= 1
            and isinstance(b.process_index, numbers.Integral) and 0 <= b.process_index < b.process_count):
        raise DataError(f"process_index={b.process_index!r} must be an integer in [0, process_count={b.process_count!r}) "
                        f"(jax.process_index() of jax.process_count())")
    if b.global_batch % b.process_count:
        raise DataError(f"train.batch_size={b.global_batch} is not divisible by the {b.process_count} processes")


def _count(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


@dataclasses.dataclass
class SyntheticBatches(Batches):
    """Uniform random tokens, a deterministic function of (seed, batch index)."""

    vocab_size: int = 0

    def __post_init__(self):
        _check_processes(self)

    def _next_rows(self) -> np.ndarray:
        # (by batch index: each batch is its own draw, whatever the batch size before it)
        return self.batch(self.next_index)

    def batch(self, index: int) -> np.ndarray:
        rows = self.global_batch // self.process_count
        rng = np.random.default_rng((self.seed, index))
        full = rng.integers(0, self.vocab_size, (self.global_batch, self.seq_len + 1), dtype=np.int32)
        return full[self.process_index * rows : (self.process_index + 1) * rows]


@dataclasses.dataclass(frozen=True)
class Dataset:
    train: Batches
    eval: Batches | None
    tokenizer_path: Path | None
    eos_id: int


def make_dataset(cfg: Config, *, process_index: int = 0, process_count: int = 1, log=print) -> Dataset:
    t, d = cfg.train, cfg.data
    if d.source == DataSource.synthetic:
        mk = lambda seed: SyntheticBatches(  # noqa: E731
            np.zeros(0), t.seq_len, t.batch_size, seed, process_index, process_count, vocab_size=cfg.model.vocab_size
        )
        return Dataset(mk(t.seed), mk(t.seed + 1_000_003), None, -1)
    if d.source == DataSource.text:
        store = build_token_store(cfg, log)
        # (a token file is range-checked whole by load_token_file; our tokenizer's ids are
        # below its vocab_size, checked against the model's when the store is built)
        check_token_range(store.tokens[: min(len(store.tokens), 1_000_000)], cfg.model.vocab_size, "data")
    else:
        store = load_token_file(cfg)
    train_tokens = store.split("train")
    if len(train_tokens) < t.seq_len + 1:
        where = f"data.path={d.path!r}" if d.path is not None else "the default corpus"
        raise DataError(
            f"{where}: the training split has {len(train_tokens):,} tokens (of {len(store.tokens):,}, less the "
            f"held-out data.eval_fraction={d.eval_fraction}), fewer than one window of train.seq_len={t.seq_len} + 1; "
            f"use more data or a shorter train.seq_len"
        )
    train = Batches(train_tokens, t.seq_len, t.batch_size, t.seed, process_index, process_count)
    # Eval walks the held-out split in order, always from its start (same batches each eval).
    eval_tokens = store.split("eval")
    ev = None
    windows = max(len(eval_tokens) - 1, 0) // t.seq_len
    if t.eval_every and windows < t.batch_size:
        # One eval batch would wrap around the split and count some windows twice.
        where = f"data.path={d.path!r}" if d.path is not None else "the default corpus"
        raise DataError(
            f"{where}: the held-out split (data.eval_fraction={d.eval_fraction} of {len(store.tokens):,} tokens) "
            f"holds {windows} windows of train.seq_len={t.seq_len} + 1, fewer than one eval batch of "
            f"train.batch_size={t.batch_size}; raise data.eval_fraction, or set train.eval_every=0 to train without eval"
        )
    if windows >= 1:
        ev = Batches(eval_tokens, t.seq_len, t.batch_size, 0, process_index, process_count, shuffle=False)
    tok_path = store.tokenizer_path if store.tokenizer_path.exists() else None
    return Dataset(train, ev, tok_path, store.eos_id)


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the empirical unigram distribution: the loss of a context-free model."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
