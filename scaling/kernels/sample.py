"""Sampling a token per row (temperature, top-k, top-p) as one Pallas kernel, without a sort.

`scaling.decode.sample` (the reference) masks the logits to the top-k and top-p set, then draws
with `jax.random.categorical`, which is argmax(z + g) with g Gumbel noise from the row's key
(the Gumbel-max trick: Gumbel 1954; Maddison, Tarlow, Minka 2014, "A* Sampling"). On an H200 the
two sorts behind `lax.top_k` and the top-p threshold (cub radix sorts of the vocabulary) and ~15
small XLA kernels cost 30-110 µs a decode step (docs/benchmarks.md, issue 8, thirty-second
session): with top-p, a sixth of the 1b's sampled step.

The kernel draws the same token from the same noise without sorting. With the noise fixed, the
reference's token is the largest z + g inside the kept set. So it visits the tokens in decreasing
z + g (the "candidates") and takes the first one the masks keep; membership of one token is one
pass over the row:
- top-k keeps z_i iff fewer than k tokens have a larger z (ties with the k-th are kept, as
  `z >= kth` keeps them in the reference);
- top-p keeps z_i iff the mass of the tokens with a larger z is below top_p (the reference keeps
  a prefix of the sorted tokens while the mass before each is below top_p, then every token at
  least as large as the last one kept).
The first candidate is kept with probability about the kept set's mass (top_p or more under
top-p), so one or two candidates usually do. After `max_candidates` rejected ones (a flat
distribution with a small k) the kernel finds the kept set's threshold by a radix search over the
floats' order-preserving integer keys (RADIX_BITS a pass, 16 thresholds tested at once: 8 passes)
and takes the largest z + g above it. With top-k and top-p together, top-p's mass is over the
top-k set, whose sum lies between the mass at or above a candidate in it and the whole row's;
where those bounds do not decide, the k-th value is found by the radix search first.

Parallel rows (the thirty-third session): one program a row reads a 128K vocabulary at one SM's
bandwidth: on an H200 at batch 1, 74 µs a call with temperature alone and 110-170 µs with top-p,
slower than the sorts. So a row's chunks are spread over `splits` programs (plan_splits: all of
the grid resident on the GPU at once); every pass above is a local fold over the program's
chunks, then an exchange of [WIDTH] partials through global memory behind a per-row barrier
(`gather`), after which every program of the row holds the same reduced values and takes the
same branch. A program's share of the row is one chunk where it fits (`plan_chunk`, up to 8K):
its loop over chunks waits for each chunk's loads in turn (thirty-fourth session). Interpret mode
plays a row's splits one after another in one program through the same exchange, without the
barrier.

Numerics: the masses are f32 sums in another order than the reference's cumsum, so where a
token's mass lies within rounding of top_p the two may keep different sets (never seen in the
tests; the chosen token then differs only if that token wins the draw).

Layout: logits and noise [B, V] f32, the row in chunks of `chunk` (padded with -inf logits);
returns the token [B] int32 and its log-probability under the unmasked model [B] f32, as
`decode.sample` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

CHUNK = 1024  # a row's values per load (a power of two, as Triton's blocks): the smallest plan_chunk takes
MAX_CHUNK = 8192  # the largest, with 16 warps (32 values a thread per array)
MAX_CANDIDATES = 8  # rejected candidates before the radix search
DEEP_RANK = 8  # with top-k: a rejected candidate with this many times k larger tokens ends the candidates
NO_INDEX = 2**30
WIDTH = 16  # a program's partial: up to 16 fields; a radix round's pivots
RADIX_BITS = 4  # bits of the threshold's key found per round (WIDTH = 2**RADIX_BITS)
INT_MIN = -(2**31)
EXCHANGES = (0, 1)  # sample_rows(exchange=): atomics; volatile loads behind the barrier's last read
# _key(-inf) and _key(+inf), as literals: Pallas' Triton lowering cannot bitcast a constant
KEY_OF_MINUS_INF = -2139095041
KEY_OF_PLUS_INF = 2139095040


def _key(x):
    """f32 -> int32 with the floats' order (negative floats' magnitude bits flipped)."""
    b = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b >= 0, b, b ^ jnp.int32(0x7FFFFFFF))


def _value(k):
    return lax.bitcast_convert_type(jnp.where(k >= 0, k, k ^ jnp.int32(0x7FFFFFFF)), jnp.float32)


def _value_clamped(k):
    """_value, with the NaN keys beyond +-inf's read as +-inf (the radix rounds' pivots reach them)."""
    return jnp.where(k < KEY_OF_MINUS_INF, -jnp.inf, jnp.where(k > KEY_OF_PLUS_INF, jnp.inf, _value(k)))


def _programs(programs: int | None) -> int:
    """The programs resident at once: the GPU's SMs (1 off the GPU), unless given."""
    if programs is not None:
        return programs
    return int(getattr(jax.devices()[0], "core_count", 0) or 132) if jax.default_backend() == "gpu" else 1


