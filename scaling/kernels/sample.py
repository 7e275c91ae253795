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
top-p), so one or two candidates usually do. After `max_candidates` rejected ones (a flat distribution with a
small k) the kernel finds the kept set's threshold by bisection over the floats' order-preserving
integer keys, ~32 passes, and takes the largest z + g above it. With top-k and top-p together,
top-p's mass is over the top-k set, whose sum lies between the mass at or above a candidate in
it and the whole row's; where those bounds do not decide, the k-th value is found by bisection.

Numerics: the masses are f32 sums in another order than the reference's cumsum, so where a
token's mass lies within rounding of top_p the two may keep different sets (never seen in the
tests; the chosen token then differs only if that token wins the draw).

Layout: logits and noise [B, V] f32; one program per row, the row in chunks of CHUNK (padded
with -inf logits); returns the token [B] int32 and its log-probability under the unmasked model
[B] f32, as `decode.sample` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

CHUNK = 4096  # a row's values per load (a power of two, as Triton's blocks)
MAX_CANDIDATES = 8  # rejected candidates before the bisection
NO_INDEX = 2**30
# _key(-inf), as a literal: Pallas' Triton lowering cannot bitcast a constant
KEY_OF_MINUS_INF = -2139095041


def _key(x):
    """f32 -> int32 with the floats' order (negative floats' magnitude bits flipped)."""
    b = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b >= 0, b, b ^ jnp.int32(0x7FFFFFFF))


def _value(k):
    return lax.bitcast_convert_type(jnp.where(k >= 0, k, k ^ jnp.int32(0x7FFFFFFF)), jnp.float32)


