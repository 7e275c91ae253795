"""(temporary) the signal's cost per phase: a CTA's wait start minus its previous phase's end (medians)."""
import json, sys
import numpy as np
from bench_streamk_chain import regions

for path in sys.argv[1:]:
    tr = json.load(open(path))
    seqs = [s for s in regions(tr).values() if any(n == "qkv" for n, _, _ in s)]
    gaps = {"qkv->attn": [], "attn->mlp": [], "mlp->qkv": []}
    for s in seqs:
        top = [(n, a, b) for n, a, b in s if n in ("qkv", "attn", "mlp", "wait_attn", "wait_mlp", "wait_qkv")]
        for (n1, a1, b1), (n2, a2, b2) in zip(top, top[1:]):
            key = {("qkv", "wait_attn"): "qkv->attn", ("attn", "wait_mlp"): "attn->mlp", ("mlp", "wait_qkv"): "mlp->qkv"}.get((n1, n2))
            if key:
                gaps[key].append(a2 - b1)
    print(path.split("/")[-2], {k: (round(float(np.median(v)), 2), round(float(np.percentile(v, 90)), 2)) for k, v in gaps.items()})
