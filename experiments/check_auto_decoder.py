"""Which presets `Decoder(model)` (layers="auto") runs at batch 1 on the megakernel, and whether
they generate as the XLA decoder does (GPU machine).

    python experiments/check_auto_decoder.py --models 25m,125m,350m,1b,llama3.2_1b,tinyllama_1.1b

Per preset (random bf16 weights, `--layers` layers of the preset's shape): the auto decoder's
choice (or its reason against the megakernel), then greedy tokens from a few prompts against
layers="xla" on the same weights. bf16 paths round differently, so near-ties may flip a token:
the report gives each prompt's common prefix and the largest log-prob difference along it; a
failure is a short prefix with a large difference, not a late flip.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import preset  # noqa: E402  (experiments/ is on the path)
from scaling import decode  # noqa: E402
from scaling.model import build_model  # noqa: E402


def compare(model, prompts, new: int, layers: str) -> dict:
    got = {}
    for impl in (layers, "xla"):
        dec = decode.Decoder(model, layers=impl)
        t = time.perf_counter()
        outs = [dec.generate([p], new) for p in prompts]  # (one at a time: batch 1)
        got[impl] = (outs, time.perf_counter() - t, dec)
    (outs, secs, dec), (refs, _, _) = got[layers], got["xla"]
    rows = []
    for out, ref in zip(outs, refs):
        (a,), (b,), (la,), (lb,) = out.tokens, ref.tokens, out.logprobs, ref.logprobs
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diff = max((abs(x - y) for x, y in zip(la[:same], lb[:same])), default=0.0)
        rows.append({"common_prefix": same, "of": len(b), "max_logprob_diff": round(diff, 4)})
    return {"megakernel": dec.megakernel, "reason": dec.auto_megakernel_reason, "calls_s": round(secs, 1),
            "prompts": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="25m,125m,350m,1b,llama3.2_1b,tinyllama_1.1b")
    ap.add_argument("--layers", type=int, default=2, help="layers of each preset's shape (0: all)")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--impl", default="auto", help="the decoder compared with layers='xla'")
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
            result[name] = compare(model, prompts, args.new_tokens, args.impl)
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(name, json.dumps(result[name]), flush=True)
    if out := os.environ.get("OUT"):
        Path(out, "check_auto_decoder.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