def _midpoint(lo, hi):  # (lo + hi) // 2 without overflowing int32
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _sample_kernel(scal_ref, logits_ref, noise_ref, tok_ref, lp_ref, *, vocab: int, n_chunks: int,
                   top_k: int | None, use_top_p: bool, max_candidates: int):
    row = pl.program_id(0)
    temperature, top_p = scal_ref[0], scal_ref[1]
    ids0 = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)

    def chunk(i):
        """Chunk i: its logits, z = logits / T and indices (padding: -inf)."""
        ids = ids0 + i * CHUNK
        x = logits_ref[row, pl.ds(i * CHUNK, CHUNK)]
        x = jnp.where(ids < vocab, x, -jnp.inf)
        return x, x / temperature, ids

    def fold_i(fn, init):  # fn(acc, i, x, z, ids) over the row's chunks
        return lax.fori_loop(0, n_chunks, lambda i, acc: fn(acc, i, *chunk(i)), init)

    def fold(fn, init):  # fn(acc, x, z, ids)
        return fold_i(lambda acc, i, *c: fn(acc, *c), init)

    def stats(a, x, z, ids):
        """One pass, online (each running sum rescaled to a new max): the largest logit m, the
        log-softmax's sum of exp(x - m), and the sum of exp(z - m / T) (top-p's total where no
        top-k narrows it; z's max is m / T, as T > 0)."""
        m, s, total = a
        m_new = jnp.maximum(m, jnp.max(x))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new))
        total = total * jnp.exp(m / temperature - m_new / temperature) + jnp.sum(jnp.exp(z - m_new / temperature))
        return m_new, s, total

    # (the first chunk holds a real token, so m is finite from it on: no exp(-inf + inf))
    m, s, total_all = lax.fori_loop(1, n_chunks, lambda i, a: stats(a, *chunk(i)),
                                    stats((jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0)), *chunk(0)))
    mz = m / temperature
    lowest = jnp.int32(KEY_OF_MINUS_INF)  # (the bisections' lower bound: ~31 steps to mz's key either way)

    def count_at_least(t):  # tokens with z >= t
        return fold(lambda a, x, z, ids: a + jnp.sum(jnp.where(z >= t, 1, 0)), jnp.int32(0))

    def count_above(t):  # tokens with z > t
        return fold(lambda a, x, z, ids: a + jnp.sum(jnp.where(z > t, 1, 0)), jnp.int32(0))

    def mass_above(t, floor):  # the sum of exp(z - mz) over the tokens with z > t and z >= floor
        return fold(lambda a, x, z, ids: a + jnp.sum(jnp.where((z > t) & (z >= floor), jnp.exp(z - mz), 0.0)),
                    jnp.float32(0.0))

    def bisect(lo, hi, pred):
        """The smallest key in [lo, hi] whose value satisfies pred (false below it, true from it)."""
        def body(c):
            lo, hi = c
            mid = _midpoint(lo, hi)
            ok = pred(_value(mid))
            return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
        return lax.while_loop(lambda c: c[0] < c[1], body, (lo, hi))[0]

    def kth_value():
        """The k-th largest z: the largest key with count(z >= value) >= k, one below the smallest
        with fewer."""
        return _value(bisect(lowest, _key(mz) + 1, lambda t: count_at_least(t) < top_k) - 1)

    both = top_k is not None and use_top_p
    NO_FLOOR = jnp.float32(-jnp.inf)

    def top_k_set():
        """(both) The k-th value and the top-k set's sum of exp(z - mz): top-p's mass is over that
        set. A bisection, ~33 passes: only where a candidate's bounds below do not decide."""
        kth = kth_value()
        return kth, mass_above(NO_FLOOR, kth)

    def mass_above_and_at(zc):  # the sums of exp(z - mz) over z > zc and over z >= zc, one pass
        def fn(a, x, z, ids):
            e = jnp.exp(z - mz)
            return a[0] + jnp.sum(jnp.where(z > zc, e, 0.0)), a[1] + jnp.sum(jnp.where(z >= zc, e, 0.0))
        return fold(fn, (jnp.float32(0.0), jnp.float32(0.0)))

    def kept(zc):
        if top_k is not None:  # fewer than k larger (ties with the k-th kept)
            in_k = count_above(zc) < top_k
            if not use_top_p:
                return in_k
        if not both:  # top-p alone: the mass of the larger ones below top_p
            return mass_above(zc, NO_FLOOR) < top_p * total_all
        # Both: the top-k set's sum Z lies between the mass at or above a token in it (all of those
        # are in it) and the whole row's, which mostly decides without the k-th value.
        above, at_or_above = mass_above_and_at(zc)
        sure_in = in_k & (above < top_p * at_or_above)
        sure_out = (~in_k) | (above >= top_p * total_all)

        def exact():
            _, total = top_k_set()
            return above < top_p * total  # (in_k: the larger ones are all in the set)
        return lax.cond(sure_in | sure_out, lambda: sure_in, exact)

    def next_candidate(prev_y, prev_i, floor):
        """The largest y = z + g after (prev_y, prev_i) in (y descending, index ascending) order
        among z >= floor: (y, index, logit, z)."""
        def fn(a, i, x, z, ids):
            by, bi, bx, bz = a
            y = noise_ref[row, pl.ds(i * CHUNK, CHUNK)] + z
            after = (y < prev_y) | ((y == prev_y) & (ids > prev_i))
            y = jnp.where(after & (ids < vocab) & (z >= floor), y, -jnp.inf)
            cy = jnp.max(y)
            ci = jnp.min(jnp.where(y == cy, ids, NO_INDEX))
            cx = jnp.sum(jnp.where(ids == ci, x, 0.0))
            cz = jnp.sum(jnp.where(ids == ci, z, 0.0))
            better = (cy > by) | ((cy == by) & (ci < bi))
            return (jnp.where(better, cy, by), jnp.where(better, ci, bi), jnp.where(better, cx, bx),
                    jnp.where(better, cz, bz))
        return fold_i(fn, (jnp.float32(-jnp.inf), jnp.int32(NO_INDEX), jnp.float32(0.0), jnp.float32(0.0)))

    y, tok, x_tok, z_tok = next_candidate(jnp.float32(jnp.inf), jnp.int32(-1), jnp.float32(-jnp.inf))
    if top_k is not None or use_top_p:
        def body(c):
            n, y, i, x, z, _ = c
            y, i, x, z = next_candidate(y, i, jnp.float32(-jnp.inf))
            return n + 1, y, i, x, z, kept(z)

        _, _, tok, x_tok, _, found = lax.while_loop(
            lambda c: (~c[5]) & (c[0] < max_candidates), body, (jnp.int32(0), y, tok, x_tok, z_tok, kept(z_tok)))

        def fallback():
            """The kept set's floor by bisection, then its largest z + g."""
            if use_top_p:  # the smallest t whose larger tokens' mass is below top_p (over the top-k set)
                # (below kth the mass above is all of the top-k set's, so t >= kth)
                kth, total = top_k_set() if both else (NO_FLOOR, total_all)
                floor = _value(bisect(_key(kth) if both else lowest, _key(mz),
                                      lambda t: mass_above(t, kth) < top_p * total))
            else:
                floor = kth_value()
            _, i, x, _ = next_candidate(jnp.float32(jnp.inf), jnp.int32(-1), floor)
            return i, x

        tok, x_tok = lax.cond(found, lambda: (tok, x_tok), fallback)
    tok_ref[row] = tok
    lp_ref[row] = (x_tok - m) - jnp.log(s)


def sample_rows(logits_bv, noise_bv, temperature, top_p, *, top_k: int | None = None, use_top_p: bool = False,
                max_candidates: int = MAX_CANDIDATES, interpret: bool | None = None):
    """One token per row drawn as `decode.sample` draws it from the same Gumbel noise
    (noise_bv = jax.random.gumbel(key_b, (V,)) per row): (token [B] int32, its log-prob [B] f32)."""
    b, v = logits_bv.shape
    if noise_bv.shape != (b, v):
        raise ValueError(f"noise must be {(b, v)} like the logits, got {noise_bv.shape}")
    if top_k is not None and not 1 <= top_k <= v:
        raise ValueError(f"top_k={top_k} must be in [1, {v}]")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    n_chunks = -(-v // CHUNK)
    pad = n_chunks * CHUNK - v
    logits = jnp.pad(logits_bv.astype(jnp.float32), ((0, 0), (0, pad)))
    noise = jnp.pad(noise_bv.astype(jnp.float32), ((0, 0), (0, pad)))
    scal = jnp.stack([jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32)])
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=8, num_stages=1)
    kernel = functools.partial(_sample_kernel, vocab=v, n_chunks=n_chunks, top_k=top_k, use_top_p=use_top_p,
                               max_candidates=max_candidates)
    return pl.pallas_call(
        kernel,
        grid=(b,),
        out_shape=(jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32)),
        compiler_params=compiler_params,
        interpret=interpret,
        name="sample_rows",
    )(scal, logits, noise)
