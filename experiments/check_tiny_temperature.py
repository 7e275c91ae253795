"""Tiny sampling temperatures draw the greedy tokens, on both samplers (the XLA sort and the
Pallas kernel), on the machine this runs on:

    python experiments/check_tiny_temperature.py

A random 2-layer model with a 32k vocabulary, three ragged prompts, 6 new tokens; each
(temperature, top-k/top-p) case must give the greedy tokens. Exit status 1 on a difference.
"""

import sys

import jax

from scaling import decode
from scaling.config import DType, ModelConfig
from scaling.model import build_model

CFG = ModelConfig(vocab_size=32000, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=512,
                  init_std=0.3, compute_dtype=DType.bfloat16)
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40]]
CASES = ((1e-38, dict(top_k=5)), (1e-42, dict(top_p=0.9)), (1e-33, dict(top_k=3, top_p=0.5)), (1e-38, {}))


def main() -> int:
    model = build_model(CFG, seed=1)
    print(jax.devices())
    bad = 0
    for sampler in ("pallas", "xla"):
        dec = decode.Decoder(model, sampler=sampler, max_batch=4, max_len=64)
        want = dec.generate(PROMPTS, 6).tokens
        for t, extra in CASES:
            got = dec.generate(PROMPTS, 6, temperature=t, seed=4, **extra).tokens
            bad += got != want
            print(sampler, t, extra, "OK" if got == want else f"DIFF {got} vs {want}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
