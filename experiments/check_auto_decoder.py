"""Which presets `Decoder(model)` (layers="auto") runs at batch 1 on the megakernel, and whether
what it generates is what the model says (GPU machine).

    python experiments/check_auto_decoder.py --models 25m,125m,350m,1b,llama3.2_1b,tinyllama_1.1b

Per preset (random bf16 weights, `--layers` layers of the preset's shape): the auto decoder's
choice (or its reason against the megakernel); then, per prompt (batch 1), its greedy tokens
checked teacher-forced against the model's own forward over the generated sequence: the
log-prob it reported for each token against the forward's, and how far each chosen token's
log-prob is below the best one (greedy picks the best up to bf16 rounding, so only near-ties may
go the other way). The XLA decoder (layers="xla") is checked the same way beside it, so the two
columns show what bf16 rounding alone gives. Both limits (`--tol`) must hold for every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import preset  # noqa: E402  (experiments/ is on the path)
from scaling import decode  # noqa: E402
from scaling.model import build_model  # noqa: E402


def forced(model, prompt, tokens, logprobs) -> dict:
    """The decoded tokens against the model's forward over prompt + tokens (teacher-forced)."""
    seq, n = list(prompt) + list(tokens), len(tokens)
    logp = np.asarray(jax.nn.log_softmax(model(jnp.array([seq[:-1]]))[0].astype(jnp.float32)))
    rows = logp[len(prompt) - 1: len(prompt) - 1 + n]
    chosen = rows[np.arange(n), tokens]
    return {"logprob_diff": float(np.max(np.abs(np.asarray(logprobs) - chosen))),
            "below_best": float(np.max(rows.max(axis=-1) - chosen))}


def compare(model, prompts, new: int, layers: str, tol: float) -> dict:
    out = {}
    for impl in (layers, "xla"):
        dec = decode.Decoder(model, layers=impl)
        t = time.perf_counter()
        checks = []
        for p in prompts:  # (one at a time: batch 1)
            g = dec.generate([p], new)
            checks.append(forced(model, p, g.tokens[0], g.logprobs[0]))
        worst = {k: round(max(c[k] for c in checks), 4) for k in checks[0]}
        out[impl] = dict(worst, secs=round(time.perf_counter() - t, 1), megakernel=dec.megakernel,
                         reason=dec.auto_megakernel_reason)
    out["ok"] = all(v < tol for v in (out[layers]["logprob_diff"], out[layers]["below_best"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="25m,125m,350m,1b,llama3.2_1b,tinyllama_1.1b")
    ap.add_argument("--layers", type=int, default=2, help="layers of each preset's shape (0: all)")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--impl", default="auto", help="the decoder checked (beside layers='xla')")
    ap.add_argument("--tol", type=float, default=5e-2, help="limit of both measures, in nats")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    result = {}
    for name in args.models.split(","):
        cfg = preset(name)
        if args.layers:
            cfg = dataclasses.replace(cfg, num_layers=args.layers)
        model = build_model(cfg, seed=1)
        prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 37, 200)]
        try:
            result[name] = compare(model, prompts, args.new_tokens, args.impl, args.tol)
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(name, json.dumps(result[name]), flush=True)
    if out := os.environ.get("OUT"):
        Path(out, "check_auto_decoder.json").write_text(json.dumps(result, indent=1))
    bad = [name for name, r in result.items() if not r.get("ok")]
    print("FAILED: " + ", ".join(bad) if bad else "all within tolerance", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