def plan_splits(batch: int, vocab: int, chunk: int = CHUNK, programs: int | None = None) -> tuple[int, int]:
    """(splits, chunks per split): each row's chunks spread over up to programs // batch programs
    (programs: the GPU's SMs), so that every program of the grid is resident at once (the programs of
    a row meet at barriers: one waiting for a program not yet started would wait forever)."""
    n_chunks = -(-vocab // chunk)
    programs = _programs(programs)
    want = max(1, min(n_chunks, programs // batch))
    per = -(-n_chunks // want)
    return -(-n_chunks // per), per


def plan_chunk(batch: int, vocab: int, programs: int | None = None) -> tuple[int, int]:
    """(chunk, num_warps): a program's loop over its chunks runs one load after another, so a
    program should hold one chunk where it can: the row's share of a program, as a power of two in
    [CHUNK, MAX_CHUNK], with 16 warps at MAX_CHUNK. Measured on an H200 (docs/benchmarks.md,
    thirty-fourth session; chunks of 1-8K with 8 or 16 warps, top-k and top-p, batches 1, 8 and 64,
    vocabularies 32,000 and 128,256): the fastest in every case at batches 8 and 64 (at 64, 1.65-2.2x
    faster than chunks of 1K); at batch 1 chunks of 1K and 2K trade places within 6%, except two
    top-p cases where 2K took 14-15% less time."""
    share = -(-vocab // max(1, _programs(programs) // batch))
    chunk = min(MAX_CHUNK, max(CHUNK, 1 << (share - 1).bit_length()))
    return chunk, 16 if chunk >= MAX_CHUNK else 8


def _sample_kernel(scal_ref, logits_ref, noise_ref, _count_in, tok_ref, lp_ref, part_ref, count_ref, *,
                   vocab: int, chunk: int, n_chunks: int, per_split: int, splits: int, top_k: int | None,
                   use_top_p: bool, max_candidates: int, exchange: int, interpret: bool):
    row = pl.program_id(0)
    me = pl.program_id(1)  # (interpret mode: one program a row, which plays every split in turn)
    temperature, top_p = scal_ref[0], scal_ref[1]
    ids0 = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    lane = lax.broadcasted_iota(jnp.int32, (WIDTH,), 0)
    s_pad = part_ref.shape[2]
    split_ok = lax.broadcasted_iota(jnp.int32, (s_pad,), 0) < splits
    f32 = jnp.float32
    NO_FLOOR = f32(-jnp.inf)

    def chunk_at(i):
        """Chunk i: its logits, z = logits / T and indices (padding: -inf)."""
        ids = ids0 + i * chunk
        x = logits_ref[row, pl.ds(i * chunk, chunk)]
        x = jnp.where(ids < vocab, x, -jnp.inf)
        return x, x / temperature, ids

    def fold(sp, fn, init):
        """fn(acc, i, x, z, ids) over split sp's chunks (each split's first chunk holds a real token)."""
        lo = sp * per_split
        return lax.fori_loop(lo, jnp.minimum(lo + per_split, n_chunks), lambda i, acc: fn(acc, i, *chunk_at(i)), init)

    # --- the row's programs exchange partials: each writes a [WIDTH] vector, all read all ---
    def pack(*vals):
        vec = jnp.zeros((WIDTH,), f32)
        for k, v in enumerate(vals):
            vec = jnp.where(lane == k, jnp.asarray(v).astype(f32), vec)
        return vec

    def field(vec, k):
        return jnp.max(jnp.where(lane == k, vec, -jnp.inf))

    def column(mat, k):  # [s_pad]
        return jnp.max(jnp.where(lane[None, :] == k, mat, -jnp.inf), axis=1)

    def summed(mat):  # [WIDTH]: the fields summed over the splits
        return jnp.sum(jnp.where(split_ok[:, None], mat, 0.0), axis=0)

    def gather(local):
        """local(split) -> [WIDTH]; returns [s_pad, WIDTH], row sp split sp's (rows >= splits: junk).

        On the GPU every program of the row stores its partial, then meets the others at a barrier:
        a per-row counter that each arrival adds 1 to (acquire-release, GPU scope, after a CTA barrier
        so that it publishes every thread's stores), read until all `splits` of this round have
        arrived; then it reads every partial. Round n's partials go to slot n % 2: a program writes
        round n + 1's only after every program has arrived at round n's barrier, so after their
        reads of round n - 1's (same slot as n + 1)."""
        if interpret:  # programs run one after another: one plays them all
            for sp in range(splits):
                part_ref[row, 0, sp, :] = local(sp)
            count_ref[row] = count_ref[row] + splits  # (the arrivals, as counted on the GPU)
            return part_ref[row, 0]
        if splits == 1:
            return local(me)[None, :]
        from jax.experimental.pallas import triton as plgpu

        # exchange 0: atomics for every access to the shared state (the thirty-third session's
        # way: with volatile loads of the partials issued right after the barrier, 18% of the tokens
        # were wrong at batch 64 with 2 splits on an H200, 40-52% at batch 1 with flat top-k=50).
        # exchange 1 (the default): volatile loads at an address computed from the spin loop's last
        # counter read, so that none can be issued before the barrier is passed: every token right
        # on the H200, and a draw 1.17-1.5x faster at batch 1 (docs/benchmarks.md, thirty-fourth
        # session). (Pallas' ".cg" loads, past L1, fail to lower in jax 0.11.2.)
        read_count = lambda: plgpu.atomic_add(count_ref, row, jnp.int32(0))  # noqa: E731
        # Round n: the counter is in [n S, (n + 1) S) until this program arrives
        n = read_count() // splits
        slot = n % 2
        plgpu.atomic_xchg(part_ref, (row, slot, me, pl.ds(0, WIDTH)), local(me))
        plgpu.debug_barrier()  # (every thread's stores before the arrival)
        plgpu.atomic_add(count_ref, row, jnp.int32(1))
        target = (n + 1) * splits
        seen = lax.while_loop(lambda c: c < target, lambda c: read_count(), read_count())
        plgpu.debug_barrier()  # (the one thread's acquire before every thread's reads)
        if exchange == 0:
            return plgpu.atomic_add(part_ref, (row, slot, pl.ds(0, s_pad), pl.ds(0, WIDTH)),
                                    jnp.zeros((s_pad, WIDTH), f32))
        # (seen // splits is n + 1: no program passes round n + 1's barrier before this one arrives)
        seen_slot = (seen // splits + 1) % 2
        return plgpu.load(part_ref.at[row, seen_slot, pl.ds(0, s_pad), pl.ds(0, WIDTH)], volatile=True)

    def best(mat, base):
        """The splits' candidates (columns base.. : y, index, logit, z): the largest y, then the
        smallest index."""
        y, i, x, z = (column(mat, base + j) for j in range(4))
        by = jnp.max(jnp.where(split_ok, y, -jnp.inf))
        bi = jnp.min(jnp.where(split_ok & (y == by), i, f32(NO_INDEX)))
        pick = split_ok & (i == bi)
        return by, bi, jnp.max(jnp.where(pick, x, -jnp.inf)), jnp.max(jnp.where(pick, z, -jnp.inf))

    def candidate_step(a, i, x, z, ids, prev_y, prev_i, floor):
        """A chunk's step of the search for the largest y = z + g after (prev_y, prev_i) in
        (y descending, index ascending) order among z >= floor: (y, index, logit, z)."""
        by, bi, bx, bz = a
        y = noise_ref[row, pl.ds(i * chunk, chunk)] + z
        after = (y < prev_y) | ((y == prev_y) & (ids > prev_i))
        y = jnp.where(after & (ids < vocab) & (z >= floor), y, -jnp.inf)
        cy = jnp.max(y)
        ci = jnp.min(jnp.where(y == cy, ids, NO_INDEX))
        cx = jnp.sum(jnp.where(ids == ci, x, 0.0))
        cz = jnp.sum(jnp.where(ids == ci, z, 0.0))
        better = (cy > by) | ((cy == by) & (ci < bi))
        return (jnp.where(better, cy, by), jnp.where(better, ci, bi), jnp.where(better, cx, bx),
                jnp.where(better, cz, bz))

    NO_CANDIDATE = (f32(-jnp.inf), jnp.int32(NO_INDEX), f32(0.0), f32(0.0))

    def candidate(prev_y, prev_i, floor):
        """The row's next candidate (see candidate_step): one exchange."""
        def local(sp):
            return pack(*fold(sp, lambda a, i, x, z, ids: candidate_step(a, i, x, z, ids, prev_y, prev_i, floor),
                              NO_CANDIDATE))
        return best(gather(local), 0)

    # --- round 1: the statistics and the first candidate ---
    def stats_and_first(sp):
        """Online sums (each rescaled to a new max): the largest logit m, the log-softmax's sum of
        exp(x - m), the sum of exp(z - m / T) (top-p's total where no top-k narrows it; z's max
        is m / T, as T > 0); and the split's first candidate."""
        def fn(a, i, x, z, ids):
            m, s, total, cand = a
            m_new = jnp.maximum(m, jnp.max(x))  # (finite from the split's first chunk on)
            s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new))
            total = total * jnp.exp(m / temperature - m_new / temperature) + jnp.sum(jnp.exp(z - m_new / temperature))
            return m_new, s, total, candidate_step(cand, i, x, z, ids, f32(jnp.inf), jnp.int32(-1), NO_FLOOR)
        m, s, total, cand = fold(sp, fn, (f32(-jnp.inf), f32(0.0), f32(0.0), NO_CANDIDATE))
        return pack(m, s, total, *cand)

    mat = gather(stats_and_first)
    ms = column(mat, 0)
    m = jnp.max(jnp.where(split_ok, ms, -jnp.inf))
    s = jnp.sum(jnp.where(split_ok, column(mat, 1) * jnp.exp(ms - m), 0.0))
    total_all = jnp.sum(jnp.where(split_ok, column(mat, 2) * jnp.exp(ms / temperature - m / temperature), 0.0))
    mz = m / temperature
    y, tok, x_tok, z_tok = best(mat, 3)

    def counts_at_least(t):  # [WIDTH]: tokens with z >= t, for WIDTH thresholds t
        return summed(gather(lambda sp: fold(
            sp, lambda a, i, x, z, ids: a + jnp.sum(jnp.where(z[:, None] >= t[None, :], 1.0, 0.0), axis=0),
            jnp.zeros((WIDTH,), f32))))

    def masses_above(t, floor):  # [WIDTH]: sums of exp(z - mz) over z > t and z >= floor
        def fn(a, i, x, z, ids):
            keep = (z[:, None] > t[None, :]) & (z >= floor)[:, None]
            return a + jnp.sum(jnp.where(keep, jnp.exp(z - mz)[:, None], 0.0), axis=0)
        return summed(gather(lambda sp: fold(sp, fn, jnp.zeros((WIDTH,), f32))))

    def smallest_true(quantities, pred, lo, hi):
        """The smallest key in [lo, hi] whose value satisfies pred (false below it, true from it;
        true at hi): a radix search over the keys, RADIX_BITS a round, one exchange a round.
        quantities(t [WIDTH]) -> [WIDTH], pred of those -> bool [WIDTH]. Keys are searched in
        the unsigned order of u = key ^ INT_MIN; invariant: pred is false at u = prefix (read as
        -inf there at the start) and true at prefix + 2**(shift + RADIX_BITS)."""
        def round_(r, prefix):
            shift = 32 - RADIX_BITS * (r + 1)
            t = _value_clamped((prefix | (lane << shift)) ^ INT_MIN)
            false_above_prefix = jnp.sum(jnp.where((lane >= 1) & ~pred(quantities(t)), 1, 0))
            return prefix | (false_above_prefix << shift)
        prefix = lax.fori_loop(0, 32 // RADIX_BITS, round_, jnp.int32(0))
        return jnp.clip((prefix + 1) ^ INT_MIN, lo, hi)

    def kth_value():
        """The k-th largest z: the largest key with count(z >= value) >= k, one below the smallest
        with fewer."""
        key = smallest_true(counts_at_least, lambda c: c < top_k, jnp.int32(KEY_OF_MINUS_INF), _key(mz) + 1)
        return _value(key - 1)

    both = top_k is not None and use_top_p

    def top_k_set():
        """(both) The k-th value and the top-k set's sum of exp(z - mz): top-p's mass is over that
        set. 9 exchanges: only where a candidate's bounds below do not decide."""
        kth = kth_value()
        return kth, field(masses_above(jnp.full((WIDTH,), -jnp.inf, f32), kth), 0)

    def kept(zc, above_count, above, at_or_above):
        if top_k is not None:  # fewer than k larger (ties with the k-th kept)
            in_k = above_count < top_k
            if not use_top_p:
                return in_k
        if not both:  # top-p alone: the mass of the larger ones below top_p
            return above < top_p * total_all
        # Both: the top-k set's sum Z lies between the mass at or above a token in it (all of those
        # are in it) and the whole row's, which mostly decides without the k-th value.
        sure_in = in_k & (above < top_p * at_or_above)
        sure_out = (~in_k) | (above >= top_p * total_all)

        def exact():
            _, total = top_k_set()
            return above < top_p * total  # (in_k: the larger ones are all in the set)
        return lax.cond(sure_in | sure_out, lambda: sure_in, exact)

    def probe(zc, prev_y, prev_i):
        """One exchange: the candidate zc's membership sums (tokens with z > zc; exp(z - mz) over
        z > zc and over z >= zc) and the next candidate after (prev_y, prev_i)."""
        def local(sp):
            def fn(a, i, x, z, ids):
                cnt, above, at, cand = a
                e = jnp.exp(z - mz)
                return (cnt + jnp.sum(jnp.where(z > zc, 1.0, 0.0)), above + jnp.sum(jnp.where(z > zc, e, 0.0)),
                        at + jnp.sum(jnp.where(z >= zc, e, 0.0)), candidate_step(cand, i, x, z, ids, prev_y, prev_i,
                                                                                NO_FLOOR))
            cnt, above, at, cand = fold(sp, fn, (f32(0.0), f32(0.0), f32(0.0), NO_CANDIDATE))
            return pack(cnt, above, at, *cand)
        mat = gather(local)
        sums = summed(mat)
        return (field(sums, 0), field(sums, 1), field(sums, 2)), best(mat, 3)

    if top_k is not None or use_top_p:
        def body(c):
            n, y, i, x, z, tok, x_tok, _, _ = c
            sums, nxt = probe(z, y, i)
            keep = kept(z, *sums)
            # A candidate that deep below the k-th: the row is flat for this k (the next candidates
            # land in the top k about as often as the top k's share of the mass), so the search
            # goes straight to the threshold.
            deep = (sums[0] >= DEEP_RANK * top_k) if top_k is not None else n < 0  # (a traced False)
            return (n + 1, *nxt, jnp.where(keep, i, tok), jnp.where(keep, x, x_tok), keep, deep)

        *_, tok, x_tok, found, _ = lax.while_loop(
            lambda c: (~c[7]) & (~c[8]) & (c[0] <= max_candidates), body,
            (jnp.int32(0), y, tok, x_tok, z_tok, tok, x_tok, jnp.bool_(False), jnp.bool_(False)))

        def fallback():
            """The kept set's floor by a radix search, then its largest z + g."""
            if use_top_p:  # the smallest t whose larger tokens' mass is below top_p (over the top-k set)
                # (below kth the mass above is all of the top-k set's, so t >= kth)
                kth, total = top_k_set() if both else (NO_FLOOR, total_all)
                floor = _value(smallest_true(lambda t: masses_above(t, kth), lambda q: q < top_p * total,
                                             _key(kth) if both else jnp.int32(KEY_OF_MINUS_INF), _key(mz)))
            else:
                floor = kth_value()
            _, i, x, _ = candidate(f32(jnp.inf), jnp.int32(-1), floor)
            return i, x

        tok, x_tok = lax.cond(found, lambda: (tok, x_tok), fallback)

    @pl.when(me == 0)
    def _():
        tok_ref[row] = tok.astype(jnp.int32)
        lp_ref[row] = (x_tok - m) - jnp.log(s)


def _check_scalar(name: str, x, ok, allowed: str) -> None:
    """temperature and top_p are one value for the whole batch (shape ()); a concrete value (not
    a tracer, whose value is unknown until run) must also be finite and satisfy ok (None: any)."""
    shape = np.shape(x)
    if shape != ():
        raise ValueError(f"{name} must be a scalar (one value for every row), got shape {shape}")
    if ok is None or isinstance(x, jax.core.Tracer):
        return
    value = float(np.asarray(x))
    if not (np.isfinite(value) and ok(value)):
        raise ValueError(f"{name}={value!r} must be finite{' and ' + allowed if allowed else ''}")


def sample_rows(logits_bv, noise_bv, temperature, top_p, *, top_k: int | None = None, use_top_p: bool = False,
                max_candidates: int = MAX_CANDIDATES, splits: int | None = None, chunk: int | None = None,
                num_warps: int | None = None, exchange: int = 1, interpret: bool | None = None,
                return_counters: bool = False):
    """One token per row drawn as `decode.sample` draws it from the same Gumbel noise
    (noise_bv = jax.random.gumbel(key_b, (V,)) per row): (token [B] int32, its log-prob [B] f32).

    logits, noise [B, V]; temperature (> 0) and top_p (in (0, 1], read only with use_top_p) are
    scalars, their values checked where they are concrete (not traced); top_k: None or an int
    in [1, V].

    splits: programs per row (default: plan_splits', as many as the GPU holds at once; 1 in
    interpret mode); chunk: a row's values per load (a power of two); chunk and num_warps default to
    plan_chunk's for the batch and vocabulary; exchange: how the GPU reads the shared partials (0
    atomics, 1 volatile loads; see gather; no effect in interpret mode). return_counters: also return
    the rows' barrier counters (exchanges x splits; a diagnostic; 0 on the GPU with one split)."""
    if getattr(logits_bv, "ndim", None) != 2:
        raise ValueError(f"logits must be 2-D [B, V], got shape {getattr(logits_bv, 'shape', None)}")
    b, v = logits_bv.shape
    if b < 1 or v < 1:
        raise ValueError(f"logits [B, V] must have at least one row and one token, got shape {(b, v)}")
    if getattr(noise_bv, "shape", None) != (b, v):
        raise ValueError(f"noise must be {(b, v)} like the logits, got {getattr(noise_bv, 'shape', None)}")
    if top_k is not None:
        # A static count (it shapes the kernel's control flow): a Python or NumPy int, not an array.
        if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
            raise TypeError(f"top_k must be an int or None, got {top_k!r} ({type(top_k).__name__})")
        top_k = int(top_k)
        if not 1 <= top_k <= v:
            raise ValueError(f"top_k={top_k} must be in [1, {v}]")
    if not isinstance(use_top_p, (bool, np.bool_)):
        raise TypeError(f"use_top_p must be True or False, got {use_top_p!r}")
    use_top_p = bool(use_top_p)
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 0:
        raise ValueError(f"max_candidates={max_candidates!r} must be an int >= 0")
    _check_scalar("temperature", temperature, lambda t: t > 0, "> 0")
    if use_top_p:
        _check_scalar("top_p", top_p, lambda p: 0 < p <= 1, "in (0, 1]")
    else:  # (unused: its value is not read)
        _check_scalar("top_p", top_p, None, "")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    planned_chunk, planned_warps = plan_chunk(b, v, programs=b if interpret else None)
    chunk = planned_chunk if chunk is None else chunk
    num_warps = planned_warps if num_warps is None else num_warps
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk} must be a power of two >= 16")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps={num_warps} must be one of 1, 2, 4, 8, 16, 32")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange} must be one of {EXCHANGES}")
    n_chunks = -(-v // chunk)
    if splits is None:
        splits, per_split = plan_splits(b, v, chunk, programs=b if interpret else None)
    else:
        if not 1 <= splits <= n_chunks:
            raise ValueError(f"splits={splits} must be in [1, {n_chunks}] (the row's chunks of {chunk})")
        per_split = -(-n_chunks // splits)
        splits = -(-n_chunks // per_split)  # (no split without a chunk)
    pad = n_chunks * chunk - v
    logits = jnp.pad(logits_bv.astype(jnp.float32), ((0, 0), (0, pad)))
    noise = jnp.pad(noise_bv.astype(jnp.float32), ((0, 0), (0, pad)))
    scal = jnp.stack([jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32)])
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    s_pad = 1 << (splits - 1).bit_length()
    kernel = functools.partial(_sample_kernel, vocab=v, chunk=chunk, n_chunks=n_chunks, per_split=per_split,
                               splits=splits, top_k=top_k, use_top_p=use_top_p, max_candidates=max_candidates,
                               exchange=exchange, interpret=interpret)
    tok, lp, _, counters = pl.pallas_call(
        kernel,
        grid=(b, 1 if interpret else splits),
        out_shape=(jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32),
                   jax.ShapeDtypeStruct((b, 2, s_pad, WIDTH), jnp.float32),  # the exchanged partials
                   jax.ShapeDtypeStruct((b,), jnp.int32)),  # the barriers' counters
        input_output_aliases={3: 3},
        compiler_params=compiler_params,
        interpret=interpret,
        name="sample_rows",
    )(scal, logits, noise, jnp.zeros((b,), jnp.int32))
    return (tok, lp, counters) if return_counters else (tok, lp)
