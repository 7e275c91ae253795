"""The Pallas sampler against decode.sample on the GPU, per layout: the rows that differ, and
whether a differing token is the reference's of the draw before (a stale partial read across
calls); and the barrier counters each call leaves (exchanges x splits). Exits 1 on a difference.

    python experiments/check_sample_kernel.py [VOCAB] [KEY=INT ...]

VOCAB defaults to 128256; KEY=INT pairs are sample_rows' keyword arguments for every case
(e.g. exchange=0).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from scaling import decode  # noqa: E402
from scaling.kernels import sample as ks  # noqa: E402

KEYS = ("exchange", "num_warps", "chunk", "max_candidates")  # sample_rows' settings


def parse_args(argv):
    """[VOCAB] [KEY=INT ...] -> (vocab, kernel kwargs)."""
    vocab, kw = 128256, {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep and arg.isdigit():
            vocab = int(arg)
        elif sep and key in KEYS and value.isdigit():
            kw[key] = int(value)
        else:
            raise SystemExit(f"{arg!r}: expected VOCAB or KEY=INT with KEY in {', '.join(KEYS)}")
    return vocab, kw


V, KW = parse_args(sys.argv[1:])


def draws(fn, logits, n):
    """n draws in one jitted loop: (tokens, log-probs, counters after each draw)."""
    @jax.jit
    def run(logits):
        b = logits.shape[0]
        rows = jnp.arange(b)

        def body(i, acc):
            keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), r), i))(rows)
            tok, lp, cnt = fn(logits, keys)
            return acc[0].at[i].set(tok), acc[1].at[i].set(lp), acc[2].at[i].set(cnt)

        init = (jnp.zeros((n, b), jnp.int32), jnp.zeros((n, b), jnp.float32), jnp.zeros((n, b), jnp.int32))
        return jax.lax.fori_loop(0, n, body, init)
    return [np.asarray(a) for a in run(logits)]


def main():
    n = 30
    failed = []
    cases = [  # (batch, scale, top_k, top_p, kernel kwargs)
        (64, 1.0, None, None, dict(splits=2)), (1, 0.01, 50, None, dict()), (8, 0.01, 50, 0.9, dict()),
        (64, 3.0, None, 0.95, dict()), (1, 3.0, 50, 0.9, dict()),
    ]
    for b, scale, top_k, top_p, kw in cases:
        logits = scale * jax.random.normal(jax.random.key(1), (b, V), jnp.float32)
        sampling = decode.Sampling(greedy=False, top_k=top_k, use_top_p=top_p is not None)
        t, p = jnp.float32(0.8), jnp.float32(top_p or 1.0)
        ref_tok, ref_lp, _ = draws(lambda lg, k: (*decode.sample(lg, k, t, p, sampling), jnp.zeros(b, jnp.int32)),
                                   logits, n)

        def kern(lg, keys):
            noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
            return ks.sample_rows(lg, noise, t, p, top_k=top_k, use_top_p=top_p is not None, return_counters=True,
                                  **KW, **kw)
        tok, lp, cnt = draws(kern, logits, n)
        bad = tok != ref_tok
        stale = int(np.sum(bad[1:] & (tok[1:] == ref_tok[:-1])))
        lp_err = float(np.max(np.abs(np.where(bad, 0, lp - ref_lp))))
        rounds = sorted(set(cnt.ravel().tolist()))
        print(f"b{b} scale {scale} top_k {top_k} top_p {top_p} {kw}: differ {int(bad.sum())}/{bad.size}, "
              f"stale {stale}, lp err (same tokens) {lp_err:.2e}; counters after a call: {rounds[:6]}"
              f"{' ...' if len(rounds) > 6 else ''}", flush=True)
        if bad.any():
            failed.append((b, scale, top_k, top_p, kw))
    if failed:
        raise SystemExit(f"the kernel's tokens differ from decode.sample's in {failed}")


if __name__ == "__main__":
    main()
